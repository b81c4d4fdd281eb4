"""The device groups the ffi backend hands XLA when it borrows XLA's NCCL
communicators (GPU), checked on CPU against the replica groups JAX itself
writes into the HLO for a `lax.psum` over the same axes in the same program: XLA must
give our custom call the clique its own all-reduce would use, with the
ranks in `lax.axis_index` order."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import _axes, _peers
from jaxcomm.distributed import collective_sequence


def _psum_groups(lowered) -> np.ndarray:
    """The replica groups of the one all-reduce, as the program's HLO gives
    them (as an explicit list whichever form this XLA prints)."""
    (line,) = [c for c in collective_sequence(lowered) if c.startswith("all-reduce")]
    groups = re.search(r"replica_groups=(\{\{[0-9,{}]*\}\})", line).group(1)
    return np.array(json.loads(groups.replace("{", "[").replace("}", "]")), dtype=np.int64)


def _groups_in_shard_map(mesh, spec, axes):
    seen = []

    def body(x):
        seen.append(_peers.device_groups(x, _axes.placement(axes)))
        return lax.psum(x, axes)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.zeros((8, 2)), jax.sharding.NamedSharding(mesh, spec))
    lowered = f.lower(x)
    return seen[0], _psum_groups(lowered)


@pytest.mark.parametrize(
    "shape, names, axes",
    [
        ((8,), ("data",), "data"),
        ((2, 4), ("node", "local"), "local"),
        ((2, 4), ("node", "local"), "node"),
        ((2, 4), ("node", "local"), ("node", "local")),
        ((2, 4), ("node", "local"), ("local", "node")),
        ((2, 2, 2), ("a", "b", "c"), ("c", "a")),
    ],
)
def test_groups_are_those_of_psum_over_the_same_axes(shape, names, axes):
    mesh = jax.make_mesh(shape, names)
    ours, psum = _groups_in_shard_map(mesh, P(names), axes)
    np.testing.assert_array_equal(ours, psum)


def test_rank_order_is_axis_index_order():
    """Row r of a group is the device whose axis_index over the axes is r."""
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    axes = ("local", "node")
    ours, _ = _groups_in_shard_map(mesh, P(("node", "local")), axes)
    # Device d sits at mesh position (d // 4, d % 4); its rank over
    # (local, node) is local * 2 + node.
    for row in ours:
        ranks = [(d % 4) * 2 + d // 4 for d in row]
        assert ranks == list(range(len(row)))
    assert sorted(ours.ravel().tolist()) == list(range(8))


def test_groups_under_pmap_are_replica_groups():
    seen = []

    def body(x):
        seen.append(_peers.device_groups(x, _axes.placement("i")))
        return lax.psum(x, "i")

    n = jax.local_device_count()
    lowered = jax.pmap(body, axis_name="i").lower(jnp.zeros((n, 2)))
    np.testing.assert_array_equal(seen[0], _psum_groups(lowered))
    np.testing.assert_array_equal(seen[0], np.arange(n)[None, :])
