"""A data-parallel training step, written as for ``jit``, with jaxcomm reducing the gradients.

Flax's data-parallel programs are ``jit`` (or ``nnx.jit``) steps with
replicated state and a batch split over a ``"data"`` axis; XLA inserts the
gradient's all-reduce. For jaxcomm to do that reduction, the step has to run
per device (``shard_map``), where replicated state, vma types, RNG streams,
BatchNorm and metrics each need care. :func:`data_parallel` takes that care:

- arguments: NNX objects (model, optimizer, metrics, ``nnx.Rngs``) and
  other pytrees (a Linen ``TrainState``) enter replicated, except the
  per-device rows of jaxcomm's state (:func:`jaxcomm.state_specs`); arrays
  placed on the mesh keep their placement over the data axis (a batch put
  with ``P("data")`` is split); unplaced arrays with a leading dimension are
  split over the data axis, scalars are replicated;
- inside: :func:`jaxcomm.value_and_grad` defaults to the data axis; each
  device's RNG keys (NNX RNG streams, and PRNG key arguments that enter
  replicated) get its index folded in (different dropout masks per device,
  as a global batch gets under ``jit``); ``nnx.BatchNorm`` layers
  built without ``axis_name`` normalise over the global batch, as under
  ``jit`` (their ``axis_name`` is set while the step is traced);
- outputs: scalars that differ per device (the loss) are averaged, as are
  ``nnx.Metric`` states (so ``compute()`` gives what ``jit`` gives); any
  other state or output that differs per device is refused, naming its path.

Derivations and the choices' reasons: docs/dropin.md.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import varying_axes
from jaxcomm.state import holds_local_params, is_nnx_object, placed_spec, spec_axes, state_specs
from jaxcomm.state.per_device import only
from jaxcomm.step.constraints import over_model_axes
from jaxcomm.step.context import step_context


def data_parallel(fun=None, *, axis_name: str = "data", mesh=None):
    """Runs a data-parallel step written for ``jit`` with jaxcomm's reduction.

    Use it in place of ``jax.jit`` / ``nnx.jit`` on a step whose optimizer's
    chain starts with a jaxcomm transform, with :func:`jaxcomm.value_and_grad`
    in place of ``nnx.value_and_grad`` / ``jax.value_and_grad``.

    Args:
      fun: the step; its positional arguments are NNX objects, pytrees of
        arrays and batches; it returns a pytree of scalars (or nothing).
      axis_name: the mesh axis the batch is split over and jaxcomm reduces over.
      mesh: the mesh; by default the one of ``jax.set_mesh``, else the mesh an
        argument is placed on, else one axis over all devices.

    Returns:
      The step, compiled once per argument structure; NNX arguments are
      updated in place, as ``nnx.jit`` does.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> tx = optax.chain(jaxcomm.allreduce_gradients("data"), optax.sgd(0.1))
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> @jaxcomm.data_parallel
      ... def train_step(model, optimizer, x, y):
      ...     loss_fn = lambda model: jnp.mean((model(x) - y) ** 2)
      ...     loss, grads = jaxcomm.value_and_grad(loss_fn)(model)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> x = jnp.ones((8 * jax.device_count(), 4))
      >>> loss = train_step(model, optimizer, x, x[:, :1])
      >>> float(loss) > 0
      True
    """
    if fun is None:
        return functools.partial(data_parallel, axis_name=axis_name, mesh=mesh)
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be one mesh axis name (a str), got {axis_name!r}")
    compiled, built = {}, {}

    def prepared(args):
        """(the compiled step for `args`, its inputs, the NNX arguments)."""
        on = _mesh(mesh, args, axis_name)
        nodes = tuple(i for i, a in enumerate(args) if is_nnx_object(a))
        graphdef, state = _split(tuple(args[i] for i in nodes))
        rest = tuple(
            _opt_state_placed(a, on, axis_name, built) for i, a in enumerate(args) if i not in nodes
        )
        in_specs = (
            state_specs(state, axis_name, axis_names={axis_name}) if nodes else (),
            jax.tree.map(lambda x: _batch_spec(x, on, axis_name), rest),
        )
        state, rest = _placed((state, rest), in_specs, on)
        model = _model_specs((state, rest), on, axis_name)
        key = (graphdef, nodes, len(args), jax.tree.structure(rest), _flat(in_specs), on, model)
        if key not in compiled:
            compiled[key] = _compile(
                fun, graphdef, nodes, len(args), (in_specs, model), on, axis_name, state, rest
            )
        return compiled[key], (state, rest), tuple(args[i] for i in nodes)

    @functools.wraps(fun)
    def step(*args):
        run, inputs, objects = prepared(args)
        out, new_state = run(*inputs)
        if objects:
            from flax import nnx

            nnx.update(objects, new_state)
        return out

    def lower(*args):
        """The step for `args` lowered, as ``jax.jit(...).lower`` gives it (to
        read its HLO); the arguments are not updated."""
        run, inputs, _ = prepared(args)
        return run.lower(*inputs)

    step.lower = lower
    return step


def _compile(fun, graphdef, nodes, nargs, specs, mesh, axis, state, rest):
    """The jitted shard_map of the step; its out_specs come from tracing it once.
    `specs`: the arguments' specs over the data axis, and their placements
    over the mesh's other Auto axes (:func:`_model_specs`)."""
    in_specs, model = specs
    found = {}

    def body(state, rest):
        placed = [
            (x, spec)
            for x, spec in zip(jax.tree.leaves((state, rest)), model[1], strict=True)
            if spec
        ]
        objects = _merge(graphdef, state)
        args, others = [], iter(_device_keys(rest, in_specs[1], axis))
        for i in range(nargs):
            args.append(objects[nodes.index(i)] if i in nodes else next(others))
        # diloco's and double_buffered's gradient is taken at each device's own params.
        at_local = [o for o in objects if holds_local_params(getattr(o, "opt_state", None))]
        with (
            step_context(axis, at_local, placed),
            _device_rngs(objects, axis),
            _global_batch_norm(objects, axis),
            over_model_axes(axis),
        ):
            out = _run(fun, args, axis)
        new_graphdef, new_state = _split(objects)
        if new_graphdef != graphdef:
            raise ValueError(
                "jaxcomm.data_parallel: the step changed the structure of its NNX arguments "
                "(a Variable or submodule was added or removed); build it before the step"
            )
        out, out_specs = _outputs(out, axis)
        new_state = _state(new_state, in_specs[0], axis, nodes)
        found["out_specs"] = (out_specs, in_specs[0])
        return out, new_state

    def probe(state, rest):
        body(state, rest)
        return ()

    jax.eval_shape(
        jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=(), axis_names={axis}),
        state,
        rest,
    )
    run = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=found["out_specs"], axis_names={axis}
    )
    if not any(model[1]):
        return jax.jit(run)

    # The arguments as placed over the other Auto axes, which XLA would
    # otherwise choose anew for the outputs (a replicated bias coming back
    # split): the NNX state, and each output shaped like a non-NNX argument
    # (the new TrainState a Linen step returns).
    n_state = len(jax.tree.leaves(state))
    arg_specs, start = [], n_state
    for r in rest:
        n = len(jax.tree.leaves(r))
        arg_specs.append((jax.tree.structure(r), model[0][start : start + n]))
        start += n

    def placed_as(tree, data_tree, placements):
        data_specs = jax.tree.leaves(data_tree, is_leaf=lambda s: isinstance(s, P))
        leaves = [
            jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _joined(d, m)))
            for x, d, m in zip(jax.tree.leaves(tree), data_specs, placements, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(tree), leaves)

    def like_an_argument(out, out_specs):
        for structure, placements in arg_specs:
            if jax.tree.structure(out) == structure:
                return placed_as(out, out_specs, placements)
        if isinstance(out, (tuple, list)) and not isinstance(out_specs, P):
            items = [like_an_argument(o, s) for o, s in zip(out, out_specs, strict=True)]
            return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
        return out

    def kept(state, rest):
        out, new_state = run(state, rest)
        new_state = placed_as(new_state, found["out_specs"][1], model[0][:n_state])
        return like_an_argument(out, found["out_specs"][0]), new_state

    return jax.jit(kept)


