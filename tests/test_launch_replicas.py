"""``python -m jaxcomm.launch --replicas N``: a lighthouse and N replica groups,
dead groups restarted. Tiny scripts without JAX stand for the groups and the
lighthouse; each writes its pid and environment to a JSON file in tmp_path,
which the tests read back (and use to check, through /proc, that nothing is
left running)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jaxcomm import launch
from jaxcomm import launch_replicas as lr

# What every fake process does first: record who it is, then run its body.
PRELUDE = """\
import json, os, signal, sys, time
from pathlib import Path

out = Path(sys.argv[1])
env = {k: v for k, v in os.environ.items() if k.startswith(("JAXCOMM_", "JAX_", "XLA_"))}
replica = int(os.environ["JAXCOMM_FT_REPLICA_ID"])
incarnation = int(os.environ["JAXCOMM_FT_INCARNATION"])
rank = int(os.environ.get("JAXCOMM_PROCESS_ID", "0"))
tag = f"r{replica}-i{incarnation}-p{rank}"
(out / f"{tag}.tmp").write_text(json.dumps({"pid": os.getpid(), "env": env}))
(out / f"{tag}.tmp").rename(out / f"{tag}.json")

def wait_for(name, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not (out / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{name} never came")
        time.sleep(0.02)
"""

# The lighthouse: records itself as lighthouse-<n>.json; the first one exits
# at once when the file exit-first exists; otherwise it sleeps until stopped.
FAKE_LIGHTHOUSE = """\
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
n = len(list(out.glob("lighthouse-*.json")))
env = {k: v for k, v in os.environ.items() if k.startswith("JAXCOMM_")}
(out / "lighthouse.tmp").write_text(json.dumps({"pid": os.getpid(), "env": env}))
(out / "lighthouse.tmp").rename(out / f"lighthouse-{n}.json")
print(f"lighthouse {n} up", flush=True)
if n == 0 and (out / "exit-first").exists():
    sys.exit(1)
time.sleep(60)
"""

TIMEOUT_S = 20  # per launcher run; a hung run is stopped by SIGTERM


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead


def _records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


@pytest.fixture
def run(tmp_path, capfd):
    """Runs launch_replicas on a script body with the fake lighthouse; returns
    (exit code, stdout, stderr, records). Kills whatever a failed test left."""
    fake = tmp_path / "lighthouse.py"
    fake.write_text(FAKE_LIGHTHOUSE)
    out = tmp_path / "out"
    out.mkdir()

    def go(body: str, replicas: int, **kwargs):
        script = tmp_path / "replica.py"
        script.write_text(PRELUDE + textwrap.dedent(body))
        kwargs = {"restart_delay": 0.05, "grace_period": 1.0, **kwargs}
        # The bound on every run: SIGTERM makes the launcher stop and return 143.
        watchdog = threading.Timer(TIMEOUT_S, os.kill, (os.getpid(), signal.SIGTERM))
        watchdog.start()
        try:
            code = lr.launch_replicas(
                [sys.executable, str(script), str(out)],
                replicas,
                lighthouse_command=[sys.executable, str(fake), str(out)],
                **kwargs,
            )
        finally:
            watchdog.cancel()
        stdout, stderr = capfd.readouterr()
        return code, stdout, stderr, _records(out)

    try:
        yield go
    finally:
        for record in _records(out).values():
            if _alive(record["pid"]):
                os.kill(record["pid"], signal.SIGKILL)


def _assert_all_dead(records: dict[str, dict]):
    alive = {name: r["pid"] for name, r in records.items() if _alive(r["pid"])}
    assert not alive, f"left running: {alive}"


def test_env_of_every_group_and_lighthouse_stopped_at_the_end(run, monkeypatch):
    # An outer job's variables must not reach a one-process group.
    monkeypatch.setenv("JAXCOMM_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    # The launcher's own environment does (a fault plan, say).
    monkeypatch.setenv("JAXCOMM_FT_FAULTS", "/plans/p.json")
    code, stdout, _, records = run(
        'print(f"hello from {replica}", flush=True)\n',
        3,
        job_id="job-abc",
        devices_per_process=2,
    )
    assert code == 0
    assert set(records) == {"lighthouse-0", "r0-i0-p0", "r1-i0-p0", "r2-i0-p0"}
    address = records["lighthouse-0"]["env"]["JAXCOMM_FT_LIGHTHOUSE"]
    host, port = address.split(":")
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    assert records["lighthouse-0"]["env"]["JAXCOMM_FT_JOB_ID"] == "job-abc"
    for replica in range(3):
        env = records[f"r{replica}-i0-p0"]["env"]
        assert env["JAXCOMM_FT_LIGHTHOUSE"] == address
        assert env["JAXCOMM_FT_JOB_ID"] == "job-abc"
        assert env["JAXCOMM_FT_REPLICA_ID"] == str(replica)
        assert env["JAXCOMM_FT_REPLICAS"] == "3"
        assert env["JAXCOMM_FT_INCARNATION"] == "0"
        assert env["JAXCOMM_FT_FAULTS"] == "/plans/p.json"
        assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"].split()
        assert not {"JAXCOMM_COORDINATOR", "JAXCOMM_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"} & set(
            env
        )
        assert f"[replica {replica}] hello from {replica}\n" in stdout
    assert "[lighthouse] lighthouse 0 up\n" in stdout
    _assert_all_dead(records)


def test_random_job_id_and_free_port_when_not_given(run):
    code, _, _, records = run("", 2)
    assert code == 0
    envs = [r["env"] for r in records.values()]
    assert len({e["JAXCOMM_FT_JOB_ID"] for e in envs}) == 1
    assert len({e["JAXCOMM_FT_LIGHTHOUSE"] for e in envs}) == 1
    assert len(envs[0]["JAXCOMM_FT_JOB_ID"]) == 16


def test_group_that_exits_1_is_restarted_once(run):
    body = """
    print(f"incarnation {incarnation}", flush=True)
    if replica == 1 and incarnation == 0:
        sys.exit(1)
    """
    code, stdout, stderr, records = run(body, 2)
    assert code == 0
    assert set(records) == {"lighthouse-0", "r0-i0-p0", "r1-i0-p0", "r1-i1-p0"}
    assert records["r1-i1-p0"]["env"]["JAXCOMM_FT_INCARNATION"] == "1"
    assert (
        "jaxcomm.launch: replica 1 exited with code 1; restarting replica 1 as "
        "incarnation 1 in 0.05 s (restart 1 of 3)\n"
    ) in stderr
    assert "[replica 1] incarnation 0\n" in stdout
    assert "[replica 1] incarnation 1\n" in stdout
    # A finished group is not restarted; the lighthouse ran once throughout.
    _assert_all_dead(records)


def test_what_a_dead_process_started_dies_with_it(run, tmp_path):
    # Incarnation 0 leaves a child behind (its own, in the group's session) and fails.
    body = """
    import subprocess
    if incarnation == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (out / "child.tmp").write_text(json.dumps({"pid": child.pid}))
        (out / "child.tmp").rename(out / "child.json")
        sys.exit(1)
    """
    code, _, _, records = run(body, 1)
    assert code == 0
    assert {"child", "r0-i0-p0", "r0-i1-p0"} <= set(records)
    _assert_all_dead(records)


def test_group_killed_by_sigkill_is_restarted(run):
    body = """
    if incarnation == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    """
    code, _, stderr, records = run(body, 1)
    assert code == 0
    assert {"r0-i0-p0", "r0-i1-p0"} <= set(records)
    assert "r0-i2-p0" not in records
    assert "replica 0 was killed by SIGKILL; restarting replica 0 as incarnation 1" in stderr


def test_group_out_of_restarts_fails_the_job_and_stops_everything(run):
    # Replica 1 sleeps and ignores SIGTERM, as JAX does; replica 0 always fails.
    body = """
    if replica == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    wait_for("r1-i0-p0.json")
    sys.exit(3)
    """
    start = time.monotonic()
    code, _, stderr, records = run(body, 2, max_restarts=2)
    assert code == 3
    assert time.monotonic() - start < 10
    assert {"r0-i0-p0", "r0-i1-p0", "r0-i2-p0", "r1-i0-p0", "lighthouse-0"} == set(records)
    assert "replica 0 exited with code 3; restarting replica 0 as incarnation 2" in stderr
    assert "replica 0 exited with code 3; no restarts left (2 used); stopping everything" in stderr
    assert stderr.splitlines()[-1] == "jaxcomm.launch: exit code 3: replica 0 failed 3 times"
    _assert_all_dead(records)


def test_no_restarts_returns_the_signal_code(run):
    code, _, stderr, records = run("os.kill(os.getpid(), signal.SIGKILL)\n", 1, max_restarts=0)
    assert code == 128 + signal.SIGKILL
    assert "replica 0 was killed by SIGKILL; no restarts left (0 used)" in stderr
    assert set(records) == {"r0-i0-p0", "lighthouse-0"}
    _assert_all_dead(records)


def test_lighthouse_that_exits_is_restarted_on_the_same_port(run, tmp_path):
    (tmp_path / "out" / "exit-first").touch()
    port = launch.free_port()
    # The group lives until the second lighthouse is up.
    code, stdout, stderr, records = run(
        'wait_for("lighthouse-1.json")\n', 1, lighthouse_port=port, job_id="j1"
    )
    assert code == 0
    first, second = records["lighthouse-0"], records["lighthouse-1"]
    assert first["pid"] != second["pid"]
    for record in (first, second, records["r0-i0-p0"]):
        assert record["env"]["JAXCOMM_FT_LIGHTHOUSE"] == f"127.0.0.1:{port}"
        assert record["env"]["JAXCOMM_FT_JOB_ID"] == "j1"
    assert (
        f"jaxcomm.launch: the lighthouse exited with code 1; restarting it on "
        f"127.0.0.1:{port} in 0.05 s\n"
    ) in stderr
    assert "[lighthouse] lighthouse 1 up\n" in stdout
    assert "r0-i1-p0" not in records  # the group did not notice
    _assert_all_dead(records)


def test_two_processes_per_group_get_their_own_job_and_restart_together(run):
    # Replica 0's rank 1 kills itself on incarnation 0 while rank 0 sleeps.
    body = """
    if replica == 0 and incarnation == 0:
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)
        wait_for("r0-i0-p0.json")
        os.kill(os.getpid(), signal.SIGKILL)
    print("done", flush=True)
    """
    code, stdout, stderr, records = run(body, 2, processes_per_replica=2, devices_per_process=1)
    assert code == 0
    runs = [(0, 0), (0, 1), (1, 0)]
    assert {f"r{r}-i{i}-p{p}" for r, i in runs for p in (0, 1)} | {"lighthouse-0"} == set(records)
    ports = {}
    for r, i in runs:
        addresses = set()
        for p in (0, 1):
            env = records[f"r{r}-i{i}-p{p}"]["env"]
            assert env["JAXCOMM_NUM_PROCESSES"] == "2"
            assert env["JAXCOMM_PROCESS_ID"] == str(p)
            assert env["JAXCOMM_FT_REPLICA_ID"] == str(r)
            assert env["JAXCOMM_FT_INCARNATION"] == str(i)
            assert "JAX_COORDINATOR_ADDRESS" not in env
            assert "--xla_force_host_platform_device_count=1" in env["XLA_FLAGS"].split()
            addresses.add(env["JAXCOMM_COORDINATOR"])
        (address,) = addresses  # one coordinator per group
        assert address.startswith("127.0.0.1:")
        ports[r, i] = address
    lighthouse = records["lighthouse-0"]["env"]["JAXCOMM_FT_LIGHTHOUSE"]
    assert len(set(ports.values()) | {lighthouse}) == 4  # fresh per group and incarnation
    assert (
        "replica 0 rank 1 was killed by SIGKILL; stopping ranks [0]; restarting replica 0 "
        "as incarnation 1"
    ) in stderr
    assert "[replica 0 rank 1] done\n" in stdout
    assert "[replica 1 rank 0] done\n" in stdout
    _assert_all_dead(records)


def test_sigterm_to_the_launcher_stops_everything(run, tmp_path):
    out = tmp_path / "out"

    def terminate_once_up():
        deadline = time.monotonic() + 10
        names = ["r0-i0-p0.json", "r1-i0-p0.json", "lighthouse-0.json"]
        while not all((out / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    # Replica 0 ignores SIGTERM: it needs the SIGKILL after the grace period.
    body = """
    if replica == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    """
    threading.Thread(target=terminate_once_up, daemon=True).start()
    start = time.monotonic()
    code, _, stderr, records = run(body, 2, grace_period=0.5)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - start < 10
    assert "got SIGTERM; stopping the lighthouse and 2 replica groups" in stderr
    assert set(records) == {"r0-i0-p0", "r1-i0-p0", "lighthouse-0"}
    _assert_all_dead(records)


def test_default_lighthouse_command():
    assert lr.default_lighthouse_command(4321, "abc", 4) == [
        sys.executable,
        *("-m", "jaxcomm.ft.lighthouse"),
        *("--host", "127.0.0.1", "--port", "4321", "--job-id", "abc", "--replicas", "4"),
    ]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"replicas": 0}, "replicas"),
        ({"processes_per_replica": 0}, "processes_per_replica"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"restart_delay": -1.0}, "restart_delay"),
        ({"lighthouse_port": 70000}, "lighthouse_port"),
    ],
)
def test_bad_arguments_raise_before_starting_anything(kwargs, name):
    kwargs = {"replicas": 1, **kwargs}
    replicas = kwargs.pop("replicas")
    with pytest.raises(ValueError, match=name):
        lr.launch_replicas(["/nonexistent"], replicas, **kwargs)


def test_cli_replicas_without_n():
    args = launch._parse(["--replicas", "2", "train.py", "--lr", "1"])
    assert (args.replicas, args.num_processes, args.script, args.args) == (
        2,
        1,
        "train.py",
        ["--lr", "1"],
    )
    plain = launch._parse(["-n", "2", "train.py"])  # as before
    assert (plain.replicas, plain.num_processes) == (None, 2)


def test_cli_passes_its_options_on(monkeypatch):
    calls = []
    monkeypatch.setattr(lr, "launch_replicas", lambda *a, **k: calls.append((a, k)) or 7)
    argv = ["--replicas", "3", "-n", "2", "--max-restarts", "5", "--restart-delay", "0.5"]
    argv += ["--lighthouse-port", "1234", "--job-id", "j", "--devices-per-process", "2"]
    assert launch.main([*argv, "--grace-period", "2", "train.py", "x"]) == 7
    assert launch.main(["--replicas", "1", "train.py"]) == 7
    assert calls == [
        (
            ([sys.executable, "train.py", "x"], 3),
            dict(
                processes_per_replica=2,
                devices_per_process=2,
                grace_period=2.0,
                show_gloo=False,
                max_restarts=5,
                restart_delay=0.5,
                lighthouse_port=1234,
                job_id="j",
            ),
        ),
        (
            ([sys.executable, "train.py"], 1),
            dict(
                processes_per_replica=1, devices_per_process=None, grace_period=5.0, show_gloo=False
            ),
        ),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replicas", "0", "t.py"], "--replicas 0: need at least 1"),
        (["--replicas", "2", "--max-restarts", "-1", "t.py"], "--max-restarts -1: must not be"),
        (["--replicas", "2", "--restart-delay", "-1", "t.py"], "--restart-delay -1.0: must not be"),
        (["--replicas", "2", "-n", "0", "t.py"], "-n 0: need at least 1"),
        (["--replicas", "2", "--lighthouse-port", "0", "t.py"], "--lighthouse-port 0"),
        (["--replicas", "2", "--one-gpu-each", "t.py"], "--one-gpu-each does not work"),
        (["-n", "2", "--max-restarts", "1", "t.py"], "--max-restarts needs --replicas"),
        (["t.py"], "the following arguments are required: -n/--num-processes"),
    ],
)
def test_cli_rejects_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch._parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
