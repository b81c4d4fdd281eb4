"""jaxcomm.ft.exchange: the fault-tolerant host exchange between replica groups.

Members are threads of this process, each its own Endpoint on loopback; one test runs a member
in a subprocess and SIGKILLs it mid-exchange. Results are checked against a float64 NumPy sum
within the rounding of float32 (or the wire dtype) per hop, and bitwise between members.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxcomm.ft import exchange
from jaxcomm.ft.exchange import Endpoint, ExchangeAborted, Member

JOB = "test-job"
SIZES = (0, 1, 3, 1000, 2**20 + 7)
WIRES = (None, "bfloat16", "float16")
# Unit roundoff, doubled for slack: one rounding per hop, at most n of them.
EPS = {None: 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-10}
TINY = {None: 0.0, "bfloat16": 0.0, "float16": 2.0**-24}  # float16's subnormal spacing


@pytest.fixture
def endpoints():
    """make(n) gives n endpoints with replica ids 0..n-1; all are closed afterwards."""
    made: list[Endpoint] = []
    before = set(threading.enumerate())

    def make(n: int, job: str = JOB, first: int = 0) -> list[Endpoint]:
        eps = [Endpoint(job, first + i) for i in range(n)]
        made.extend(eps)
        return eps

    try:
        yield make
    finally:
        for ep in made:
            ep.close()
        wait_until = time.monotonic() + 5
        while set(threading.enumerate()) - before and time.monotonic() < wait_until:
            time.sleep(0.01)
        assert not set(threading.enumerate()) - before, "threads left running"


def members_of(eps: list[Endpoint]) -> list[Member]:
    return [Member(ep.replica_id, *ep.address) for ep in eps]


def run_round(eps, xs, *, epoch=0, round=0, members=None, timeout=10.0, wire=None):
    """Runs one round on every endpoint in threads; returns (results or exceptions, seconds)."""
    members = members_of(eps) if members is None else members
    deadline = time.monotonic() + timeout
    out: list = [None] * len(eps)
    took: list = [None] * len(eps)

    def member(i: int) -> None:
        t0 = time.monotonic()
        try:
            out[i] = eps[i].allreduce_sum(
                xs[i], epoch=epoch, round=round, members=members, deadline=deadline, wire_dtype=wire
            )
        except Exception as e:  # handed to the test
            out[i] = e
        took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(eps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert not any(t.is_alive() for t in threads), "a member hung past its deadline"
    return out, took


def check_sum(results, xs, wire):
    """Each result is close to the float64 sum, and all are bitwise equal."""
    for r in results:
        assert not isinstance(r, Exception), repr(r)
        assert r.dtype == np.float32 and r.shape == xs[0].shape
    n = len(xs)
    ref = np.sum(np.asarray(xs, np.float64), axis=0)
    bound = (n + 1) * EPS[wire] * np.sum(np.abs(np.asarray(xs, np.float64)), axis=0)
    np.testing.assert_array_less(np.abs(results[0] - ref), bound + (n + 1) * TINY[wire] + 1e-30)
    for r in results[1:]:
        assert np.array_equal(r.view(np.uint32), results[0].view(np.uint32))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_sums_every_size_and_wire(endpoints, n):
    eps = endpoints(n)
    rng = np.random.default_rng(n)
    rounds = itertools.count()
    for size, wire in itertools.product(SIZES, WIRES):
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
        results, _ = run_round(eps, xs, round=next(rounds), wire=wire)
        check_sum(results, xs, wire)
        if n == 1:
            assert results[0] is not xs[0]
            want = xs[0] if wire is None else xs[0].astype(exchange._WIRES[wire]).astype(np.float32)
            assert np.array_equal(results[0], want)
    assert (eps[0].bytes_sent > 0) == (n > 1)
    assert all(ep.refused == [] for ep in eps)


def test_members_in_any_order_and_as_tuples(endpoints):
    eps = endpoints(3)
    xs = [np.full(10, i + 1, np.float32) for i in range(3)]
    members = [tuple(m) for m in reversed(members_of(eps))]
    results, _ = run_round(eps, xs, members=members)
    for r in results:
        assert np.array_equal(r, np.full(10, 6, np.float32))


def test_member_that_never_shows_up(endpoints):
    eps = endpoints(3)
    # Replica 3 listens but never runs the round; replica 4 does not even listen.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    members = members_of(eps) + [Member(4, "127.0.0.1", dead_port)]
    xs = [np.ones(100, np.float32)] * 2
    results, took = run_round(eps[:2], xs, members=members, timeout=1.5)
    for r, t in zip(results, took, strict=True):
        assert isinstance(r, ExchangeAborted), r
        assert t < 1.5 + 1.0
    assert "deadline passed" in str(results[0]) + str(results[1])
    assert all("[peer replica " in str(r) for r in results)


def test_member_aborted_mid_exchange_fails_the_others_fast(endpoints):
    eps = endpoints(4)
    mid, release = threading.Event(), threading.Event()
    real = eps[2]._recv_msg

    def stalled(*args):
        mid.set()
        release.wait(10)
        return real(*args)

    eps[2]._recv_msg = stalled  # replica 2 stops in its first receive
    xs = [np.ones(4000, np.float32)] * 4

    def abort_when_stalled():
        mid.wait(10)
        eps[2].abort()
        release.set()

    aborter = threading.Thread(target=abort_when_stalled)
    aborter.start()
    try:
        results, took = run_round(eps, xs, timeout=30.0)
    finally:
        release.set()
        aborter.join()
    assert all(isinstance(r, ExchangeAborted) for r in results), results
    assert "aborted" in str(results[2])
    assert max(took) < 2.0


def test_member_that_fails_before_sending_fails_the_others_fast(endpoints):
    eps = endpoints(3)
    me2 = members_of(eps)[2:]
    eps[2].allreduce_sum(np.ones(4, np.float32), epoch=0, round=5, members=me2, deadline=1e12)
    # Replica 2 is past round 1: it refuses 1, which fails before sending and closes the
    # connection 0 made to it; 0 notices that while it waits for 2's connection.
    xs = [np.ones(4000, np.float32)] * 3
    first: list = []
    members = members_of(eps)
    kw = dict(epoch=0, round=1, members=members, timeout=30.0)
    zero = threading.Thread(target=lambda: first.append(run_round(eps[:1], xs[:1], **kw)))
    zero.start()
    try:
        wait_until = time.monotonic() + 10
        while not eps[1]._held and time.monotonic() < wait_until:
            time.sleep(0.01)  # 0 has connected to 1 before 1 starts the round
        results, took = run_round(eps[1:], xs[1:], **kw)
    finally:
        zero.join(35)
    results, took = first[0][0] + results, first[0][1] + took
    assert all(isinstance(r, ExchangeAborted) for r in results), results
    assert "refused by the peer: stale" in str(results[1])
    assert "closed its connection [peer replica 1" in str(results[0])
    assert max(took) < 2.0


CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    import numpy as np
    spec = importlib.util.spec_from_file_location("exchange", sys.argv[1])
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    def stuck(self, *args):
        print("mid", flush=True)
        time.sleep(60)

    ex.Endpoint._recv_msg = stuck  # connected both ways, then stops at its first receive
    ep = ex.Endpoint(sys.argv[2], 1)
    print(ep.address[1], flush=True)
    members = [ex.Member(*m) for m in json.loads(sys.stdin.readline())]
    ep.allreduce_sum(np.ones(4000, np.float32), epoch=0, round=0, members=members,
                     deadline=time.monotonic() + 30)
    """
)


