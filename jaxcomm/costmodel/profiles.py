"""Model profiles: gradient tensors and per-layer FLOPs from real Flax definitions.

A profile lists a model's parameterised layers in the order the forward pass runs
them, with each layer's parameter shapes and forward FLOPs per example. Nothing
is typed in by hand: the shapes come from ``jax.eval_shape`` of ``model.init``
(no parameter is ever materialised), and the output shape of every layer is
recorded during that same abstract trace with ``flax.linen.intercept_methods``,
which also gives the execution order.

FLOPs per example (one multiply-add counts as 2):

* ``Conv``: ``2 * kh * kw * cin * cout * hout * wout`` (bias ignored)
* ``Dense``: ``2 * fan_in * fan_out``
* ``BatchNorm``: ``4`` per output element (subtract mean, scale, multiply, add)

Layers without parameters (ReLU, pooling, the residual adds) are not counted:
they are memory-bound and small next to the convolutions. Backward time is
taken as proportional to these FLOPs (backward of a layer costs about twice its
forward, for every layer alike, so the proportion is the same), and scaled so
that forward + backward of one batch takes ``batch / images_per_second`` on one
GPU: forward one third, backward two thirds.

Examples:
  >>> p = alexnet_bn()
  >>> p.num_params, p.num_tensors
  (61103144, 26)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxcomm._validate import check_int, check_positive
from jaxcomm.costmodel.simulator import GradientTensor, Workload

BATCHNORM_FLOPS_PER_ELEMENT = 4
FORWARD_SHARE = 1 / 3  # backward ~ 2x forward: dgrad + wgrad, each as costly as forward


@dataclasses.dataclass(frozen=True)
class Layer:
    """One parameterised layer.

    Attributes:
      name: the module path, joined with ``/``.
      flops: forward FLOPs per example.
      params: ``(leaf name, shape)`` of each parameter, leaf names sorted (tree order).
    """

    name: str
    flops: float
    params: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A model's layers in forward order.

    Tree order of the gradient pytree is taken to be forward order with each
    layer's leaves sorted, so backward produces the leaves in reverse tree
    order, as jaxcomm's fusion plan assumes.
    """

    name: str
    layers: tuple[Layer, ...]

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @property
    def num_tensors(self) -> int:
        return sum(len(layer.params) for layer in self.layers)

    @property
    def flops(self) -> float:
        """Forward FLOPs per example."""
        return sum(layer.flops for layer in self.layers)

    def tensor_sizes(self) -> tuple[int, ...]:
        """Elements of every gradient leaf, in tree order."""
        return tuple(math.prod(shape) for layer in self.layers for _, shape in layer.params)

    def workload(self, *, images_per_second: float, batch: int) -> Workload:
        """The one-GPU step of this model for the simulator.

        Args:
          images_per_second: one-GPU training throughput (forward + backward).
          batch: examples per GPU per step.

        Returns:
          A :class:`Workload` with gradients in backward order; each layer's
          backward time goes to the first of its leaves that backward yields,
          the layer's other leaves follow at no extra time.

        Examples:
          >>> w = alexnet_bn().workload(images_per_second=1000.0, batch=100)
          >>> round(w.forward_time + w.backward_time, 6)
          0.1
        """
        check_positive("images_per_second", images_per_second)
        check_int("batch", batch, minimum=1)
        compute = batch / images_per_second
        backward = compute * (1 - FORWARD_SHARE)
        tensors = []
        for layer in reversed(self.layers):
            layer_time = backward * layer.flops / self.flops
            for k, (_, shape) in enumerate(reversed(layer.params)):
                tensors.append(
                    GradientTensor(
                        math.prod(shape), layer_time if k == 0 else 0.0, shape=tuple(shape)
                    )
                )
        return Workload(tuple(tensors), forward_time=compute * FORWARD_SHARE, batch=batch)


