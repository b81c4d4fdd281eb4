"""Fault-tolerant replica groups in one process: the lighthouse, rounds, healing, the trainers.

Each replica group is a thread with its own :class:`jaxcomm.ft.Replica`, so
the lighthouse, the host exchange and the state transfer run over real
loopback sockets. A group "dies" by closing its replica (its sockets close and
its heartbeats stop). Processes killed for real: tests/test_ft_faults.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import ft
from jaxcomm.ft import _messages

JOB = "test-job"
HEARTBEAT = 0.5


@pytest.fixture
def lighthouse():
    with ft.Lighthouse(JOB, heartbeat_timeout=HEARTBEAT, quorum_timeout=5.0) as lh:
        yield lh


def _address(lh):
    host, port = lh.address
    return f"{host}:{port}"


def _replicas(lh, n, **kw):
    """n replicas, each known to the lighthouse (a first heartbeat in) before the test's rounds."""
    kw.setdefault("timeout", 5.0)
    replicas = [ft.Replica(_address(lh), replica_id=i, job_id=JOB, **kw) for i in range(n)]
    deadline = time.monotonic() + 5
    while len(lh._seen) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return replicas


def _in_threads(fns):
    """Runs each function in a thread; their results in order, or the first error raised."""
    out, errors = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    if errors:
        raise errors[0]
    return out


def _close(replicas):
    for r in replicas:
        r.close()


# -- the lighthouse ---------------------------------------------------------


def _ask(lh, rid, round_=0, job=JOB, epoch_seen=0, timeout=3.0):
    message = {
        "op": "quorum",
        "job_id": job,
        "replica_id": rid,
        "address": ["127.0.0.1", 1],
        "state_address": ["127.0.0.1", 2],
        "committed_round": round_,
        "state_hash": "h",
        "size": 4,
        "epoch_seen": epoch_seen,
        "timeout": timeout,
    }
    return _messages.request(lh.address, message, timeout=timeout + 2)


def _beat(lh, rid, job=JOB):
    return _messages.request(
        lh.address, {"op": "heartbeat", "job_id": job, "replica_id": rid}, timeout=2
    )


def test_quorum_waits_for_a_live_group_and_leaves_a_silent_one_out(lighthouse):
    for rid in (0, 1, 2):
        _beat(lighthouse, rid)
    start = time.monotonic()

    def late():  # alive (heartbeats) but slow to ask: waited for
        for _ in range(4):
            _beat(lighthouse, 2)
            time.sleep(0.2)
        return _ask(lighthouse, 2, round_=3)

    replies = _in_threads(
        [lambda: _ask(lighthouse, 0, round_=3), lambda: _ask(lighthouse, 1, round_=3), late]
    )
    assert time.monotonic() - start >= 0.7
    assert [m["replica_id"] for m in replies[0]["members"]] == [0, 1, 2]
    assert replies[0] == replies[1] == replies[2]
    # Now 2 stops sending heartbeats: the next quorum forms without it once it is HEARTBEAT silent.
    start = time.monotonic()
    replies = _in_threads(
        [lambda: _ask(lighthouse, 0, round_=4), lambda: _ask(lighthouse, 1, round_=4)]
    )
    assert [m["replica_id"] for m in replies[0]["members"]] == [0, 1]
    assert replies[0]["epoch"] > 0 and time.monotonic() - start < HEARTBEAT + 1.0


def test_another_job_is_refused_never_merged(lighthouse):
    reply = _beat(lighthouse, 7, job="other-job")
    assert "refused" in reply["error"] and "other-job" in lighthouse.refused[0]
    reply = _ask(lighthouse, 7, job="other-job")
    assert "error" in reply
    assert [m["replica_id"] for m in _ask(lighthouse, 0, round_=2)["members"]] == [0]