def _run(fun, args, axis):
    """The user's step, with JAX's errors for differentiating integers (an NNX
    module's RNG keys under ``jax.grad``) and for a sharding constraint on the
    data axis that jaxcomm could not see said in terms of the fix."""
    try:
        return fun(*args)
    except ValueError as e:
        if "only refer to Auto axes" not in str(e):
            raise
        raise ValueError(
            f"jaxcomm.data_parallel: a sharding constraint in the step names the data axis "
            f"{axis!r}, which is manual inside the step (each device runs its own rows). "
            "jaxcomm drops that axis from constraints made through jax.lax."
            "with_sharding_constraint and jax.sharding.reshard (and Flax's, which call "
            "them), but this one called the function by another name (e.g. `from jax.lax "
            "import with_sharding_constraint`): call it as jax.lax.with_sharding_constraint, "
            f"or drop {axis!r} from its spec"
        ) from e
    except TypeError as e:
        if "grad requires real- or complex-valued inputs" not in str(e):
            raise
        raise TypeError(
            "jaxcomm.data_parallel: the step differentiates integer leaves (an NNX model's "
            "RNG keys or counts, e.g. with Dropout): jax.value_and_grad and jax.grad take "
            "the gradient of every leaf of their argument. Use jaxcomm.value_and_grad"
            "(loss_fn)(model) (or jaxcomm.grad), which differentiates the model's nnx.Param "
            "only, as nnx.value_and_grad does, and leaves the reduction to jaxcomm"
        ) from e


