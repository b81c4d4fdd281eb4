"""jaxcomm.distributed.collective_sequence and check_same_collectives in one
process (8 CPU devices); tests/test_multihost.py runs check_same_collectives
across 2 processes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.distributed import agreement, check_same_collectives, collective_sequence, hlo

ALL8 = "replica_groups={{0,1,2,3,4,5,6,7}}"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("d",))


def _lower(mesh, fn, *sizes, out_specs=None):
    """``fn`` under shard_map over ``d``, jitted and lowered for float32
    arguments of ``sizes`` elements per device."""
    spec = NamedSharding(mesh, P("d"))
    args = [jax.ShapeDtypeStruct((8 * n,), jnp.float32, sharding=spec) for n in sizes]
    in_specs = (P("d"),) * len(sizes)
    out_specs = P() if out_specs is None else out_specs
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)).lower(
        *args
    )


def _psums_in_order(*keys):
    """Sums a dict of gradients over ``d`` leaf by leaf, in the order of ``keys``:
    what processes that flatten a pytree differently would trace."""

    def step(w, b):
        grads = {"w": w, "b": b}
        return tuple(jax.lax.psum(grads[k], "d") for k in keys)

    return step


def test_order_and_shapes_are_in_the_sequence(mesh):
    in_order = collective_sequence(_lower(mesh, _psums_in_order("w", "b"), 8, 4))
    assert in_order == [
        f"all-reduce(add) f32[8] channel {ALL8} use_global_device_ids=true",
        f"all-reduce(add) f32[4] channel {ALL8} use_global_device_ids=true",
    ]
    swapped = collective_sequence(_lower(mesh, _psums_in_order("b", "w"), 8, 4))
    assert swapped == in_order[::-1]
    # The same program lowered again, or jitted afresh, gives the same lines:
    # instruction names and numbering are not in them.
    assert collective_sequence(_lower(mesh, _psums_in_order("w", "b"), 8, 4)) == in_order
    again = collective_sequence(_lower(mesh, _psums_in_order("w", "b"), 8, 4).as_text("hlo"))
    assert again == in_order


def test_reduction_groups_and_kinds(mesh):
    two_by_four = jax.make_mesh((2, 4), ("node", "local"))

    def step(x):
        biggest = jax.lax.pmax(x, "local")
        gathered = jax.lax.all_gather(biggest, "node", tiled=True)
        shifted = jax.lax.ppermute(x, "local", [(i, (i + 1) % 4) for i in range(4)])
        return jax.lax.psum_scatter(gathered, "local", tiled=True) + shifted[:1]

    spec = NamedSharding(two_by_four, P(("node", "local")))
    lowered = jax.jit(
        jax.shard_map(
            step, mesh=two_by_four, in_specs=P(("node", "local")), out_specs=P(("node", "local"))
        )
    ).lower(jax.ShapeDtypeStruct((32,), jnp.float32, sharding=spec))
    sequence = collective_sequence(lowered)
    assert [line.split()[0] for line in sequence] == [
        "all-reduce(maximum)",
        "all-gather",
        "reduce-scatter(add)",
        "collective-permute",
    ], sequence
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in sequence[0]
    assert "f32[8] channel dimensions={0} replica_groups={{0,4},{1,5},{2,6},{3,7}}" in sequence[1]
    assert "source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5}" in sequence[3]


def test_non_collective_ops_are_ignored(mesh):
    def local_only(x):
        return jnp.sort(jnp.cumsum(jnp.tanh(x) * 2)).reshape(-1)

    assert collective_sequence(_lower(mesh, local_only, 8, out_specs=P("d"))) == []

    def one_sum_among_others(x):
        return jax.lax.psum(jnp.exp(x).sum(), "d")[None]

    [line] = collective_sequence(_lower(mesh, one_sum_among_others, 8))
    assert line.startswith("all-reduce(add) f32[] ")


def test_collectives_in_loops_and_branches_are_listed_where_called(mesh):
    def step(x):
        x = jax.lax.psum(x, "d")

        def body(carry, _):
            return jax.lax.pcast(jax.lax.pmax(carry, "d"), "d", to="varying"), None

        x, _ = jax.lax.scan(body, jax.lax.pcast(x, "d", to="varying"), None, length=3)
        x = jax.lax.cond(x[0] > 0, lambda: jax.lax.pmin(x, "d"), lambda: jax.lax.pmean(x, "d"))
        return jax.lax.all_gather(x, "d", tiled=True)

    lowered = _lower(mesh, step, 2, out_specs=P("d"))
    ops = [line.split()[0] for line in collective_sequence(lowered)]
    # A loop body's collectives appear once; both branches of a cond appear.
    assert ops[:2] == ["all-reduce(add)", "all-reduce(maximum)"], ops
    assert sorted(ops[2:4]) == ["all-reduce(add)", "all-reduce(minimum)"], ops
    assert ops[4:] == ["all-gather"], ops


@pytest.mark.skipif(not jaxcomm.ffi_available(), reason="jaxcomm built without its FFI module")
def test_jaxcomm_ffi_collectives_are_listed_with_their_options(mesh):
    def step(x):
        return jaxcomm.allreduce(x, "d", backend="ffi", wire_dtype=jnp.bfloat16)

    [line] = collective_sequence(_lower(mesh, step, 8))
    assert line.startswith("jaxcomm_allreduce f32[8] {"), line
    assert "nranks=8" in line and "wire_dtype=2" in line and "op_id=" in line, line
    # The xla backend lowers to XLA's own collectives instead.
    xla = collective_sequence(_lower(mesh, lambda x: jaxcomm.allreduce(x, "d", backend="xla"), 8))
    assert xla and not any(line.startswith("jaxcomm") for line in xla), xla


def test_hlo_attributes_split_outside_brackets_and_strings():
    text = (
        'channel_id=3, replica_groups={{0,1},{2,3}}, metadata={op_name="a, b={c}"}, '
        'custom_call_target="x\\", y", dimensions={0}'
    )
    assert hlo._attributes(text) == {
        "channel_id": "3",
        "replica_groups": "{{0,1},{2,3}}",
        "metadata": '{op_name="a, b={c}"}',
        "custom_call_target": '"x\\", y"',
        "dimensions": "{0}",
    }
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collective_sequence("HloModule empty\n")


def test_the_message_names_the_first_difference():
    a = [f"all-reduce(add) f32[{n}]" for n in (1, 2, 3, 4, 5, 6)]
    b = a[:4] + ["all-gather f32[9]"] + a[5:]
    message = agreement._sequence_differences({(0, 2): a, (1,): b, (3,): a[:4]})
    assert message.splitlines()[:5] == [
        "  first difference at collective 4 (counting from 0):",
        "    all-reduce(add) f32[5] on processes 0, 2",
        "    all-gather f32[9] on process 1",
        "    nothing (it issues 4) on process 3",
        "  collectives in all: 6 on processes 0, 1, 2; 4 on process 3",
    ]
    # Two collectives each side of the difference, not the whole list.
    assert "  processes 0, 2, collectives 2-5:" in message
    assert "    > 4: all-gather f32[9]" in message
    assert "      2: all-reduce(add) f32[3]" in message
    assert "f32[2]" not in message
    assert "  process 3, collectives 2-3:" in message
    # Replica groups of big meshes lose their middle, not their ends.
    long = "all-reduce(add) f32[8] replica_groups={{" + ",".join(map(str, range(4096))) + "}}"
    shown = agreement._sequence_differences({(0,): [long], (1,): []})
    assert max(map(len, shown.splitlines())) < 300
    assert "all-reduce(add) f32[8] replica_groups={{0,1,2," in shown and "4094,4095}}" in shown
    assert "    nothing (it issues 0) on process 1" in shown
    assert "  process 1: no collectives" in shown


def test_check_same_collectives_in_one_process(mesh):
    step = _psums_in_order("w", "b")
    lowered = _lower(mesh, step, 8, 4)
    expected = collective_sequence(lowered)
    assert check_same_collectives(lowered) == expected
    x = jax.device_put(np.ones(64, np.float32), NamedSharding(mesh, P("d")))
    b = jax.device_put(np.ones(32, np.float32), NamedSharding(mesh, P("d")))
    mapped = jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P())
    # A plain function is jitted; a jitted one lowered, keyword arguments included.
    assert check_same_collectives(mapped, x, b) == expected
    by_keyword = jax.jit(lambda w, b: mapped(w, b))
    assert check_same_collectives(by_keyword, x, b=b, timeout_s=1) == expected

    with pytest.raises(TypeError, match="takes no arguments"):
        check_same_collectives(lowered, x)
    with pytest.raises(TypeError, match="not its compile"):
        check_same_collectives(lowered.compile())
    with pytest.raises(TypeError, match="not list"):
        check_same_collectives(expected)
    for timeout in (0, -1, "5", True):
        with pytest.raises(ValueError, match="timeout_s"):
            check_same_collectives(lowered, timeout_s=timeout)