def test_a_restarted_lighthouse_numbers_epochs_above_those_seen(lighthouse):
    first = _ask(lighthouse, 0, round_=1)["epoch"]
    with ft.Lighthouse(JOB, heartbeat_timeout=HEARTBEAT) as fresh:
        reply = _ask(fresh, 0, round_=1, epoch_seen=first + 40)
    assert reply["epoch"] == first + 41


def test_a_restarted_lighthouse_hears_every_live_group_before_a_quorum():
    # Group 0 asks the moment the lighthouse is back; group 1's heartbeat comes 0.2 s later.
    # A quorum of group 0 alone would let both commit the same round apart.
    with ft.Lighthouse(JOB, heartbeat_timeout=HEARTBEAT) as fresh:

        def late():
            time.sleep(0.2)
            _beat(fresh, 1)
            return _ask(fresh, 1, round_=4)

        replies = _in_threads([lambda: _ask(fresh, 0, round_=4), late])
    assert [m["replica_id"] for m in replies[0]["members"]] == [0, 1]
    assert replies[0]["epoch"] == replies[1]["epoch"]


def test_the_vote_commits_only_when_every_member_says_yes(lighthouse):
    def vote(rid, epoch, ok, timeout=2.0):
        message = {
            "op": "vote",
            "job_id": JOB,
            "replica_id": rid,
            "epoch": epoch,
            "ok": ok,
            "timeout": timeout,
        }
        return _messages.request(lighthouse.address, message, timeout=timeout + 2)

    def quorum():  # both known (a heartbeat each), so that they land in one quorum
        _beat(lighthouse, 0)
        _beat(lighthouse, 1)
        epoch = _in_threads(
            [lambda: _ask(lighthouse, 0, round_=1), lambda: _ask(lighthouse, 1, round_=1)]
        )[0]["epoch"]
        _beat(lighthouse, 0)  # alive as the vote begins, as their heartbeat threads keep them
        _beat(lighthouse, 1)
        return epoch

    e = quorum()
    assert [
        r["commit"] for r in _in_threads([lambda: vote(0, e, True), lambda: vote(1, e, True)])
    ] == [True, True]
    e = quorum()
    assert [
        r["commit"] for r in _in_threads([lambda: vote(0, e, True), lambda: vote(1, e, False)])
    ] == [False, False]
    e = quorum()
    start = time.monotonic()
    # Member 1 never votes and sends no heartbeats: a no once it has been silent for
    # the heartbeat timeout, long before the 30 s deadline.
    reply = vote(0, e, True, timeout=30.0)
    assert reply["commit"] is False and reply["missing"] == [1]
    assert time.monotonic() - start < HEARTBEAT + 1.0
    assert vote(1, e, True)["commit"] is False  # the decision is final
    assert vote(0, e + 100, True)["commit"] is False  # an epoch this lighthouse never formed


# -- rounds ---------------------------------------------------------------------


def _commit_all(replicas, arrays):
    for r, a in zip(replicas, arrays, strict=True):
        r.commit(ft.Snapshot(0, (np.asarray(a, np.float32),)))


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_sync_averages_over_the_members_that_contribute(lighthouse, wire):
    replicas = _replicas(lighthouse, 3)
    try:
        _commit_all(replicas, [np.zeros(3)] * 3)
        rng = np.random.default_rng(0)
        xs = [rng.normal(size=1001).astype(np.float32) for _ in range(3)]
        rounds = _in_threads(
            [
                lambda i=i: replicas[i].sync(xs[i], contributes=i != 1, wire_dtype=wire)
                for i in range(3)
            ]
        )
        reference = (xs[0].astype(np.float64) + xs[2]) / 2
        for r in rounds:
            assert (
                r.committed and r.contributors == 2 and r.members == (0, 1, 2) and r.healed is None
            )
            assert np.array_equal(r.mean.view(np.uint32), rounds[0].mean.view(np.uint32))
        tol = 1e-6 if wire is None else 2e-2
        np.testing.assert_allclose(rounds[0].mean, reference, rtol=tol, atol=tol)
        assert [r.shard() for r in replicas] == [(0, 3), (1, 3), (2, 3)]
    finally:
        _close(replicas)


