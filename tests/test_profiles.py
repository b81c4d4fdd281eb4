"""Model profiles against the published parameter counts and hand-computed FLOPs."""

import flax.linen as nn
import pytest

from jaxcomm.costmodel import alexnet_bn, resnet50
from jaxcomm.costmodel.profiles import profile_module


def test_alexnet_bn_counts():
    p = alexnet_bn()
    # torchvision AlexNet has 61,100,840 parameters; the 5 BatchNorms add
    # 2 * (64 + 192 + 384 + 256 + 256) = 2,304.
    assert p.num_params == 61_100_840 + 2_304
    # 8 weight layers x (kernel, bias) + 5 BatchNorms x (scale, bias), as in Jia et al. 2018.
    assert p.num_tensors == 26
    assert [layer.name for layer in p.layers][:3] == ["conv1", "bn1", "conv2"]


def test_alexnet_flops_by_hand():
    layers = {layer.name: layer.flops for layer in alexnet_bn().layers}
    assert layers["conv1"] == 2 * 11 * 11 * 3 * 64 * 55 * 55  # 224 -> 55 at stride 4, pad 2
    assert layers["conv2"] == 2 * 5 * 5 * 64 * 192 * 27 * 27
    assert layers["fc6"] == 2 * 9216 * 4096
    assert layers["bn1"] == 4 * 55 * 55 * 64


def test_resnet50_counts():
    p = resnet50()
    assert p.num_params == 25_557_032  # the published ResNet-50 count
    assert p.num_tensors == 161  # 53 convs + 53 BatchNorms x 2 + fc kernel and bias
    assert sum("proj" in layer.name for layer in p.layers) == 8  # 4 projection convs + BNs
    # About 4.1 G multiply-adds per 224x224 image.
    assert 8.0e9 < p.flops < 8.4e9


def test_workload_backward_order_and_times():
    p = alexnet_bn()
    w = p.workload(images_per_second=1000.0, batch=100)
    assert w.compute_time == pytest.approx(0.1)
    assert w.forward_time == pytest.approx(0.1 / 3)
    assert w.elements == p.num_params
    # Backward starts at the classifier: fc8's kernel (4096 x 1000) first, with all of
    # fc8's backward time; its bias follows at no extra time.
    fc8 = p.layers[-1]
    assert w.tensors[0].elements == 4096 * 1000
    assert w.tensors[0].shape == (4096, 1000)  # Flax's (in, out) kernel, for PowerSGD
    assert w.tensors[1].shape == (1000,)
    assert w.tensors[0].backward_time == pytest.approx(0.2 / 3 * fc8.flops / p.flops)
    assert w.tensors[1].elements == 1000
    assert w.tensors[1].backward_time == 0.0
    assert p.tensor_sizes()[-1] == 4096 * 1000  # tree order: fc8's kernel last


def test_profile_of_a_small_module():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3), padding="SAME", use_bias=False)(x)
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    p = profile_module("net", Net(), (1, 5, 5, 1))
    assert [layer.name for layer in p.layers] == ["Conv_0", "Dense_0"]
    assert p.layers[0].flops == 2 * 3 * 3 * 1 * 4 * 5 * 5
    assert p.layers[1].flops == 2 * 100 * 2
    assert p.num_params == 36 + 100 * 2 + 2


def test_bad_workload_input():
    with pytest.raises(ValueError):
        alexnet_bn().workload(images_per_second=0.0, batch=1)
    with pytest.raises(ValueError):
        alexnet_bn().workload(images_per_second=1.0, batch=0)