def test_member_killed_mid_exchange_fails_the_others_fast(endpoints):
    eps = endpoints(1) + endpoints(2, first=2)  # replicas 0, 2, 3; the child is replica 1
    path = pathlib.Path(exchange.__file__)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), JOB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    try:
        port = int(child.stdout.readline())
        members = members_of(eps) + [Member(1, "127.0.0.1", port)]
        child.stdin.write(json.dumps(members) + "\n")
        child.stdin.flush()
        killed = []

        def kill_when_mid():
            if child.stdout.readline().strip() == "mid":
                child.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())

        killer = threading.Thread(target=kill_when_mid)
        killer.start()
        xs = [np.ones(4000, np.float32)] * 3
        results, _ = run_round(eps, xs, members=members, timeout=30.0)
        done = time.monotonic()
        killer.join(5)
        assert killed, "the child never got mid-exchange"
        assert all(isinstance(r, ExchangeAborted) for r in results), results
        assert done - killed[0] < 2.0
    finally:
        child.kill()
        child.wait(10)
        child.stdin.close()
        child.stdout.close()


def test_abort_during_blocked_receive(endpoints):
    eps = endpoints(2)
    # A raw peer that connects as replica 1 and then sends nothing.
    raw = socket.create_connection(eps[0].address)
    try:
        raw.sendall(exchange._pack_header(JOB.encode(), (0, 0), 1, 0))
        assert raw.recv(1) == b"A"
        aborter = threading.Timer(0.3, eps[0].abort)
        aborter.start()
        t0 = time.monotonic()
        with pytest.raises(ExchangeAborted, match="aborted"):
            eps[0].allreduce_sum(
                np.ones(8, np.float32),
                epoch=0,
                round=0,
                members=members_of(eps),
                deadline=time.monotonic() + 30,
            )
        assert time.monotonic() - t0 < 0.3 + 1.0
    finally:
        aborter.cancel()
        aborter.join()
        raw.close()
    with pytest.raises(ExchangeAborted, match="was aborted"):  # the same round again
        eps[0].allreduce_sum(
            np.ones(8, np.float32), epoch=0, round=0, members=members_of(eps), deadline=1e12
        )
    xs = [np.ones(8, np.float32)] * 2
    results, _ = run_round(eps, xs, round=1)
    check_sum(results, xs, None)