def test_a_group_behind_heals_from_a_peer_and_sends_weight_zero(lighthouse):
    replicas = _replicas(lighthouse, 3)
    try:
        good = ft.Snapshot(
            5, (np.arange(4, dtype=np.float32),), (np.ones(2, np.float32),), {"tokens": 9}
        )
        replicas[0].commit(good)
        replicas[1].commit(good)
        replicas[2].commit(
            ft.Snapshot(2, (np.zeros(4, np.float32),))
        )  # a group that returns, behind
        xs = [np.full(6, 1.0 + i, np.float32) for i in range(3)]
        rounds = _in_threads([lambda i=i: replicas[i].sync(xs[i]) for i in range(3)])
        assert [r.committed for r in rounds] == [True] * 3
        assert rounds[2].healed is not None and rounds[0].healed is None
        healed = rounds[2].healed
        assert healed.round == 5 and healed.meta == {"tokens": 9} and healed.hash() == good.hash()
        np.testing.assert_array_equal(healed.private[0], good.private[0])
        assert replicas[2].state_hash == replicas[0].state_hash
        np.testing.assert_array_equal(rounds[2].mean, np.full(6, 1.5, np.float32))  # (1 + 2) / 2
    finally:
        _close(replicas)


def test_a_peer_serving_a_forged_state_is_not_loaded(lighthouse, monkeypatch):
    replicas = _replicas(lighthouse, 2)
    try:
        good = ft.Snapshot(3, (np.arange(4, dtype=np.float32),))
        replicas[0].commit(good)
        replicas[1].commit(ft.Snapshot(1, (np.zeros(4, np.float32),)))
        forged = good._replace(shared=(np.arange(4, dtype=np.float32) + 1,))
        monkeypatch.setattr(
            replicas[0], "committed", forged
        )  # serves bytes that do not match its reported hash
        rounds = _in_threads(
            [lambda i=i: replicas[i].sync(np.ones(3, np.float32)) for i in range(2)]
        )
        assert [r.committed for r in rounds] == [False, False]
        assert (
            rounds[1].healed is None
            and "healing failed" in rounds[1].reason
            and "hashes to" in rounds[1].reason
        )
        assert replicas[1].committed.round == 1
    finally:
        _close(replicas)


def test_a_member_that_dies_in_the_exchange_aborts_the_round_everywhere(lighthouse):
    replicas = _replicas(lighthouse, 3, timeout=3.0)
    try:
        _commit_all(replicas, [np.zeros(2)] * 3)

        def dies(phase, round_):
            if phase == "exchange":
                replicas[2].endpoint.close()  # its connections go; it fails too

        replicas[2]._on_phase = dies
        start = time.monotonic()
        rounds = _in_threads(
            [lambda i=i: replicas[i].sync(np.ones(50, np.float32)) for i in range(3)]
        )
        assert [r.committed for r in rounds] == [False] * 3
        assert all(r.mean is None and r.reason for r in rounds)
        assert time.monotonic() - start < 3.0 + 2.0
        replicas[2].close()
        time.sleep(HEARTBEAT + 0.2)
        rounds = _in_threads(
            [lambda i=i: replicas[i].sync(np.full(50, i, np.float32)) for i in range(2)]
        )
        assert [r.members for r in rounds] == [(0, 1)] * 2 and all(r.committed for r in rounds)
        np.testing.assert_array_equal(rounds[0].mean, np.full(50, 0.5, np.float32))
    finally:
        _close(replicas)


def test_contributions_of_different_lengths_abort_with_the_reason(lighthouse):
    replicas = _replicas(lighthouse, 2)
    try:
        _commit_all(replicas, [np.zeros(2)] * 2)
        rounds = _in_threads(
            [lambda i=i: replicas[i].sync(np.ones(4 + i, np.float32)) for i in range(2)]
        )
        assert [r.committed for r in rounds] == [False, False]
        assert "differ in length" in rounds[0].reason and "[4, 5]" in rounds[0].reason
    finally:
        _close(replicas)