def _opt_state_placed(x, mesh, axis, built: dict):
    """`x`, and where it is a Flax ``TrainState`` whose optimizer state was
    built by a jitted init on a model split over other mesh axes, with that
    state put where ``tx.init`` places it. A ``jit`` with ``out_shardings``
    from the params' partitioning metadata (MaxText's way) leaves jaxcomm's
    per-shard state (rows, factors, a chunk pool) replicated over the model
    axes, and the step would meet whole leaves beside sharded gradients.
    Where init places it is read from the compiled init (`built` keeps it)."""
    if not all(hasattr(x, a) for a in ("tx", "params", "opt_state", "replace")):
        return x
    if set(mesh.axis_names) == {axis}:
        return x
    key = (id(x.tx), jax.tree.structure(x.opt_state), mesh)
    if key not in built:
        with jax.set_mesh(mesh):
            built[key] = (x.tx, jax.jit(x.tx.init).lower(x.params).compile().output_shardings)
    wanted = built[key][1]

    def one(leaf, sharding):
        # Only what out_shardings left replicated (no metadata placed it).
        if not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
            return leaf
        now = getattr(leaf, "sharding", None)
        if now is not None and not now.is_fully_replicated:
            return leaf
        return jax.device_put(leaf, sharding)

    return x.replace(opt_state=jax.tree.map(one, x.opt_state, wanted))


def _model_specs(tree, mesh, axis) -> tuple:
    """(each leaf's placement over every mesh axis but `axis` (P() where it
    has none), each leaf's over the Auto ones alone, or None where it is on
    none of them): what the traced step cannot see, and the transforms need
    to run on shards (see jaxcomm.step.placement)."""
    auto = {
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if n != axis and t == jax.sharding.AxisType.Auto
    }
    others = set(mesh.axis_names) - {axis}
    whole, on_auto = [], []
    for x in jax.tree.leaves(tree):
        spec = placed_spec(x) or ()
        whole.append(only(P(*spec), others))
        kept = only(P(*spec), auto)
        on_auto.append(kept if len(kept) else None)
    return tuple(whole), tuple(on_auto)