def profile_module(name: str, module: nn.Module, input_shape: tuple[int, ...]) -> ModelProfile:
    """Profiles a flax.linen module on one example of ``input_shape`` (NHWC, batch 1).

    Every ``nn.Conv``, ``nn.Dense`` and ``nn.BatchNorm`` call is recorded, in
    execution order, during an abstract ``init``.

    Examples:
      >>> p = profile_module("mlp", nn.Dense(3), (1, 4))
      >>> p.layers[0].params, p.layers[0].flops
      ((('bias', (3,)), ('kernel', (4, 3))), 24)
    """
    calls: list[tuple[tuple[str, ...], nn.Module, tuple[int, ...]]] = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__" and isinstance(
            module, (nn.Conv, nn.Dense, nn.BatchNorm)
        ):
            calls.append((tuple(module.scope.path), module, tuple(out.shape)))
        return out

    def init():
        with nn.intercept_methods(record):
            return module.init(jax.random.key(0), jnp.zeros(input_shape, jnp.float32))

    variables = jax.eval_shape(init)
    flat = traverse_util.flatten_dict(variables["params"])
    layers = []
    for path, layer_module, out_shape in calls:
        owned = [(key[-1], tuple(v.shape)) for key, v in flat.items() if key[:-1] == path]
        params = tuple(sorted(owned))
        layers.append(Layer("/".join(path), _layer_flops(layer_module, params, out_shape), params))
    counted = sum(len(layer.params) for layer in layers)
    if counted != len(flat):
        missing = len(flat) - counted
        raise ValueError(f"{name}: {missing} parameter leaves outside Conv/Dense/BatchNorm")
    return ModelProfile(name, tuple(layers))


def _layer_flops(module, params, out_shape) -> int:
    per_example = math.prod(out_shape[1:])
    if isinstance(module, nn.BatchNorm):
        return BATCHNORM_FLOPS_PER_ELEMENT * per_example
    kernel = dict(params)["kernel"]
    # Conv: every output element costs kh*kw*cin multiply-adds; Dense: fan_in.
    return 2 * math.prod(kernel[:-1]) * per_example


class AlexNetBN(nn.Module):
    """AlexNet with batch normalisation after each convolution.

    The single-tower layout of torchvision's AlexNet (64, 192, 384, 256, 256
    filters; 4096, 4096, 1000 units), 224x224 input, with a BatchNorm after
    each of the five convolutions as in Jia et al. 2018 ("Highly Scalable Deep
    Learning Training System with Mixed-Precision", arXiv:1807.11205): 8
    weight layers with biases plus 5 BatchNorms = 26 gradient tensors, 61.1 M
    parameters. Dropout is left out (no parameters, no FLOPs that count).
    """

    num_classes: int = 1000

    @nn.compact
    def __call__(self, x):
        convs = ((64, 11, 4, 2), (192, 5, 1, 2), (384, 3, 1, 1), (256, 3, 1, 1), (256, 3, 1, 1))
        for i, (features, kernel, stride, pad) in enumerate(convs):
            x = nn.Conv(features, (kernel, kernel), stride, padding=pad, name=f"conv{i + 1}")(x)
            x = nn.BatchNorm(use_running_average=True, name=f"bn{i + 1}")(x)
            x = nn.relu(x)
            if i in (0, 1, 4):
                x = nn.max_pool(x, (3, 3), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096, name="fc6")(x))
        x = nn.relu(nn.Dense(4096, name="fc7")(x))
        return nn.Dense(self.num_classes, name="fc8")(x)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (stride on the 3x3 conv), as in flax/examples/imagenet."""

    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x):
        def norm():
            return nn.BatchNorm(use_running_average=True)

        y = nn.relu(norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
        y = nn.Conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(y)
        y = nn.relu(norm()(y))
        y = norm()(nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y))
        if x.shape != y.shape:
            x = nn.Conv(self.filters * 4, (1, 1), self.strides, use_bias=False, name="conv_proj")(x)
            x = nn.BatchNorm(use_running_average=True, name="norm_proj")(x)
        return nn.relu(x + y)


class ResNet50(nn.Module):
    """ResNet-50 (v1.5) as in flax/examples/imagenet: 25,557,032 parameters, 161 leaves."""

    num_classes: int = 1000

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), 2, padding=3, use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True, name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate((3, 4, 6, 3)):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Bottleneck(64 * 2**stage, strides)(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc")(x)


@functools.cache
def alexnet_bn() -> ModelProfile:
    """Profile of :class:`AlexNetBN` at 224x224 (61,103,144 parameters, 26 tensors)."""
    return profile_module("alexnet", AlexNetBN(), (1, 224, 224, 3))


@functools.cache
def resnet50() -> ModelProfile:
    """Profile of :class:`ResNet50` at 224x224 (25,557,032 parameters, 161 tensors)."""
    return profile_module("resnet50", ResNet50(), (1, 224, 224, 3))