def test_bad_input_is_refused_in_jaxcomms_words(lighthouse, monkeypatch):
    (replica,) = _replicas(lighthouse, 1)
    try:
        with pytest.raises(RuntimeError, match="before Replica.commit"):
            replica.sync(np.ones(3, np.float32))
        replica.commit(ft.Snapshot(0, ()))
        with pytest.raises(ValueError, match="1-D float32"):
            replica.sync(np.ones(3, np.float64))
        with pytest.raises(ValueError, match="wire_dtype='int8'"):
            ft.DataParallel(replica, lambda p, b: 0.0, optax.sgd(0.1), wire_dtype="int8")
        with pytest.raises(TypeError, match="jaxcomm.ft.Replica"):
            ft.DataParallel("127.0.0.1:1", lambda p, b: 0.0, optax.sgd(0.1))
        with pytest.raises(ValueError, match="sync_every=0"):
            ft.DiLoCo(replica, lambda p, b: 0.0, optax.sgd(0.1), optax.sgd(1.0), sync_every=0)
    finally:
        replica.close()
    for name in ("JAXCOMM_FT_LIGHTHOUSE", "JAXCOMM_FT_REPLICA_ID", "JAXCOMM_FT_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="JAXCOMM_FT_LIGHTHOUSE.*jaxcomm.launch --replicas"):
        ft.Replica.from_env()
    with pytest.raises(ValueError, match="not host:port"):
        ft.Replica("localhost", replica_id=0, job_id=JOB)


# -- the trainers, against NumPy ---------------------------------------------------

X = np.random.default_rng(1).normal(size=(24, 5))
Y = X @ np.arange(1.0, 6.0)


def _loss(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] - y) ** 2)


def _grad64(w, x, y):
    return 2 * x.T @ (x @ w - y) / len(y)


def _batch(round_, step, index, count):
    rows = np.random.default_rng([round_, step, index, count]).choice(len(Y), 6, replace=False)
    return X[rows], Y[rows]


def _train(trainer, rounds, *, die_at=None, pause=0.0):
    state = trainer.start({"w": jnp.zeros(5, jnp.float32)})
    while state.round < rounds:
        if die_at is not None and state.round == die_at:
            trainer.group.close()
            return state
        index, count = trainer.shard()
        x, y = _batch(state.round, state.step, index, count)
        state, _ = trainer.step(state, (x.astype(np.float32), y.astype(np.float32)))
        time.sleep(pause)
    return state


def test_diloco_matches_numpy_and_every_group_holds_the_same_bits(lighthouse):
    replicas = _replicas(lighthouse, 3)
    lr, h, rounds = 0.02, 4, 3
    try:
        trainers = [
            ft.DiLoCo(r, _loss, optax.sgd(lr), optax.sgd(1.0), sync_every=h) for r in replicas
        ]
        states = _in_threads([lambda t=t: _train(t, rounds) for t in trainers])
    finally:
        _close(replicas)
    w = np.zeros(5)
    for r in range(
        rounds
    ):  # outer SGD(1.0) on the mean pseudo-gradient = the mean of the local params
        local = []
        for i in range(3):
            v = w.copy()
            for s in range(h):
                v -= lr * _grad64(v, *_batch(r, s, i, 3))
            local.append(v)
        w = np.mean(local, axis=0)
    for s in states:
        assert s.round == rounds
        np.testing.assert_allclose(np.asarray(s.params["w"]), w, rtol=1e-5)
        assert np.array_equal(np.asarray(s.params["w"]), np.asarray(states[0].params["w"]))
    hashes = {t.log[-1].state_hash for t in trainers}
    assert len(hashes) == 1 and [e.committed for e in trainers[0].log] == [True] * (rounds + 1)


