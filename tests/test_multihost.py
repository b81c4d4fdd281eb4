"""Multi-process runs through ``python -m jaxcomm.launch``: 2 processes x 4 CPU
devices train like 1 process x 8, the launcher stops a job when a rank fails,
and jaxcomm.distributed reads the environment of launch, srun and mpirun.
Without the launcher, processes end on their own when a peer dies or freezes,
and check_same_settings and check_same_collectives stop a job whose processes
disagree on their settings or on the collectives their programs issue."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxcomm import distributed, launch
from jaxcomm.distributed import agreement, network

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "multihost" / "train.py"
STEPS = 10

# Same result up to summation order. In one process XLA adds the 8 device
# gradients itself; across processes the all-reduce runs over gloo, which adds
# them in another order, so the runs are not bitwise equal (measured after 10
# steps: 2-3 ulp, at most 1.2e-7 dense and 1.8e-7 hierarchical, on params of
# magnitude <= 1.4; about a fifth of the entries differ). A reordered float32
# sum of 8 terms is off by at most 7 eps * sum|g_i| (eps = 1.2e-7), i.e.
# ~1e-6 for these O(1) gradients; SGD with lr 0.1 and momentum 0.9 passes a
# gradient error on with gain lr / (1 - momentum) = 1 per step, so 10 steps
# stay under 1e-5 unless the dynamics amplify it. A run that skipped the
# cross-process sum is off by far more than that (checked below).
ATOL = 1e-5


def _run(
    args: list[str], timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxcomm.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_importing_jaxcomm(os.environ if env is None else env),
    )


def _importing_jaxcomm(env) -> dict:
    """``env`` where a script outside the repository imports this checkout's jaxcomm."""
    path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def _train(tmp_path: Path, processes: int, devices: int, algorithm: str, *extra: str) -> dict:
    out = tmp_path / f"{algorithm}-{processes}x{devices}.npz"
    result = _run(
        [
            *("-n", str(processes), "--devices-per-process", str(devices)),
            str(TRAIN),
            *("--algorithm", algorithm, "--steps", str(STEPS), "--out", str(out), *extra),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    last = processes - 1
    banner = f"[rank {last}] process {last}/{processes}: {devices} of {processes * devices}"
    assert banner in result.stdout
    with np.load(out) as params:
        return dict(params)


def _initial_params() -> dict:
    spec = importlib.util.spec_from_file_location("multihost_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args([])
    inputs, labels = module.make_data(args.seed)
    return module.init_params(args.seed, inputs.shape[1], args.hidden, int(labels.max()) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dense", "hierarchical"])
def test_two_processes_train_like_one(tmp_path, algorithm):
    one = _train(tmp_path, 1, 8, algorithm, "--nodes", "2")
    two = _train(tmp_path, 2, 4, algorithm)
    init = _initial_params()
    # Not bitwise: see ATOL. Report the difference when it fails.
    for name in one:
        diff = np.abs(one[name] - two[name]).max()
        assert diff <= ATOL, f"{algorithm} {name}: 2x4 vs 1x8 differ by {diff:.3g} > {ATOL}"
        assert np.abs(one[name] - init[name]).max() > 100 * ATOL, f"{name} did not train"


@pytest.mark.slow
def test_one_process_without_a_cross_process_sum_would_differ(tmp_path):
    """The tolerance is tight enough to see a missing sum: training on one
    process's half of each batch lands far outside it."""
    both = _train(tmp_path, 1, 8, "dense", "--nodes", "2")
    # 1 process x 4 devices sees a batch of 128 instead of 256: another gradient.
    half = _train(tmp_path, 1, 4, "dense", "--batch", "128")
    assert max(np.abs(both[k] - half[k]).max() for k in both) > 100 * ATOL


# A warm-up psum over both processes (so gloo has connected and said so), a
# second one once both have printed its result (so rank 0's line is out before
# rank 1 raises), then rank 1 notes the time and raises while rank 0 blocks in
# a third.
FAILING_RANK = """
    import sys, time, jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm.distributed as distributed

    settings = distributed.initialize()
    mesh = distributed.hierarchical_mesh()
    x = jax.make_array_from_callback((2,), NamedSharding(mesh, P(("node", "local"))),
                                     lambda i: np.ones(2, np.float32)[i])
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ("node", "local")), mesh=mesh,
                                  in_specs=P(("node", "local")), out_specs=P()))
    print("warm-up sum", float(total(x)[0]), flush=True)
    total(x).block_until_ready()
    if settings.process_id == 1:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("rank 1 gives up")
    print("rank 0 waits for rank 1", flush=True)
    print("sum", float(total(x)[0]), flush=True)  # blocks: rank 1 never joins
    print("rank 0 finished", flush=True)
"""


def _script(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_at_once(tmp_path):
    script = _script(tmp_path, "fail.py", FAILING_RANK)
    raised_at = tmp_path / "raised_at"
    args = ["-n", "2", "--devices-per-process", "1", "--grace-period", "60"]
    result = _run([*args, script, str(raised_at)], 150)
    # JAX catches SIGTERM, so a SIGTERM and the 60 s grace period would end the
    # job 60 s after rank 1 raised; SIGKILL at once ends it in about a second
    # (more on a loaded machine, hence the margin).
    stopped_after = time.time() - float(raised_at.read_text())
    assert result.returncode == 1, result.stdout + result.stderr
    assert "jaxcomm.launch: rank 1 exited with code 1; stopping ranks [0]" in result.stderr
    assert result.stderr.splitlines()[-1] == "jaxcomm.launch: exit code 1: rank 1 failed first"
    assert "[rank 1] RuntimeError: rank 1 gives up" in result.stderr
    assert "[rank 0] warm-up sum 2.0" in result.stdout
    assert "rank 0 finished" not in result.stdout
    assert "SIGTERM" not in result.stderr
    assert "[Gloo]" not in result.stdout + result.stderr  # connected, quietly
    assert stopped_after < 30, f"the job ended {stopped_after:.1f} s after rank 1 raised"


@pytest.mark.slow
def test_gloo_connection_lines_are_hidden_unless_asked_for(tmp_path):
    line = (
        "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    )
    script = _script(
        tmp_path,
        "gloo.py",
        f"""
        import sys
        print({line!r})
        print("[Gloo] something else")
        print({line!r}, file=sys.stderr)
        print("done")
        """,
    )
    quiet = _run(["-n", "1", script], 30)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.splitlines() == ["[rank 0] [Gloo] something else", "[rank 0] done"]
    assert quiet.stderr == ""
    shown = _run(["-n", "1", "--show-gloo", script], 30)
    assert shown.stdout.splitlines()[0] == f"[rank 0] {line}"
    assert shown.stderr.splitlines() == [f"[rank 0] {line}"]


@pytest.mark.slow
def test_a_killed_rank_is_named_and_a_stubborn_one_is_killed(tmp_path):
    script = _script(
        tmp_path,
        "die.py",
        """
        import os, signal, time
        if os.environ["JAXCOMM_PROCESS_ID"] == "2":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
        print("ready", flush=True)
        time.sleep(600)
        """,
    )
    start = time.monotonic()
    result = _run(["-n", "3", "--grace-period", "1", script], 60)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 2 was killed by SIGKILL; stopping ranks [0, 1]" in result.stderr
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    marker = tmp_path / "pids"
    script = _script(
        tmp_path,
        "sleep.py",
        f"""
        import os, time
        with open({str(marker)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        print("ready", flush=True)
        time.sleep(600)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxcomm.launch", "-n", "2", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        not marker.exists() or len(marker.read_text().split()) < 2
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    assert "got SIGINT; stopping all 2 processes" in err
    for pid in map(int, marker.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_output_is_prefixed_and_the_environment_set(tmp_path):
    script = _script(
        tmp_path,
        "env.py",
        """
        import os, sys
        rank = os.environ["JAXCOMM_PROCESS_ID"]
        print("coordinator", os.environ["JAXCOMM_COORDINATOR"])
        print("count", os.environ["JAXCOMM_NUM_PROCESSES"], "args", *sys.argv[1:])
        print("flags", os.environ["XLA_FLAGS"])
        print("to stderr", file=sys.stderr, end="")  # no newline: still one line
        """,
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dummy=1")
    result = _run(["-n", "2", "--devices-per-process", "3", script, "a", "--b"], 30, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    coordinators = {line for line in lines if "coordinator" in line}
    ports = {line.rsplit(":", 1)[1] for line in coordinators}
    assert len(ports) == 1 and 1024 <= int(ports.pop()) <= 65535
    for rank in (0, 1):
        assert f"[rank {rank}] coordinator 127.0.0.1:" in result.stdout
        assert f"[rank {rank}] count 2 args a --b" in lines
        flags = f"[rank {rank}] flags --xla_dummy=1 --xla_force_host_platform_device_count=3"
        assert flags in lines
        assert f"[rank {rank}] to stderr" in result.stderr.splitlines()
    assert all(line.startswith("[rank ") for line in lines)


@pytest.mark.slow
def test_exit_codes_propagate(tmp_path):
    script = _script(
        tmp_path,
        "code.py",
        """
        import os, sys
        sys.exit(7 if os.environ["JAXCOMM_PROCESS_ID"] == "0" else 0)
        """,
    )
    result = _run(["-n", "2", script], 30)
    assert result.returncode == 7
    assert "rank 0 exited with code 7" in result.stderr
    assert _run(["-n", "2", _script(tmp_path, "ok.py", "pass\n")], 30).returncode == 0


def test_signalling_a_process_already_gone_is_no_error():
    """stop_all signals each process's group; one that exits between its poll
    and the signal (a race the launcher can meet) is no error."""
    proc = subprocess.Popen([sys.executable, "-c", ""], start_new_session=True)
    proc.wait()
    launch._signal_group(proc, signal.SIGTERM)  # its group is gone: ProcessLookupError
    launch.stop_all([proc], grace_period=0)  # done already: nothing to signal


def test_free_port_can_be_bound():
    port = launch.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# Plain processes, no launcher: what a process does on its own when a peer
# dies, and check_same_settings and check_same_collectives.

# One warm-up psum over a mesh that spans both processes (so compilation and
# gloo's connections are done), then the victim idles and the survivor blocks
# in a second psum that the victim never joins.
BLOCKED_IN_PSUM = """
    import os, time, jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxcomm.distributed as distributed

    settings = distributed.initialize(heartbeat_timeout_s=int(os.environ["HEARTBEAT_S"]))
    mesh = distributed.hierarchical_mesh()
    x = jax.make_array_from_callback((2,), NamedSharding(mesh, P(("node", "local"))),
                                     lambda i: np.ones(2, np.float32)[i])
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ("node", "local")), mesh=mesh,
                                  in_specs=P(("node", "local")), out_specs=P()))
    print("warm-up sum", float(total(x)[0]), flush=True)
    if settings.process_id == int(os.environ["VICTIM"]):
        print("victim idles", flush=True)
        time.sleep(600)
    print("survivor enters the collective", flush=True)
    print("sum", float(total(x)[0]), flush=True)
    print("survivor finished", flush=True)
"""

# What the survivor says: jaxcomm's excepthook after gloo lost the connection,
# or JAX's coordination service aborting the process.
PEER_DIED = re.compile(
    r"another process of this job, which has most likely died"
    r"|Terminating process because the JAX distributed service detected fatal errors"
)


def _start(tmp_path: Path, script: str, n: int = 2, **env_by_rank) -> list:
    """``n`` processes of ``script`` with the JAXCOMM_* variables that
    jaxcomm.launch would set, one CPU device each, output to rank<k>.log.
    ``env_by_rank``: variable -> one value for all ranks, or a list per rank."""
    port = launch.free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("JAX_COORDINATOR_ADDRESS", None)
        env.update(
            JAXCOMM_COORDINATOR=f"127.0.0.1:{port}",
            JAXCOMM_NUM_PROCESSES=str(n),
            JAXCOMM_PROCESS_ID=str(rank),
            XLA_FLAGS=launch.with_device_count(env.get("XLA_FLAGS", ""), 1),
        )
        for name, value in env_by_rank.items():
            env[name] = str(value[rank] if isinstance(value, list | tuple) else value)
        with open(tmp_path / f"rank{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, script], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
    return procs


def _log(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.log").read_text(errors="replace")


def _wait_for(tmp_path: Path, rank: int, text: str, procs: list, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while text not in _log(tmp_path, rank):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _kill(procs)
            logs = "\n".join(f"--- rank {r}\n{_log(tmp_path, r)}" for r in range(len(procs)))
            pytest.fail(f"rank {rank} never printed {text!r}\n{logs}")
        time.sleep(0.1)


def _kill(procs: list):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL also ends a stopped process
        proc.wait()


def _survivor_exit(
    tmp_path, victim: int, signum: int, heartbeat_s: int = 30
) -> tuple[int, float, str]:
    """Starts BLOCKED_IN_PSUM on 2 processes, sends ``signum`` to ``victim``
    once the other one is in the collective; returns the survivor's exit
    code, seconds from the signal to its exit, and its output."""
    script = _script(tmp_path, "blocked.py", BLOCKED_IN_PSUM)
    procs = _start(tmp_path, script, VICTIM=victim, HEARTBEAT_S=heartbeat_s)
    survivor = 1 - victim
    try:
        _wait_for(tmp_path, victim, "victim idles", procs)
        _wait_for(tmp_path, survivor, "survivor enters the collective", procs)
        time.sleep(1)  # let it reach the collective's wait
        procs[victim].send_signal(signum)
        signalled = time.monotonic()
        try:
            code = procs[survivor].wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - signalled
    finally:
        _kill(procs)
    output = _log(tmp_path, survivor)
    assert code is not None, f"the survivor still runs 120 s after the signal:\n{output}"
    return code, elapsed, output


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator-killed", "worker-killed"])
def test_a_killed_process_ends_the_others_without_a_launcher(tmp_path, victim):
    """SIGKILL: the survivor's collective fails as the TCP connection closes
    (measured: 0.01-0.1 s), or JAX aborts it when the coordinator is gone."""
    code, elapsed, output = _survivor_exit(tmp_path, victim, signal.SIGKILL)
    assert code != 0, output
    assert "survivor finished" not in output
    assert PEER_DIED.search(output), output
    assert elapsed < 60, f"the survivor took {elapsed:.0f} s to exit:\n{output}"


@pytest.mark.slow
def test_a_frozen_process_ends_the_others_by_heartbeat_timeout(tmp_path):
    """SIGSTOP: the connection stays open and the collective would wait for
    good; the coordination service finds the missing heartbeats after
    ``heartbeat_timeout_s`` (10 s here, 30 s by default) and aborts the survivor."""
    code, elapsed, output = _survivor_exit(tmp_path, 1, signal.SIGSTOP, heartbeat_s=10)
    assert code != 0, output
    assert "survivor finished" not in output
    assert "stopped sending heartbeats" in output, output
    assert elapsed < 60, f"the survivor took {elapsed:.0f} s to exit:\n{output}"


SAME_SETTINGS = """
    import os
    import jaxcomm.distributed as distributed

    distributed.initialize()
    distributed.check_same_settings(
        {"wire_dtype": os.environ["WIRE_DTYPE"], "bucket_bytes": 2**22, "axes": ("node", "local")}
    )
    print("settings agree", flush=True)
"""


def _finish(procs: list, timeout: float = 120) -> list:
    try:
        return [proc.wait(timeout=timeout) for proc in procs]
    finally:
        _kill(procs)


@pytest.mark.slow
def test_check_same_settings_across_processes(tmp_path):
    script = _script(tmp_path, "same.py", SAME_SETTINGS)
    agree = tmp_path / "agree"
    agree.mkdir()
    assert _finish(_start(agree, script, WIRE_DTYPE="bfloat16")) == [0, 0]
    assert "settings agree" in _log(agree, 0) and "settings agree" in _log(agree, 1)

    differ = tmp_path / "differ"
    differ.mkdir()
    codes = _finish(_start(differ, script, WIRE_DTYPE=["bfloat16", "float16"]))
    for rank in (0, 1):
        output = _log(differ, rank)
        assert codes[rank] == 1, output
        assert "ValueError: settings differ between the processes of this job" in output
        assert "wire_dtype: 'bfloat16' on process 0; 'float16' on process 1" in output
        assert "bucket_bytes" not in output and "settings agree" not in output

    # JAX lets processes that disagree on the count connect and start their
    # backends; without this check they would wait for process 2.
    counts = tmp_path / "counts"
    counts.mkdir()
    codes = _finish(_start(counts, script, WIRE_DTYPE="bfloat16", JAXCOMM_NUM_PROCESSES=[2, 3]))
    for rank in (0, 1):
        output = _log(counts, rank)
        assert codes[rank] != 0, output
        assert "jax.process_count(): 2 on process 0; 3 on process 1" in output, output


@pytest.mark.slow
def test_check_same_settings_names_a_process_that_never_calls_it(tmp_path):
    script = _script(
        tmp_path,
        "missing.py",
        """
        import jax
        import jaxcomm.distributed as distributed

        settings = distributed.initialize()
        jax.devices()  # every process must start its backend: they meet to do so
        if settings.process_id == 0:
            distributed.check_same_settings({"lr": 0.1}, timeout_s=2)
        """,
    )
    codes = _finish(_start(tmp_path, script))
    assert codes[0] != 0
    output = _log(tmp_path, 0)
    assert "TimeoutError: process 1 did not publish settings within 2 s" in output, output


def test_settings_differences_in_one_process():
    differences = agreement._differences(
        {0: {"a": "1", "b": "2"}, 1: {"a": "1", "b": "3"}, 2: {"a": "1"}}
    )
    assert differences == "  b: 2 on process 0; 3 on process 1; <not set> on process 2"
    assert agreement._differences({0: {"a": "1"}, 1: {"a": "1"}}) is None
    many = agreement._differences({p: {"k": str(p % 2)} for p in range(20)})
    assert "0 on processes 0, 2, 4, 6, 8, 10, 12, 14, ... (10 in all)" in many
    # Dicts and sets compare by content, not by insertion or hash order.
    canonical = agreement._canonical
    assert canonical({"b": 1, "a": {2, 1}}) == canonical({"a": {1, 2}, "b": 1})
    assert canonical((1, [2])) != canonical([1, (2,)])
    distributed.check_same_settings({"lr": 0.1, "dtype": np.dtype("float16")})
    with pytest.raises(TypeError, match="memory address"):
        distributed.check_same_settings({"loss": object()})
    for reserved in ("jax.__version__", "jax.process_count()"):
        with pytest.raises(ValueError, match="reserved"):
            distributed.check_same_settings({reserved: "0"}, runtime=False)


# Two leaves summed with jaxcomm.allreduce in the order ORDER names them: a
# process that flattens its gradients in another order issues the same
# all-reduces swapped. With AGREE_THEN_RUN both also run the step afterwards.
SAME_COLLECTIVES = """
    import os, jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxcomm, jaxcomm.distributed as distributed

    distributed.initialize()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    order = os.environ["ORDER"].split(",")

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P())
    def step(x):
        grads = {"w": x[:2], "b": x[2:]}
        return tuple(jaxcomm.allreduce(grads[k], "d", backend="xla") for k in order)

    values = np.arange(6 * mesh.size, dtype=np.float32)
    x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("d")), values.__getitem__)
    if os.environ.get("SKIP") != str(jax.process_index()):
        timeout_s = float(os.environ["TIMEOUT"])
        collectives = distributed.check_same_collectives(step, x, timeout_s=timeout_s)
        print("collectives agree:", len(collectives), flush=True)
    if os.environ.get("AGREE_THEN_RUN"):
        print("sums", *(np.asarray(s).tolist() for s in step(x)), flush=True)
"""


@pytest.mark.slow
def test_check_same_collectives_across_processes(tmp_path):
    script = _script(tmp_path, "collectives.py", SAME_COLLECTIVES)
    agree = tmp_path / "agree"
    agree.mkdir()
    assert _finish(_start(agree, script, ORDER="w,b", TIMEOUT=60, AGREE_THEN_RUN=1)) == [0, 0]
    for rank in (0, 1):
        output = _log(agree, rank)
        assert "collectives agree: 2" in output, output
        assert "sums [6.0, 8.0] [10.0, 12.0, 14.0, 16.0]" in output, output

    differ = tmp_path / "differ"
    differ.mkdir()
    codes = _finish(_start(differ, script, ORDER=["w,b", "b,w"], TIMEOUT=60))
    first = "all-reduce(add) f32[{}] channel replica_groups={{{{0,1}}}} use_global_device_ids=true"
    for rank in (0, 1):
        output = _log(differ, rank)
        assert codes[rank] == 1, output
        assert (
            "ValueError: collectives differ between the processes of this job "
            f"(this is process {rank} of 2):\n"
            "  first difference at collective 0 (counting from 0):\n"
            f"    {first.format(2)} on process 0\n"
            f"    {first.format(4)} on process 1\n"
            "  collectives in all: 2 on processes 0, 1\n"
        ) in output, output
        assert f"    > 0: {first.format(4)}\n      1: {first.format(2)}" in output, output
        assert "collectives agree" not in output


@pytest.mark.slow
def test_check_same_collectives_when_processes_are_missing(tmp_path):
    """A process that never calls it is named; processes that disagree on the
    count stop at once rather than wait for process 2."""
    script = _script(tmp_path, "collectives.py", SAME_COLLECTIVES)
    never = tmp_path / "never"
    never.mkdir()
    codes = _finish(_start(never, script, ORDER="w,b", TIMEOUT=2, SKIP=1))
    assert codes[0] != 0
    output = _log(never, 0)
    assert "TimeoutError: process 1 did not publish collectives within 2.0 s" in output, output
    assert "must call check_same_collectives the same number of times" in output, output

    counts = tmp_path / "counts"
    counts.mkdir()
    codes = _finish(_start(counts, script, ORDER="w,b", TIMEOUT=60, JAXCOMM_NUM_PROCESSES=[2, 3]))
    for rank in (0, 1):
        output = _log(counts, rank)
        assert codes[rank] == 1, output
        assert "ValueError: the process count differs between the processes" in output, output
        assert "jax.process_count(): 2 on process 0; 3 on process 1" in output, output


def test_one_gpu_each_deals_the_visible_gpus_round_robin():
    listing = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"
    assert launch.visible_gpus({}, listing) == ["0", "1"]
    assert launch.visible_gpus({}, "No devices were found\n") == []
    # An outer restriction is kept: its entries (ids or UUIDs) are dealt out.
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, GPU-x"}, listing) == ["3", "GPU-x"]
    seen = [
        launch.process_env({}, rank=r, num_processes=5, port=1, devices_per_process=None,
                           gpus=["3", "5"])["CUDA_VISIBLE_DEVICES"]
        for r in range(5)
    ]  # fmt: skip
    assert seen == ["3", "5", "3", "5", "3"]
    plain = launch.process_env({}, rank=0, num_processes=1, port=1, devices_per_process=None)
    assert "CUDA_VISIBLE_DEVICES" not in plain


def test_one_gpu_each_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(7)\n")
    assert launch.main(["-n", "2", "--one-gpu-each", str(script)]) == 2
    assert "one_gpu_each: no GPU" in capsys.readouterr().err


# jaxcomm.distributed.resolve_settings: pure functions of the environment.


def test_launcher_variables():
    env = {"JAXCOMM_COORDINATOR": "127.0.0.1:1234", "JAXCOMM_NUM_PROCESSES": "2"}
    env["JAXCOMM_PROCESS_ID"] = "1"
    assert distributed.resolve_settings(environ=env) == distributed.ProcessSettings(
        "127.0.0.1:1234", 2, 1, "JAXCOMM_*"
    )
    # JAX's own variable names the coordinator too.
    env = {"JAX_COORDINATOR_ADDRESS": "h:9", "JAXCOMM_NUM_PROCESSES": "2"}
    env["JAXCOMM_PROCESS_ID"] = "0"
    assert distributed.resolve_settings(environ=env).coordinator_address == "h:9"


def test_slurm_and_open_mpi():
    slurm = {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_JOB_ID": "4096",
        "SLURM_JOB_NODELIST": "a100-[007-010],b1",
    }
    settings = distributed.resolve_settings(environ=slurm)
    assert settings == distributed.ProcessSettings("a100-007:61440", 8, 5, "SLURM")
    port = dict(slurm, JAXCOMM_COORDINATOR_PORT="2222")
    assert distributed.resolve_settings(environ=port).coordinator_address == "a100-007:2222"
    # mpirun inside an allocation: the MPI ranks, not the batch script's task.
    mpi = dict(slurm, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1")
    mpi["JAXCOMM_COORDINATOR"] = "head:5000"
    assert distributed.resolve_settings(environ=mpi) == distributed.ProcessSettings(
        "head:5000", 2, 1, "Open MPI"
    )
    # The launcher's variables win over the scheduler's.
    ours = dict(mpi, JAXCOMM_NUM_PROCESSES="3", JAXCOMM_PROCESS_ID="2")
    assert distributed.resolve_settings(environ=ours).num_processes == 3


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        ({"JAXCOMM_NUM_PROCESSES": "2"}, {}, "JAXCOMM_NUM_PROCESSES is set but JAXCOMM_PROCESS_ID"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, {}, "no coordinator"),
        ({}, {"num_processes": 2}, "no process_id"),
        ({}, {"num_processes": 2, "process_id": 2}, r"outside \[0, 2\)"),
        ({"JAXCOMM_NUM_PROCESSES": "x", "JAXCOMM_PROCESS_ID": "0"}, {}, "not an integer"),
        (
            {"JAXCOMM_COORDINATOR": "a:1", "JAX_COORDINATOR_ADDRESS": "b:1"},
            {},
            "disagree",
        ),
        (
            {"JAXCOMM_NUM_PROCESSES": "2", "JAXCOMM_PROCESS_ID": "1"},
            {"process_id": 0, "coordinator_address": "h:1"},
            "process_id=0 contradicts JAXCOMM_PROCESS_ID=1",
        ),
        ({}, {"num_processes": 2, "process_id": 0, "coordinator_address": "h"}, "host:port"),
    ],
)
def test_clear_errors(env, kwargs, message):
    with pytest.raises(ValueError, match=message):
        distributed.resolve_settings(**kwargs, environ=env)


def test_first_slurm_host():
    assert distributed.first_slurm_host("n[1,3-4]") == "n1"
    assert distributed.first_slurm_host("login") == "login"
    with pytest.raises(ValueError, match="cannot read"):
        distributed.first_slurm_host("")


def test_hierarchical_mesh_in_one_process():
    mesh = distributed.hierarchical_mesh("inter", "intra", nodes=4)
    assert dict(mesh.shape) == {"inter": 4, "intra": 2}
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in mesh.devices.flat)
    for nodes in (3, 16, 0):
        with pytest.raises(ValueError, match="does not fit 1 processes of 8 devices"):
            distributed.hierarchical_mesh(nodes=nodes)


# Where a job's sockets listen: gloo on the interface it is given, the
# coordination service no wider than the coordinator address needs.


def _listening(path: str, port: int | None = None) -> list[tuple[str, int, str]]:
    """(address, port, inode) of the sockets listening in /proc/net/tcp or tcp6."""
    rows = []
    for line in Path(path).read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "0A":  # TCP_LISTEN
            continue
        hex_address, hex_port = fields[1].split(":")
        # Each 32-bit word is in host (little-endian) order.
        raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, 32, 8))
        address = ipaddress.ip_address(raw[: len(hex_address) // 2])
        if address.version == 6 and address.ipv4_mapped:
            address = address.ipv4_mapped
        if port is None or int(hex_port, 16) == port:
            rows.append((str(address), int(hex_port, 16), fields[9]))
    return rows


GLOO_ENDPOINT = """
    import json, os, jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxcomm.distributed as distributed
    from tests.test_multihost import _listening

    distributed.initialize(interface=os.environ.get("INTERFACE_ARGUMENT"))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("d")), lambda i: np.ones(2)[i])
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"),
                                  out_specs=P()))
    print("sum", float(total(x)[0]), flush=True)
    own = set()  # inodes of this process's sockets
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
        if target.startswith("socket:["):
            own.add(target[len("socket:[") : -1])
    coordinator_port = int(os.environ["JAXCOMM_COORDINATOR"].rsplit(":", 1)[1])
    gloo = sorted({address for path in ("/proc/net/tcp", "/proc/net/tcp6")
                   for address, port, inode in _listening(path)
                   if inode in own and port != coordinator_port})
    print("gloo listens on", json.dumps(gloo), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, address",
    [
        ({"JAXCOMM_SOCKET_IFNAME": "lo"}, "127.0.0.1"),
        # The argument wins over the variable; an address works as a name does.
        ({"JAXCOMM_SOCKET_IFNAME": "nope0", "INTERFACE_ARGUMENT": "127.0.0.2"}, "127.0.0.2"),
    ],
    ids=["interface-from-environment", "address-from-argument"],
)
def test_gloo_listens_on_the_interface_it_is_given(tmp_path, env, address):
    """Without an interface gloo listens where this host's name resolves
    (127.0.0.1 here), so only the 127.0.0.2 case tells the binding apart from
    that default; the lo case shows an interface name end to end."""
    script = _script(tmp_path, "gloo.py", GLOO_ENDPOINT)
    codes = _finish(_start(tmp_path, script, PYTHONPATH=str(ROOT), **env))
    for rank in (0, 1):
        output = _log(tmp_path, rank)
        assert codes[rank] == 0, output
        assert "sum 2.0" in output, output
        assert f'gloo listens on ["{address}"]' in output, output