def _joined(data_spec: P, model_spec: P) -> P:
    """One spec from a leaf's spec over the data axis and over the others."""
    n = max(len(data_spec), len(model_spec))
    entries = []
    for i in range(n):
        axes = [*spec_axes(data_spec[i] if i < len(data_spec) else None)]
        axes += spec_axes(model_spec[i] if i < len(model_spec) else None)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*entries)


def _placed(tree, specs, mesh):
    """`tree` with the leaves not yet on a mesh put there by their specs (on
    the first step; its outputs come back placed)."""

    def one(x, spec):
        if placed_spec(x) is not None or not hasattr(x, "shape"):
            return x
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, tree, specs, is_leaf=lambda s: isinstance(s, P))


def _outputs(out, axis):
    """The step's outputs with per-device scalars averaged, and their specs."""
    specs = state_specs(out, axis, axis_names={axis})
    flat, tree = jax.tree_util.tree_flatten_with_path(out)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    leaves = []
    for (path, x), spec in zip(flat, spec_leaves, strict=True):
        if is_nnx_object(x):
            raise TypeError(
                f"jaxcomm.data_parallel: output{jax.tree_util.keystr(path)} is an NNX object; "
                "pass it as an argument (it is updated in place) instead of returning it"
            )
        if axis in varying_axes(x) and not _names_axis(spec, axis):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                raise ValueError(
                    f"jaxcomm.data_parallel: output{jax.tree_util.keystr(path)} is a PRNG key "
                    "derived from a key argument, which each device gets with its index "
                    "folded in: split the key outside the step and pass each step its own"
                )
            if jax.numpy.ndim(x) != 0:
                raise ValueError(
                    f"jaxcomm.data_parallel: output{jax.tree_util.keystr(path)} (shape "
                    f"{jax.numpy.shape(x)}) differs per device: the step's outputs are "
                    "replicated, and only scalars (a loss, an accuracy) are averaged over "
                    f"{axis!r}; reduce it to a scalar in the step, or return it from a "
                    "separate jit step"
                )
            x = lax.pmean(x, axis)
        leaves.append(x)
    return jax.tree_util.tree_unflatten(tree, leaves), specs


def _state(state, specs, axis, nodes):
    """The NNX state after the step: metrics averaged over devices, anything
    else that differs per device outside jaxcomm's per-device rows refused."""
    if not nodes:
        return state
    from flax import nnx

    variables = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    for (path, var), spec in zip(variables, spec_leaves, strict=True):
        value = var.get_value()
        if axis not in varying_axes(value) or _names_axis(spec, axis):
            continue
        if isinstance(var, nnx.metrics.MetricState):
            var.set_value(lax.pmean(value, axis))
            continue
        where = f"args[{nodes[_index(path[0])]}]{_dotted(path[1:])}"
        kind = type(var).__name__
        fix = (
            "its update did not go through a jaxcomm transform: start the optimizer's "
            "chain with one (e.g. jaxcomm.allreduce_gradients)"
            if isinstance(var, nnx.Param)
            else "a layer computed it from this device's examples only: compute it over "
            f"the global batch (lax.pmean over {axis!r}, as nnx.BatchNorm(axis_name="
            f"{axis!r}) does) or keep it out of the step's arguments"
        )
        raise ValueError(
            f"jaxcomm.data_parallel: {where} ({kind}) differs per device after the step; {fix}"
        )
    return state


@contextlib.contextmanager
def _device_rngs(objects, axis):
    """Folds each device's index into the RNG keys of `objects` while the
    step runs; the keys are put back after (their counts advance as usual)."""
    if not objects:
        yield
        return
    from flax import nnx

    keys = nnx.state(objects, nnx.RngKey)
    saved = jax.tree.map(lambda k: k, keys)  # nnx.state holds the live Variables
    index = lax.axis_index(axis)
    nnx.update(objects, jax.tree.map(lambda k: _fold_in_each(k, index), keys))
    try:
        yield
    finally:
        nnx.update(objects, saved)