def _adamw64(w, g, state, lr, wd=1e-4, b1=0.9, b2=0.999, eps=1e-8):
    """optax.adamw's step in float64: (new w, new (mu, nu, count))."""
    mu, nu, count = state
    mu, nu, count = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g, count + 1
    u = (mu / (1 - b1**count)) / (np.sqrt(nu / (1 - b2**count)) + eps) + wd * w
    return w - lr * u, (mu, nu, count)


class _Hold:
    """Group 0 waits at round ``at`` until a late group's Replica exists: its heartbeats
    run, so the next quorums wait for it, and it joins before the job ends."""

    def __init__(self, at: int):
        self.at, self.go, self.ready = at, threading.Event(), threading.Event()


def _steps(trainer, state, rounds, hold: _Hold):
    """Steps ``trainer`` from ``state`` to ``rounds`` committed rounds; then it leaves, done."""
    while state.round < rounds:
        if trainer.group.replica_id == 0 and state.round == hold.at and not hold.go.is_set():
            hold.go.set()
            assert hold.ready.wait(10), "the late group did not come"
        x, y = _batch(state.round, state.step, *trainer.shard())
        state, _ = trainer.step(state, (x.astype(np.float32), y.astype(np.float32)))
    trainer.group.close(finished=True)
    return state


def test_diloco_through_a_death_and_a_heal_matches_numpy_with_adamw_and_nesterov():
    # Group 2 leaves after round 2 and comes back as a restarted process would: a new
    # Replica and trainer from the initial params. It heals from group 0 (params, outer
    # momentum and group 0's AdamW state), sends weight 0 in that round and contributes from
    # the next. A float64 replay of the rounds as the groups logged them must give the same
    # params: a wrong heal, shard or mean would not.
    lr, outer_lr, h, rounds, die = 0.05, 0.5, 3, 9, 2
    # Heartbeats that threads on a busy machine keep up with: nobody is dropped by mistake.
    lighthouse = ft.Lighthouse(JOB, heartbeat_timeout=3.0, quorum_timeout=10.0)
    replicas = _replicas(lighthouse, 3)
    outer = optax.sgd(outer_lr, momentum=0.9, nesterov=True)
    trainers = [ft.DiLoCo(r, _loss, optax.adamw(lr), outer, sync_every=h) for r in replicas]
    hold = _Hold(die + 2)  # two rounds without group 2: it comes back then

    def gone_and_back():
        _train(trainers[2], rounds, die_at=die)
        assert hold.go.wait(30), "group 0 did not reach round 4"
        replicas.append(ft.Replica(_address(lighthouse), replica_id=2, job_id=JOB, timeout=5.0))
        trainers.append(ft.DiLoCo(replicas[-1], _loss, optax.adamw(lr), outer, sync_every=h))
        hold.ready.set()
        return first(trainers[-1])

    def first(t):
        return _steps(t, t.start({"w": jnp.zeros(5, jnp.float32)}), rounds, hold)

    try:
        states = _in_threads(
            [lambda: first(trainers[0]), lambda: first(trainers[1]), gone_and_back]
        )
    finally:
        _close(replicas)
        lighthouse.close()
    log = trainers[0].log
    assert all(e.committed for e in log) and [e.round for e in log] == list(range(rounds + 1))
    (joined,) = [e.round for e in trainers[3].log if e.healed]
    assert die + 2 < joined <= die + 4  # the next quorum, or the one after if it raced
    members = {e.round: e.members for e in log}
    assert [len(members[r]) for r in range(rounds + 1)] == (
        [3] * (die + 1) + [2] * (joined - die - 1) + [3] * (rounds + 1 - joined)
    )
    assert [e.contributors for e in log][joined] == 2  # the healed group sends weight 0

    w, momentum = np.zeros(5), np.zeros(5)
    adam = {g: (np.zeros(5), np.zeros(5), 0) for g in range(3)}
    for r in range(1, rounds + 1):
        if r == joined:
            adam[2] = adam[0]  # the healer's AdamW state, as it committed round r - 1
        deltas = []
        for g in members[r]:
            if r == joined and g == 2:
                continue
            index, count = members[r - 1].index(g), len(members[r - 1])
            v = w.copy()
            for s in range(h):
                v, adam[g] = _adamw64(v, _grad64(v, *_batch(r - 1, s, index, count)), adam[g], lr)
            deltas.append(w - v)
        mean = np.mean(deltas, axis=0)
        momentum = mean + 0.9 * momentum
        w = w - outer_lr * (mean + 0.9 * momentum)
    for s in (states[0], states[1], states[2]):
        assert s.round == rounds
        np.testing.assert_allclose(np.asarray(s.params["w"]), w, rtol=1e-4)
        assert np.array_equal(np.asarray(s.params["w"]), np.asarray(states[0].params["w"]))