def test_an_interface_this_host_lacks_is_named(monkeypatch):
    for name in ("JAXCOMM_NUM_PROCESSES", "JAXCOMM_PROCESS_ID", "JAXCOMM_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"interface='nope0': this host has no network interface"):
        distributed.initialize(interface="nope0")
    monkeypatch.setenv("JAXCOMM_SOCKET_IFNAME", "nope0")
    with pytest.raises(ValueError, match=r"JAXCOMM_SOCKET_IFNAME='nope0': this host has no"):
        distributed.initialize()
    # 192.0.2.0/24 is reserved for documentation: no host of this test holds it.
    with pytest.raises(ValueError, match=r"interface='192.0.2.250' is not an address of this"):
        network.resolve_interface("192.0.2.250")
    for empty in ("", " ", 3):
        with pytest.raises(ValueError, match="must name a network interface"):
            network.resolve_interface(empty)
    assert network.resolve_interface("lo") == network.GlooEndpoint(interface="lo")
    assert network.resolve_interface("::1") == network.GlooEndpoint(address="::1")
    assert network.resolve_interface(environ={"JAXCOMM_SOCKET_IFNAME": ""}) is None


WAIT_FOR_STOP = """
    import os, sys, time, jax
    import jaxcomm.distributed as distributed

    distributed.initialize()
    jax.devices()  # both processes have joined
    print("ready", os.environ["JAXCOMM_COORDINATOR"], flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
"""


@pytest.mark.slow
def test_a_local_launch_binds_the_coordinator_to_loopback(tmp_path):
    """JAX binds its coordination service, an unauthenticated key-value
    store, on every interface by default; a local launch needs loopback only."""
    script = _script(tmp_path, "wait.py", WAIT_FOR_STOP)
    stop = tmp_path / "stop"
    command = [sys.executable, "-m", "jaxcomm.launch", "-n", "2", "--devices-per-process", "1"]
    env = dict(os.environ)
    for chosen in ("JAXCOMM_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS"):
        env.pop(chosen, None)
    proc = subprocess.Popen(
        [*command, script, str(stop)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[rank 0] ready "):
                break
        assert lines and lines[-1].startswith("[rank 0] ready 127.0.0.1:"), "".join(lines)
        port = int(lines[-1].rsplit(":", 1)[1])
        listening = {
            address
            for path in ("/proc/net/tcp", "/proc/net/tcp6")
            for address, _, _ in _listening(path, port)
        }
        assert listening == {"127.0.0.1"}, listening
        stop.touch()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_coordinator_binds_no_wider_than_its_address():
    bind = network.resolve_bind_address
    for coordinator in ("127.0.0.1:5", "127.0.0.2:5", "localhost:5", "[::1]:5"):
        assert bind(coordinator, environ={}) == coordinator
    # An address this host does not hold (behind NAT, say): every interface, as JAX does.
    assert bind("192.0.2.250:5", environ={}) == "[::]:5"
    # Given: the argument, then ours, then JAX's variable; the coordinator's port if none.
    assert bind("head:5", "10.0.0.1", environ={}) == "10.0.0.1:5"
    assert bind("head:5", "10.0.0.1:6", environ={}) == "10.0.0.1:6"
    assert bind("head:5", "::", environ={}) == "[::]:5"
    assert bind("head:5", "[fd00::1]", environ={}) == "[fd00::1]:5"
    assert bind("head:5", "head", environ={}) == "head:5"
    env = {"JAXCOMM_COORDINATOR_BIND_ADDRESS": "0.0.0.0", "JAX_COORDINATOR_BIND_ADDRESS": "h:7"}
    assert bind("127.0.0.1:5", "10.0.0.1", environ=env) == "10.0.0.1:5"
    assert bind("127.0.0.1:5", environ=env) == "0.0.0.0:5"
    assert bind("127.0.0.1:5", environ={"JAX_COORDINATOR_BIND_ADDRESS": "h:7"}) == "h:7"
    with pytest.raises(ValueError, match="coordinator_bind_address=''"):
        bind("head:5", "", environ={})


def test_a_host_name_that_resolves_to_loopback_here_binds_everywhere(monkeypatch):
    """Debian's /etc/hosts maps a host's own name to 127.0.1.1, while the other
    hosts resolve it to a network address: loopback would shut them out."""

    def resolve(host, port, *args, **kwargs):
        del port, args, kwargs
        address = {"head": "127.0.1.1", "gone": "192.0.2.250"}[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))]

    monkeypatch.setattr(network.socket, "getaddrinfo", resolve)
    assert network.resolve_bind_address("head:5", environ={}) == "[::]:5"
    assert network.resolve_bind_address("gone:5", environ={}) == "[::]:5"


# The ffi collectives' NCCL ids, shared through the key-value store; a stand-in
# for the CUDA module records what each process registers.
SHARE_NCCL_IDS = """
    import json, secrets
    import jaxcomm.distributed as distributed
    from jaxcomm.collectives import _extension, _peers

    distributed.initialize()
    registered = []

    class Nccl:
        def nccl_unique_id(self):
            return secrets.token_bytes(128)

        def register_unique_id(self, op_id, group, raw):
            registered.append([op_id, group, raw.hex()])

    _extension.cuda_runnable = Nccl
    _peers.share_nccl_ids(7, 2)
    _peers.share_nccl_ids(8, 1)
    print("registered", json.dumps(registered), flush=True)
"""


@pytest.mark.slow
def test_nccl_ids_are_shared_by_process_0(tmp_path):
    script = _script(tmp_path, "nccl.py", SHARE_NCCL_IDS)
    codes = _finish(_start(tmp_path, script))
    registered = []
    for rank in (0, 1):
        output = _log(tmp_path, rank)
        assert codes[rank] == 0, output
        [line] = [line for line in output.splitlines() if line.startswith("registered ")]
        registered.append(json.loads(line.removeprefix("registered ")))
    assert registered[0] == registered[1]
    assert [entry[:2] for entry in registered[0]] == [[7, 0], [7, 1], [8, 0]]
    assert len({entry[2] for entry in registered[0]}) == 3  # a fresh id per group and site
