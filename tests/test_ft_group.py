"""jaxcomm.ft.Group: replica groups of several processes, rank 0 leading.

The fast tests check the outcome's trip from rank 0 to the others and the
host <-> device layout in one process; the slow ones run groups of two
processes each (``python -m jaxcomm.launch --replicas 2 -n 2``) against a
float64 NumPy reference, and through the death of one rank.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxcomm import ft
from jaxcomm.ft import group as group_module
from jaxcomm.ft._trainer import _Layout, as_vector, host_leaves

WORKER = pathlib.Path(__file__).with_name("ft_group_worker.py")


def test_a_round_reaches_the_other_ranks_whole():
    snap = ft.Snapshot(
        4,
        (np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int32)),
        (np.ones(2, ml_dtypes.bfloat16),),
    )
    mean = np.array([0.5, -0.0, np.inf], np.float32)
    for r in [
        ft.Round(True, mean, 3, (0, 2, 5), 2, snap, "", 0.25),
        ft.Round(False, None, 4, (1,), 0, None, "exchange: deadline passed", 10.0),
    ]:
        got, shard = group_module._decode(group_module._encode(r, (1, 3)))
        assert shard == (1, 3)
        assert got[:1] == r[:1] and got[2:5] == r[2:5] and got[6:] == r[6:]
        if r.mean is None:
            assert got.mean is None and got.healed is None
        else:
            assert got.mean.tobytes() == r.mean.tobytes()  # -0.0 and inf kept
            assert got.healed.hash() == snap.hash() and got.healed.round == 4
            assert got.healed.private[0].dtype == ml_dtypes.bfloat16


def test_what_rank_0_raised_is_raised_on_every_rank():
    finished = group_module._frame({"error": "JobFinished", "message": "done at 9"}, b"")
    with pytest.raises(ft.JobFinished, match="done at 9"):
        group_module._decode(finished)
    other = group_module._frame({"error": "RuntimeError", "message": "no quorum"}, b"")
    with pytest.raises(RuntimeError, match="rank 0 of this replica group: RuntimeError: no quorum"):
        group_module._decode(other)


def test_host_arrays_go_back_with_their_shapes_dtypes_and_placement():
    tree = {
        "a": jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
        "b": jnp.ones((), jnp.int32),
        "c": jnp.full(3, 2.5, jnp.bfloat16),
    }
    layout = _Layout(tree)
    leaves = host_leaves(tree)
    back = layout.place(leaves)
    for k in tree:
        assert back[k].shape == tree[k].shape and back[k].dtype == tree[k].dtype
        assert back[k].sharding == tree[k].sharding
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(tree[k]))
    vector = as_vector(tree)
    assert vector.dtype == np.float32 and vector.size == layout.size == 10
    parts = layout.split(vector)
    assert [p.dtype for p in parts] == [np.float32, np.int32, ml_dtypes.bfloat16]
    np.testing.assert_array_equal(parts[0], np.arange(6).reshape(2, 3))


def test_a_sharded_leaf_comes_back_sharded():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(np.arange(16, dtype=np.float32), spec)
    back = _Layout([x]).place(host_leaves([x]))[0]
    assert back.sharding == spec
    np.testing.assert_array_equal(np.asarray(back), np.arange(16))


def test_bad_groups_are_refused_in_jaxcomms_words():
    with pytest.raises(ValueError, match="alone in its JAX job"):
        ft.Group(None, replica_id=0)
    with pytest.raises(ValueError, match="must be given replica_id"):
        ft.Group(None)
    with pytest.raises(TypeError, match="jaxcomm.ft.Replica or None"):
        ft.Group("127.0.0.1:1")
    with pytest.raises(TypeError, match="jaxcomm.ft.Replica or Group, got str"):
        ft.DataParallel("127.0.0.1:1", lambda p, b: 0.0, optax.sgd(0.1))


def test_a_group_of_several_processes_without_initialize_is_told_to_call_it(monkeypatch):
    monkeypatch.setenv("JAXCOMM_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXCOMM_PROCESS_ID", "1")
    with pytest.raises(RuntimeError, match=r"call jaxcomm.distributed.initialize\(\) before"):
        ft.Group.from_env()
    # Rank 1 must not take the Replica either way.
    with pytest.raises(RuntimeError, match="only rank 0 holds the group's Replica"):
        ft.Replica.from_env()


def _grad64(w, x, y):
    return 2 * x.T @ (x @ w - y) / len(y)


def _run_groups(tmp_path, *extra, rounds=3, h=3):
    command = [
        sys.executable, "-m", "jaxcomm.launch", "--replicas", "2", "-n", "2",
        "--devices-per-process", "2", "--max-restarts", "1", str(WORKER),
        "--out", str(tmp_path), "--rounds", str(rounds), "--sync-every", str(h), *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}, done


def _reference(mode, rounds, h, lr):
    """float64 NumPy: 2 groups, each step's gradient over the group's whole batch of 8 rows."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from ft_group_worker import batch
    finally:
        sys.path.pop(0)

    def grad(w, r, s, i):
        return _grad64(w, *(a.astype(np.float64) for a in batch(r, s, i, 2)))

    w = np.zeros(5)
    for r in range(rounds):
        if mode == "dp":  # the mean gradient (bfloat16 on the wire: within rtol)
            w = w - lr * np.mean([grad(w, r, 0, i) for i in range(2)], axis=0)
            continue
        local = []  # outer SGD(1) on the mean pseudo-gradient: the mean local params
        for i in range(2):
            v = w.copy()
            for s in range(h):
                v -= lr * grad(v, r, s, i)
            local.append(v)
        w = np.mean(local, axis=0)
    return w


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diloco", "dp"])
def test_groups_of_two_processes_match_numpy_and_hold_the_same_bits(tmp_path, mode):
    rounds, h, lr = 3, 3, 0.02
    records, _ = _run_groups(tmp_path, "--mode", mode, rounds=rounds, h=h)
    assert set(records) == {f"r{r}-p{p}-i0" for r in (0, 1) for p in (0, 1)}
    assert {(v["processes"], v["devices"]) for v in records.values()} == {(2, 4)}
    bits = {v["w"] for v in records.values()}
    assert len(bits) == 1
    w = np.frombuffer(bytes.fromhex(bits.pop()), np.float32)
    rtol = 1e-2 if mode == "dp" else 1e-5
    np.testing.assert_allclose(w, _reference(mode, rounds, h, lr), rtol=rtol)
    logs = [v["log"] for v in records.values()]
    assert all(log == logs[0] for log in logs)  # rank 1 saw what rank 0 decided
    assert [e[1] for e in logs[0]] == [True] * (rounds + 1)


@pytest.mark.slow
def test_a_dead_rank_restarts_its_group_which_heals_from_the_other(tmp_path):
    rounds = 4
    records, done = _run_groups(tmp_path, "--kill", "1:1:2", rounds=rounds)
    assert "replica 1 rank 1 was killed by SIGKILL" in done.stderr
    assert {"r0-p0-i0", "r0-p1-i0", "r1-p0-i1", "r1-p1-i1"} <= set(records)
    assert len({v["w"] for v in records.values()}) == 1  # every rank of both groups, same bits
    healed = records["r1-p0-i1"]["log"]
    assert healed[0][3] and healed[0][0] >= 1  # the restarted group joined by healing
    assert records["r1-p1-i1"]["log"] == healed
    survivor = records["r0-p0-i0"]["log"]
    assert survivor[-1][0] >= rounds and any(e[2] == [0] for e in survivor if e[1])