@pytest.mark.parametrize("kind", ["diloco", "dp"])
def test_a_group_started_with_a_batch_compiles_nothing_after_it_joins(lighthouse, kind):
    # Group 1 comes late, as a restarted group does, and passes a batch to start(): its
    # step and round are compiled before its first quorum, for the placements its heal
    # gives the state, so the steps and rounds that follow compile nothing more.
    replicas = _replicas(lighthouse, 1)
    hold = _Hold(2)
    jitted = ("_inner_step", "_delta", "_outer_step") if kind == "diloco" else ("_grad",)
    jitted += ("_apply_mean",) if kind == "dp" else ()
    compiled = []

    def make(replica):
        if kind == "dp":
            return ft.DataParallel(replica, _loss, optax.adamw(0.05))
        return ft.DiLoCo(replica, _loss, optax.adamw(0.05), optax.sgd(0.3), sync_every=2)

    def late():
        assert hold.go.wait(30), "group 0 did not reach round 2"
        replicas.append(ft.Replica(_address(lighthouse), replica_id=1, job_id=JOB, timeout=5.0))
        trainers.append(make(replicas[-1]))
        hold.ready.set()
        x, y = _batch(0, 0, 0, 1)
        batch = (x.astype(np.float32), y.astype(np.float32))
        state = trainers[-1].start({"w": jnp.zeros(5, jnp.float32)}, batch=batch)
        compiled.append(sizes(trainers[-1]))  # after its join round, before its first step
        return _steps(trainers[-1], state, 6, hold)

    def sizes(trainer):
        return {name: getattr(trainer, name)._cache_size() for name in jitted}

    trainers = [make(replicas[0])]

    def early():
        return _steps(trainers[0], trainers[0].start({"w": jnp.zeros(5, jnp.float32)}), 6, hold)

    try:
        _in_threads([early, late])
    finally:
        _close(replicas)
    trainer = trainers[-1]
    assert [e.healed for e in trainer.log].count(True) == 1 and trainer.log[-1].round == 6
    assert compiled == [dict.fromkeys(jitted, 1)] and sizes(trainer) == compiled[0]


def test_data_parallel_after_a_death_loses_only_the_aborted_step(lighthouse):
    replicas = _replicas(lighthouse, 3, timeout=2.0)
    lr, steps, die = 0.05, 6, 3
    try:
        trainers = [ft.DataParallel(r, _loss, optax.sgd(lr)) for r in replicas]
        states = _in_threads(
            [
                lambda: _train(trainers[0], steps),
                lambda: _train(trainers[1], steps),
                lambda: _train(trainers[2], steps, die_at=die),
            ]
        )
    finally:
        _close(replicas)
    w, aborted = np.zeros(5), 0
    for r in range(steps):
        # A step's batch is chosen before its quorum, from the last one's: the round the group
        # died in still draws thirds, of which only two arrive.
        count = 3 if r <= die else 2
        w -= lr * np.mean(
            [_grad64(w, *_batch(r, 0, i, count)) for i in range(2 if r >= die else 3)], axis=0
        )
    for s in states[:2]:
        assert s.round == steps
        np.testing.assert_allclose(np.asarray(s.params["w"]), w, rtol=1e-5)
    log = trainers[0].log
    aborted = [e for e in log if not e.committed]
    assert len(aborted) <= 1 and len(log) == 1 + steps + len(aborted)
    assert [e.members for e in log if e.committed][-1] == (0, 1)