def _device_keys(rest, specs, axis):
    """`rest` with each device's index folded into the replicated PRNG keys
    (a Linen program's dropout key), as :func:`_device_rngs` does for NNX."""

    def one(x, spec):
        is_key = jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
        if not is_key or _names_axis(spec, axis):
            return x
        return _fold_in_each(x, lax.axis_index(axis))

    return jax.tree.map(one, rest, specs, is_leaf=lambda s: isinstance(s, P))


def _fold_in_each(keys, index):
    """``jax.random.fold_in`` of `index` into every key of a key array: layers
    stacked by ``nnx.vmap`` or ``nn.scan`` hold one key per layer."""
    if keys.ndim == 0:
        return jax.random.fold_in(keys, index)
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    return fold(keys.reshape(-1), index).reshape(keys.shape)


@contextlib.contextmanager
def _global_batch_norm(objects, axis):
    """Gives every ``nnx.BatchNorm`` without an ``axis_name`` the data axis
    while the step runs, so that it normalises over the global batch."""
    changed = []
    if objects:
        from flax import nnx

        for _, node in nnx.iter_graph(objects):
            if isinstance(node, nnx.BatchNorm) and node.axis_name is None:
                node.axis_name = axis
                changed.append(node)
    try:
        yield
    finally:
        for node in changed:
            node.axis_name = None


def _mesh(mesh, args, axis):
    if mesh is None:
        current = jax.sharding.get_mesh()
        mesh = None if current.empty else current
    if mesh is None:
        for x in jax.tree.leaves(args):
            sharding = getattr(x, "sharding", None)
            if isinstance(sharding, NamedSharding) and axis in sharding.mesh.axis_names:
                mesh = sharding.mesh
                break
    if mesh is None:  # every device, as jit would use
        mesh = jax.sharding.Mesh(jax.devices(), (axis,))
    if axis not in mesh.axis_names:
        raise ValueError(
            f"jaxcomm.data_parallel: axis_name {axis!r} is not an axis of the mesh, whose "
            f"axes are {tuple(mesh.axis_names)}"
        )
    return mesh


def _batch_spec(x, mesh, axis) -> P:
    """A non-NNX argument's spec over the data axis: its placement's, or split
    over the axis along its first dimension where it is not placed."""
    placed = placed_spec(x)
    if placed is not None:
        return P(*[axis if axis in spec_axes(e) else None for e in placed])
    if jax.numpy.ndim(x) == 0:
        return P()
    size = mesh.shape[axis]
    if jax.numpy.shape(x)[0] % size:
        raise ValueError(
            f"jaxcomm.data_parallel: an argument of shape {jax.numpy.shape(x)} is split over "
            f"{axis!r} ({size} devices) along its first dimension, which {size} does not "
            "divide; place it yourself (jax.device_put with a NamedSharding) to replicate it"
        )
    return P(axis)


def _dotted(path) -> str:
    """A state path as attribute access: ``.linear1.kernel``, ``.layers[0]``."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return "".join(f".{k}" if isinstance(k, str) else f"[{k}]" for k in keys)


def _index(key) -> int:
    """The position a state path's first key names (a DictKey or SequenceKey)."""
    return getattr(key, "key", getattr(key, "idx", None))


def _names_axis(spec, axis) -> bool:
    return any(axis in spec_axes(e) for e in spec)


def _split(objects):
    if not objects:
        return None, ()
    from flax import nnx

    return nnx.split(objects)


def _merge(graphdef, state):
    if graphdef is None:
        return ()
    from flax import nnx

    return nnx.merge(graphdef, state)


def _flat(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda s: isinstance(s, P))
    return (treedef, tuple(leaves))