def test_other_job_and_bad_magic_are_refused(endpoints):
    eps = endpoints(2)
    (stranger,) = endpoints(1, job="other-job", first=1)
    with socket.create_connection(eps[1].address) as raw:
        raw.sendall(b"HTTP" + bytes(exchange._HEADER.size))
        assert raw.recv(1) == b"R"
    members = [members_of(eps)[0], Member(1, *stranger.address)]
    with pytest.raises(ExchangeAborted, match="refused by the peer: job id"):
        stranger.allreduce_sum(
            np.ones(8, np.float32), epoch=0, round=0, members=members, deadline=time.monotonic() + 5
        )
    xs = [np.arange(8, dtype=np.float32)] * 2
    results, _ = run_round(eps, xs)
    check_sum(results, xs, None)
    assert len(eps[0].refused) == 1 and "job id b'other-job'" in eps[0].refused[0]
    assert len(eps[1].refused) == 1 and "bad magic b'HTTP'" in eps[1].refused[0]


def test_old_epoch_refused_and_peer_ahead_held(endpoints):
    eps = endpoints(2)
    xs = [np.ones(16, np.float32)] * 2
    check_sum(run_round(eps, xs, epoch=5)[0], xs, None)
    (old,) = endpoints(1, first=1)
    members = [members_of(eps)[0], Member(1, *old.address)]
    with pytest.raises(ExchangeAborted, match="refused by the peer: old epoch 4"):
        old.allreduce_sum(xs[1], epoch=4, round=9, members=members, deadline=time.monotonic() + 5)
    assert len(eps[0].refused) == 1 and "old epoch 4" in eps[0].refused[0]

    # Replica 1 starts round 1 while replica 0 is still between rounds: it is held, not refused.
    ahead: list = []
    members = members_of(eps)
    t = threading.Thread(
        target=lambda: ahead.append(
            eps[1].allreduce_sum(
                xs[1], epoch=5, round=1, members=members, deadline=time.monotonic() + 10
            )
        )
    )
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not eps[0]._held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(eps[0]._held) == [(5, 1, 1)]
        mine = eps[0].allreduce_sum(
            xs[0], epoch=5, round=1, members=members, deadline=time.monotonic() + 10
        )
    finally:
        t.join(15)
    check_sum([mine, ahead[0]], xs, None)
    assert len(eps[0].refused) == 1