def test_a_snapshot_survives_the_wire_with_its_shapes_dtypes_and_bits():
    import ml_dtypes

    shared = (
        np.array(3, np.int32),  # an optimizer's step count: 0-d must stay 0-d
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous
        np.zeros((0, 5), np.float32),
        np.array([True, False]),
        np.linspace(-1, 1, 7).astype(ml_dtypes.bfloat16),
    )
    snap = ft.Snapshot(4, shared, (np.ones((2, 2), np.float64),), {"tokens": 5})
    header, body = snap.encode()
    back = ft.Snapshot.decode(header, body)
    assert back.round == 4 and back.meta == {"tokens": 5} and back.hash() == snap.hash()
    for a, b in zip(snap.shared + snap.private, back.shared + back.private, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.tobytes() == b.tobytes()
    other = ft.Snapshot(4, (np.array([3], np.int32), *shared[1:]))
    assert other.hash() != snap.hash()  # shape (1,) is not shape ()
    tampered = bytearray(body)
    tampered[5] ^= 1
    with pytest.raises(ValueError, match="hashes to"):
        ft.Snapshot.decode(header, bytes(tampered))


def test_a_group_that_joins_late_heals_into_the_same_bits_with_adamw(lighthouse):
    replicas = _replicas(lighthouse, 1)
    trainers = {}

    def group(i, steps):
        replica = (
            replicas[0] if i == 0 else ft.Replica(_address(lighthouse), replica_id=i, job_id=JOB)
        )
        replicas.append(replica) if i else None
        trainers[i] = ft.DataParallel(replica, _loss, optax.adamw(0.05), wire_dtype="bfloat16")
        state = _train(trainers[i], steps, pause=0.02)
        replica.close()  # done: the other group's quorums stop waiting for it
        return state

    def late():  # joins once group 0 has committed a few steps, and heals from it
        deadline = time.monotonic() + 30
        while len(trainers.get(0).log if 0 in trainers else []) < 4:
            assert time.monotonic() < deadline, "group 0 committed nothing in 30 s"
            time.sleep(0.01)
        return group(1, 40)

    try:
        states = _in_threads([lambda: group(0, 40), late])
    finally:
        _close(replicas)
    healed = [e for e in trainers[1].log if e.healed]
    assert healed and healed[0].round > 1
    hashes = [{e.round: e.state_hash for e in trainers[i].log if e.committed} for i in (0, 1)]
    shared = sorted(set(hashes[0]) & set(hashes[1]))
    assert shared and all(hashes[0][r] == hashes[1][r] for r in shared)
    assert np.array_equal(np.asarray(states[0].params["w"]), np.asarray(states[1].params["w"]))


def test_a_group_back_after_the_job_finished_is_told_so_instead_of_training_alone(lighthouse):
    replicas = _replicas(lighthouse, 2)
    try:
        replicas[0].commit(ft.Snapshot(5, (np.ones(2, np.float32),)))
        replicas[1].commit(ft.Snapshot(3, (np.zeros(2, np.float32),)))  # stopped, then woken up
        replicas[0].close(finished=True)
        with pytest.raises(ft.JobFinished, match="finished at round 5.*holds round 3"):
            replicas[1].sync(np.ones(4, np.float32))
        replicas[1].committed = ft.Snapshot(5, (np.ones(2, np.float32),))
        assert replicas[1].sync(np.ones(4, np.float32)).committed  # one that holds it goes on
    finally:
        _close(replicas)


def test_nothing_listens_beyond_loopback_unless_asked(lighthouse):
    (replica,) = _replicas(lighthouse, 1)
    try:
        listening = [lighthouse.address, replica.endpoint.address]
        listening.append(replica._state_server.server_address[:2])
        assert {host for host, _ in listening} == {"127.0.0.1"}
    finally:
        replica.close()
    # The command line's own default, as the launcher starts it.
    cli = subprocess.Popen(
        [sys.executable, "-m", "jaxcomm.ft.lighthouse", "--job-id", JOB],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = cli.stdout.readline()
    finally:
        cli.kill()
        stderr = cli.communicate(timeout=10)[1]
    assert f"lighthouse for job {JOB} on 127.0.0.1:" in first, stderr
    assert "RuntimeWarning" not in stderr


def _freeze_at_exchange(replica, seconds):
    """As a SIGSTOP as its exchange starts: heartbeats stop, nothing sent, sockets open."""

    def freezes(phase, round_):
        if phase == "exchange":
            replica._closed.set()
            replica._heartbeats.join()
            time.sleep(seconds)

    replica._on_phase = freezes


def _timed_syncs(replicas):
    """Each replica's sync of ones, in threads: (rounds, seconds from the start to each end)."""
    start, took = time.monotonic(), {}

    def run(i):
        r = replicas[i].sync(np.ones(8, np.float32))
        took[i] = time.monotonic() - start
        return r

    return _in_threads([lambda i=i: run(i) for i in range(len(replicas))]), took


def test_a_member_frozen_in_the_exchange_is_not_waited_for_until_the_deadline(lighthouse):
    replicas = _replicas(lighthouse, 3, timeout=20.0)
    try:
        _commit_all(replicas, [np.zeros(2)] * 3)

        _freeze_at_exchange(replicas[2], HEARTBEAT + 3.0)
        rounds, took = _timed_syncs(replicas)
        assert [r.committed for r in rounds] == [False] * 3
        # The first survivor to see it silent aborts; the other may see that abort first.
        assert any("[2] stopped sending heartbeats" in r.reason for r in rounds[:2])
        assert max(took[0], took[1]) < HEARTBEAT + 2.0  # not the 20 s deadline
    finally:
        _close(replicas)


def test_a_group_healing_from_a_member_that_froze_turns_to_another(lighthouse):
    # Group 2 is behind and asks group 0 first (the next id above its own, cyclically);
    # group 0 freezes as the round starts: its state server accepts and never answers.
    replicas = _replicas(lighthouse, 3, timeout=20.0)
    try:
        good = ft.Snapshot(5, (np.arange(4, dtype=np.float32),))
        replicas[0].commit(good)
        replicas[1].commit(good)
        replicas[2].commit(ft.Snapshot(2, (np.zeros(4, np.float32),)))
        assert replicas[0].state_hash == replicas[1].state_hash != replicas[2].state_hash
        frozen = HEARTBEAT + 3.0
        _freeze_at_exchange(replicas[0], frozen)
        handler = replicas[0]._state_server.RequestHandlerClass
        handler.handle = lambda self: time.sleep(frozen)
        rounds, took = _timed_syncs(replicas)
        assert rounds[2].healed is not None and rounds[2].healed.hash() == good.hash()
        assert replicas[2].state_hash == replicas[1].state_hash
        assert [r.committed for r in rounds] == [False] * 3  # group 0 never sends
        assert took[2] < HEARTBEAT + 2.0  # not held until group 0 wakes (or the deadline)
    finally:
        _close(replicas)


def test_a_slow_member_that_sends_heartbeats_is_waited_for(lighthouse):
    replicas = _replicas(lighthouse, 3, timeout=20.0)
    try:
        _commit_all(replicas, [np.zeros(2)] * 3)
        slow = HEARTBEAT * 4
        replicas[2]._on_phase = lambda phase, r: time.sleep(slow) if phase == "exchange" else None
        start = time.monotonic()
        rounds = _in_threads(
            [lambda i=i: replicas[i].sync(np.ones(8, np.float32)) for i in range(3)]
        )
        assert [r.committed for r in rounds] == [True] * 3 and rounds[0].contributors == 3
        assert time.monotonic() - start >= slow
    finally:
        _close(replicas)