def test_reuse_and_recovery_after_an_aborted_round(endpoints):
    eps = endpoints(3)
    rng = np.random.default_rng(0)
    for r in range(20):
        xs = [rng.standard_normal(777).astype(np.float32) for _ in range(3)]
        results, _ = run_round(eps, xs, epoch=1, round=r, wire="bfloat16" if r % 2 else None)
        check_sum(results, xs, "bfloat16" if r % 2 else None)
    # Round 20 runs on replicas 0 and 1 only and is aborted; replica 2 holds 1's connection.
    aborter = threading.Timer(0.3, lambda: [ep.abort() for ep in eps[:2]])
    aborter.start()
    try:
        results, took = run_round(eps[:2], xs[:2], epoch=1, round=20, members=members_of(eps))
    finally:
        aborter.join()
    # Replica 0 waits on 2's connection, so only its own abort ends it. Replica 1 may see 0
    # close its connection before its own abort() runs: that is a peer failure, as good.
    assert isinstance(results[0], ExchangeAborted) and "aborted" in str(results[0])
    assert isinstance(results[1], ExchangeAborted)
    assert "aborted" in str(results[1]) or "[peer replica 0 " in str(results[1])
    assert max(took) < 1.5
    results, _ = run_round(eps, xs, epoch=2, round=0)
    check_sum(results, xs, None)
    assert all(ep.refused == [] for ep in eps)


def test_bad_input(endpoints):
    (ep,) = endpoints(1)
    me = members_of([ep])
    ok = dict(epoch=0, round=0, members=me, deadline=time.monotonic() + 5)
    with pytest.raises(ValueError, match="x must be a 1-D float32"):
        ep.allreduce_sum(np.ones(4, np.float64), **ok)
    with pytest.raises(ValueError, match="x must be a 1-D float32"):
        ep.allreduce_sum(np.ones((2, 2), np.float32), **ok)
    with pytest.raises(ValueError, match="members must"):
        ep.allreduce_sum(np.ones(4, np.float32), **{**ok, "members": [Member(7, "h", 1)]})
    with pytest.raises(ValueError, match="members must"):
        ep.allreduce_sum(np.ones(4, np.float32), **{**ok, "members": me + me})
    with pytest.raises(ValueError, match="wire_dtype must be"):
        ep.allreduce_sum(np.ones(4, np.float32), **ok, wire_dtype="int8")


def test_one_allreduce_at_a_time(endpoints):
    eps = endpoints(2)
    members = members_of(eps)
    first: list = []

    def blocked() -> None:  # replica 1 never runs the round
        try:
            eps[0].allreduce_sum(
                np.ones(4, np.float32), epoch=0, round=0, members=members, deadline=1e12
            )
        except ExchangeAborted as e:
            first.append(e)

    busy = threading.Thread(target=blocked)
    busy.start()
    try:
        time.sleep(0.2)
        with pytest.raises(RuntimeError, match="another allreduce_sum is running"):
            eps[0].allreduce_sum(
                np.ones(4, np.float32), epoch=0, round=1, members=members, deadline=1e12
            )
    finally:
        eps[0].abort()
        busy.join(5)
    assert not busy.is_alive() and "aborted" in str(first[0])
