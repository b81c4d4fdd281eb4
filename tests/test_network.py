"""bench/network.py: processes on shaped links in private namespaces, and their teardown.

Each test runs the benchmark's quick mode (2 hosts, 1 CPU device each, small
messages) as a subprocess and looks at the machine from outside: while it
runs its hosts sit in network namespaces of their own; afterwards no process,
network namespace, mount namespace or qdisc of it is left, whether it ended
normally, by a failing host, or by SIGINT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "network.py"
sys.path.insert(0, str(REPO / "bench"))

import netbed  # noqa: E402
import network_worker  # noqa: E402

pytestmark = pytest.mark.network

_REASON = netbed.check_can_isolate()
needs_namespaces = pytest.mark.skipif(
    _REASON is not None, reason=f"cannot make network namespaces: {_REASON}"
)
# Marks the processes of one test's run, found in /proc by their command line.
WORKER = "network_worker.py"


def _command(*args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--quick", "--timeout", "150", *args]


def _run_quick(tmp_path, *args: str):
    """Runs the quick mode with ``args``; the finished process and its JSON rows."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        _command(*args, "--json", str(out)), capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())


def _pids_running(text: str) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.add(int(entry))
        except OSError:
            continue
    return pids


def _namespaces(kind: str) -> set[str]:
    """The ``kind`` namespaces (``net``, ``mnt``, ``pid``) some process is in."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.readlink(f"/proc/{entry}/ns/{kind}"))
            except OSError:
                continue
    return found


def _qdiscs() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def _snapshot() -> dict:
    return {
        "net": _namespaces("net"),
        "mnt": _namespaces("mnt"),
        "pid": _namespaces("pid"),
        "netns": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "qdiscs": _qdiscs(),
        "links": subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout,
    }


def _assert_torn_down(before: dict, timeout: float = 20.0):
    """Nothing the run made is left: processes, namespaces, links, qdiscs."""
    deadline = time.monotonic() + timeout
    while True:
        left = {
            "processes": _pids_running(WORKER) | _pids_running(str(SCRIPT)),
            **{kind: _namespaces(kind) - before[kind] for kind in ("net", "mnt", "pid")},
        }
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(left.values()), f"left behind: {left}"
    after = _snapshot()
    assert after["netns"] == before["netns"]
    assert after["qdiscs"] == before["qdiscs"]
    assert "tbf" not in after["qdiscs"]
    assert after["links"].count("jcveth") == before["links"].count("jcveth") == 0


@pytest.mark.slow
@needs_namespaces
def test_quick_allreduce_runs_and_leaves_nothing(tmp_path):
    before = _snapshot()
    done, rows = _run_quick(tmp_path)
    link = [r for r in rows if r.get("config") == "link"]
    # tbf shapes the wire bytes, so the stream never beats the rate; TCP/IP
    # headers take ~4% of a 1500-byte MTU, and on a loaded machine the
    # stream's CPU work takes more (0.84 seen with 2 cores shared by 20 jobs).
    assert len(link) == 1 and 0.5 < link[0]["link_fraction"] < 1.02, link
    timed = [r for r in rows if "time_s" in r]
    paths = {(r["path"], r["wire"]) for r in timed}
    assert paths == {(p, w) for p in ("auto", "ring") for w in ("float32", "float16")}
    burst = netbed.tbf_burst(10**9)
    for r in timed:
        assert r["rate_bps"] == 10**9 and r["hosts"] == 2
        assert r["busbw_Bps"] == pytest.approx(2 * (2 - 1) / 2 * r["bytes"] / r["time_s"])
        # The link is the limit: an allreduce sends at least 2(N-1)/N of the
        # message from each host, in the wire's width, and tbf passes only its
        # burst faster than the rate (a 0.25 MiB float16 message nearly fits in it).
        sent = 2 * (2 - 1) / 2 * r["bytes"] * (0.5 if r["wire"] == "float16" else 1.0)
        assert r["time_s"] > (sent - burst) * 8 / 10**9, r
    assert "ring" in done.stdout and "link %" in done.stdout
    _assert_torn_down(before)


@pytest.mark.slow
@needs_namespaces
def test_narrow_wire_allreduce_across_processes_matches_float64(tmp_path):
    _, found = _run_quick(
        tmp_path,
        "--workload",
        "check",
        "--paths",
        "auto,ring",
        "--wires",
        "float32,float16,bfloat16",
    )
    rows = {(r["path"], r["wire"]): r for r in found if "path" in r}
    assert len(rows) == 6
    for key, row in rows.items():
        # Bound: (ranks + 1) half-ulps of the wire dtype times sum_d |x_d|, per
        # element (network_worker.error_bound).
        assert row["max_error_over_bound"] <= 1.0, (key, row)
    for path in ("auto", "ring"):
        # The values did travel narrow: float16 loses more than float32.
        assert rows[path, "float16"]["max_abs_error"] > 10 * rows[path, "float32"]["max_abs_error"]


@pytest.mark.slow
@needs_namespaces
def test_overlap_workload_times_each_program(tmp_path):
    done, found = _run_quick(tmp_path, "--workload", "overlap", "--sizes-mib", "1")
    (row,) = [r for r in found if "both_s" in r]
    assert row["hosts"] == 2 and row["devices"] == 2 and row["bytes"] == 2**20
    assert min(row["compute_s"], row["allreduce_s"], row["both_s"]) > 0
    saved = row["compute_s"] + row["allreduce_s"] - row["both_s"]
    assert row["overlap"] == pytest.approx(saved / min(row["compute_s"], row["allreduce_s"]))
    assert "allreduce s" in done.stdout


def test_time_to_accuracy_counts_the_steps_to_the_first_reach():
    # Held-out accuracy before training, then after each of 4 steps: the
    # target is first reached after step 2 (a later dip does not undo it).
    got = network_worker.to_accuracy([0.1, 0.6, 0.92, 0.85, 0.97], 0.9, step_s=2.5)
    assert got == {
        "target_acc": 0.9,
        "acc_first": 0.1,
        "acc_last": 0.97,
        "steps_to_acc": 2,
        "time_to_acc_s": 5.0,
    }
    assert network_worker.to_accuracy([0.95], 0.9, step_s=2.5)["time_to_acc_s"] == 0
    never = network_worker.to_accuracy([0.1, 0.5, 0.89], 0.9, step_s=2.5)
    assert never["steps_to_acc"] is None and never["time_to_acc_s"] is None


@pytest.mark.slow
@needs_namespaces
def test_train_workload_reaches_the_target_accuracy(tmp_path):
    """A small MLP on 2 hosts: dense starts at chance and reaches 90% held-out
    accuracy within 10 steps; the row's time to it is those steps at the
    median step time; the run without exchange reports no accuracy."""
    done, found = _run_quick(
        tmp_path, "--workload", "train", "--configs", "dense,compute", "--steps", "10"
    )
    rows = {r["config"]: r for r in found if "step_s" in r}
    dense = rows["dense"]
    assert dense["target_acc"] == 0.9
    assert dense["acc_first"] < 0.5 and dense["acc_last"] >= 0.9
    assert 0 < dense["steps_to_acc"] <= 10
    assert dense["time_to_acc_s"] == pytest.approx(dense["steps_to_acc"] * dense["step_s"])
    assert "acc_last" not in rows["compute"] and "time_to_acc_s" not in rows["compute"]
    assert "time to acc s" in done.stdout
    # What the compiled pmean sends: every param's float32 bytes, 2(N-1)/N of
    # them on a ring of N = 2 hosts, in at least one all-reduce.
    assert dense["bytes_sent"] == pytest.approx(4 * dense["params"])
    assert dense["collectives"] >= 1 and dense["collective_latency_s"] > 0
    assert "where the step goes" in done.stdout


@pytest.mark.slow
@needs_namespaces
def test_a_failing_host_stops_the_run_and_leaves_nothing():
    before = _snapshot()
    done = subprocess.run(_command("--fail-rank", "1"), capture_output=True, text=True, timeout=200)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "rank 1 exited with code 3" in done.stderr
    _assert_torn_down(before)


@pytest.mark.slow
@needs_namespaces
def test_sigint_stops_the_run_and_leaves_nothing():
    before = _snapshot()
    proc = subprocess.Popen(
        _command("--workload", "train"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_pids_running(WORKER)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _pids_running(WORKER)
        assert len(workers) >= 2, "the hosts never started"
        # They run in network namespaces of their own, not ours.
        host_nets = {os.readlink(f"/proc/{pid}/ns/net") for pid in workers}
        assert len(host_nets) >= 2 and not host_nets & before["net"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    _assert_torn_down(before)


@pytest.mark.slow
def test_says_why_and_fails_without_root():
    setpriv = "/usr/bin/setpriv"
    if os.geteuid() != 0 or not os.path.exists(setpriv):
        pytest.skip("needs root and setpriv to run as another user")
    with tempfile.TemporaryDirectory() as tmp:
        script = _readable_copy_of_bench(Path(tmp)) / SCRIPT.name
        command = [sys.executable, str(script), "--quick", "--timeout", "150"]
        done = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
    if done.returncode in (126, 127):
        pytest.skip(f"this Python cannot run as nobody: {done.stderr.strip()}")
    assert done.returncode == 2
    assert "cannot make network namespaces here" in done.stderr
    assert "root" in done.stderr


def _readable_copy_of_bench(tmp: Path) -> Path:
    """bench/'s scripts copied under `tmp`, where any user can read them.

    nobody cannot open the checkout's own bench/network.py where the
    checkout lies under a directory only root may enter (a clone in
    ``mktemp -d``). What runs before the root check is bench/ alone, so a
    copy says the same.
    """
    tmp.chmod(0o755)
    bench = tmp / "bench"
    bench.mkdir(mode=0o755)
    for source in (REPO / "bench").glob("*.py"):
        target = bench / source.name
        shutil.copyfile(source, target)
        target.chmod(0o644)
    return bench


TTQ_SCRIPT = REPO / "bench" / "time_to_quality.py"


def test_sync_and_local_steps_are_split_by_the_bytes_sent():
    """DiLoCo's sync steps (bytes sent) and local ones (none), each their
    median; a run of one kind only has neither."""
    import quality_worker

    got = quality_worker.sync_and_local_steps([0.1, 0.9, 0.3, 0.5, 0.2], [0, 4, 0, 4, 0])
    assert got["sync_step_s"] == pytest.approx(0.7)
    assert got["local_step_s"] == pytest.approx(0.2)
    assert got["mean_step_s"] == pytest.approx(0.4)
    dense = quality_worker.sync_and_local_steps([0.1, 0.3], [4, 4])
    assert dense["sync_step_s"] is None and dense["local_step_s"] is None


@pytest.mark.slow
@needs_namespaces
def test_time_to_quality_table_agrees_with_its_rows(tmp_path):
    """A tiny run (2 hosts, 6 steps of the digits MLP, dense and bf16): the
    table's bytes, final quality and time to dense's final quality are the
    JSON rows', and the bytes are the ring's closed form."""
    before = _snapshot()
    out, png = tmp_path / "ttq.json", tmp_path / "ttq.png"
    done = subprocess.run(
        [
            sys.executable, str(TTQ_SCRIPT), "--model", "digits", "--width", "64",
            "--hosts", "2", "--rate", "1gbit", "--configs", "dense,bf16", "--steps", "6",
            "--eval-every", "2", "--timeout", "150", "--json", str(out), "--png", str(png),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    evals = {
        c: [r for r in rows if r.get("config") == c and not r.get("summary")]
        for c in ("dense", "bf16")
    }
    summary = {r["config"]: r for r in rows if r.get("summary")}
    assert set(summary) == {"dense", "bf16"}
    params = summary["dense"]["params"]
    assert params == 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    # A ring over 2 hosts sends 2(N-1)/N = 1 x the payload: float32, then bfloat16.
    assert summary["dense"]["bytes_per_step"] == pytest.approx(4 * params)
    assert summary["bf16"]["bytes_per_step"] == pytest.approx(2 * params)
    target = summary["dense"]["quality"]
    for config, points in evals.items():
        assert [r["step"] for r in points] == [0, 2, 4, 6]
        walls = [r["wall_s"] for r in points]
        assert walls[0] == 0 and all(b > a for a, b in zip(walls, walls[1:], strict=False))
        assert points[-1]["quality"] == summary[config]["quality"]
        assert points[-1]["wall_s"] == summary[config]["wall_s"]
        first = next((r["wall_s"] for r in points if r["quality"] >= target), None)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith(config + " "))
        cells = line.split()
        assert float(cells[1].replace(",", "")) == pytest.approx(
            summary[config]["bytes_per_step"], abs=0.5
        )
        assert float(cells[2]) == pytest.approx(summary[config]["step_s"], abs=5e-4)
        assert float(cells[3]) == pytest.approx(summary[config]["mean_step_s"], abs=5e-4)
        assert cells[4] == "6"  # steps run; no early stop asked for
        assert float(cells[5]) == pytest.approx(summary[config]["quality"], abs=5e-5)
        assert cells[7] == "-"  # not a DiLoCo variant: nothing to set against plain DiLoCo
        if first is None:
            assert "not reached" in line
        else:
            assert float(cells[9]) == pytest.approx(first, abs=0.05)
            base = next(r["wall_s"] for r in evals["dense"] if r["quality"] >= target)
            assert float(cells[10].rstrip("x")) == pytest.approx(base / first, rel=0.01, abs=0.006)
    assert png.stat().st_size > 0
    _assert_torn_down(before)
    assert not _pids_running("quality_worker.py") | _pids_running(str(TTQ_SCRIPT))


def test_quality_worker_reads_configuration_names():
    """The configurations' names, old and variant, give the options they
    spell; the old names keep the options they had before variants existed."""
    import quality_worker as qw

    assert qw.parse_config("powersgd_r4") == qw.PowerSGDConfig(4, True, 0)
    assert qw.parse_config("powersgd_r1_noef") == qw.PowerSGDConfig(1, False, 0)
    assert qw.parse_config("powersgd_r4_warm50") == qw.PowerSGDConfig(4, True, 50)
    assert qw.parse_config("powersgd_r8_noef_warm20") == qw.PowerSGDConfig(8, False, 20)
    assert qw.parse_config("powersgd_r4_warm50_denseemb") == qw.PowerSGDConfig(4, True, 50, True)
    assert qw.parse_config("diloco_h10") == qw.DiLoCoConfig(10, 1, 0.7, 0.9)
    assert qw.parse_config("streaming_diloco_h50_f5") == qw.DiLoCoConfig(50, 5, 0.7, 0.9)
    assert qw.parse_config("diloco_h50_olr1.0_om0") == qw.DiLoCoConfig(50, 1, 1.0, 0.0)
    assert qw.parse_config("diloco_h50_om0.8") == qw.DiLoCoConfig(50, 1, 0.7, 0.8)
    for name in ("dense", "bf16_ef", "chunk_sparse"):
        assert qw.parse_config(name) == name
    for name in qw.CONFIGS:
        qw.parse_config(name)  # every default configuration is read
    for bad in ("powersgd_r4_warm", "powersgd", "powersgd_r4_denseemb_warm50", "diloco_h50_olr",
                "diloco_h50_om0.8_olr1", "x", "diloco_h50_wint2", "diloco_h50_ffi_d5",
                "diloco_h50_a0.5_d5", "sparseloco", "sparseloco_h50_b2_k3", "sparseloco_h50_wint8",
                "local_h50"):  # fmt: skip
        with pytest.raises(ValueError, match="unknown configuration"):
            qw.parse_config(bad)


def test_quality_worker_reads_diloco_and_sparseloco_variants():
    """Delay, mixing, the wire and the ffi backend of DiLoCo, SparseLoCo's
    density (in percent) and value bits: each name gives the options it
    spells and the defaults for the rest."""
    import quality_worker as qw

    got = qw.parse_config("diloco_h50_d5_a0.5")
    assert got == qw.DiLoCoConfig(50, 1, 0.7, 0.9, delay=5, mixing=0.5, wire=None, backend="xla")
    assert qw.parse_config("diloco_h50_wint8").wire == "int8"
    assert qw.parse_config("diloco_h50_wint4").wire == "int4"
    assert qw.parse_config("diloco_h50_wbf16").wire == "bfloat16"
    assert qw.parse_config("diloco_h50_wfp8").wire == "float8_e4m3fn"
    got = qw.parse_config("streaming_diloco_h50_f5_olr1.0_om0_d3_a0.25_wfp16_ffi")
    assert got == qw.DiLoCoConfig(50, 5, 1.0, 0.0, 3, 0.25, "float16", "ffi")
    assert qw.parse_config("diloco_h50_ffi").backend == "ffi"
    assert qw.parse_config("diloco_h50_ffi")[:6] == qw.parse_config("diloco_h50")[:6]
    assert qw.parse_config("sparseloco_h50") == qw.SparseLoCoConfig(50, 0.02, 2, 0, 0.0, "xla")
    assert qw.parse_config("sparseloco_h10_k3_b4") == qw.SparseLoCoConfig(10, 0.03, 4)
    assert qw.parse_config("sparseloco_h50_k0.5").density == pytest.approx(0.005)
    assert qw.parse_config("sparseloco_h50_d5_a0.5_ffi") == qw.SparseLoCoConfig(
        50, 0.02, 2, 5, 0.5, "ffi"
    )
    assert qw.parse_config("local") == "local"
    for name in ("diloco_h50_d5_a0.5", "diloco_h50_wint4", "sparseloco_h50_k2", "local"):
        assert qw.config_name(name) == name  # the worker's --config takes them
    # The wires are the names jaxcomm.diloco's wire_dtype takes.
    assert set(qw.WIRES.values()) == {
        "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "int4"
    }  # fmt: skip


def test_quality_worker_builds_the_variants_it_names():
    """make_optimizer passes each option through: the DiLoCo state of a
    delayed variant holds a pending average, SparseLoCo's an error buffer,
    and the compute-only configuration never syncs within its steps."""
    import jax
    import jax.numpy as jnp
    import optax
    import quality_worker as qw

    import jaxcomm

    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,))}
    mesh = jax.make_mesh((2,), (qw.AXIS,))
    with jax.set_mesh(mesh):
        states = {
            name: jax.eval_shape(qw.make_optimizer(name, optax.adamw(1e-3), 30)[0].init, params)
            for name in ("diloco_h10", "diloco_h10_d3_a0.5", "sparseloco_h10", "local")
        }
    assert states["diloco_h10"].pending == ()
    assert len(states["diloco_h10_d3_a0.5"].pending) == 1  # one fragment's pending average
    assert jax.tree.leaves(states["sparseloco_h10"].error)  # the error-feedback buffer
    for name in ("diloco_h10", "sparseloco_h10", "local"):
        assert qw.make_optimizer(name, optax.adamw(1e-3), 30)[1]  # gradients at local params
    del jaxcomm


def test_time_to_quality_projects_dense_and_sets_variants_against_plain_diloco():
    """A short dense run at one rate and a full one at another: the
    projection takes the full run's losses at the short run's wall time per
    step, is marked projected, and is the target; a variant is set against
    plain DiLoCo at the last step both evaluated; an early stop shows."""
    import time_to_quality as ttq

    def run(config, rate, steps, losses, per_step, **extra):
        common = {"rate_bps": rate, "config": config, "model": "lm", "steps": steps,
                  "params": 10, "quality_name": "val_loss", "higher_is_better": False}  # fmt: skip
        points = [
            {**common, "step": t, "wall_s": t * per_step, "quality": q} for t, q in losses.items()
        ]
        last = max(losses)
        summary = {**common, "summary": True, "wall_s": last * per_step, "steps_run": last,
                   "quality": losses[last], "step_s": per_step, "mean_step_s": per_step,
                   "bytes_per_step": 1.0, "compile_s": 1.0, **extra}  # fmt: skip
        return [*points, summary]

    fast, slow = 100e6, 10e6
    reference = run("dense", fast, 40, {0: 5.0, 20: 3.0, 40: 2.0}, 1.0)
    rows = [
        *run("dense", slow, 20, {0: 5.0, 20: 3.0}, 7.0),
        *run("diloco_h10", slow, 80, {0: 5.0, 20: 3.5, 40: 2.5, 60: 2.2, 80: 1.95}, 0.5),
        *run("diloco_h10_wint4", slow, 80, {0: 5.0, 20: 3.6, 40: 2.75, 60: 1.9}, 0.5,
             stopped_early=True),
    ]  # fmt: skip
    projected = ttq.project_dense(rows, reference, "ref.json")
    assert projected and all(r["projected"] and r["rate_bps"] == slow for r in projected)
    summary = next(r for r in projected if r.get("summary"))
    assert summary["wall_s"] == pytest.approx(40 * 7.0) and summary["quality"] == 2.0
    assert [r["wall_s"] for r in projected if not r.get("summary")] == [0.0, 140.0, 280.0]
    assert ttq.project_dense(rows + projected, reference) == []  # once per rate
    table = {s["config"]: s for s in ttq.summarize(rows + projected)}
    assert set(table) == {"dense, 20 steps", "dense (projected)", "diloco_h10, 80 steps",
                          "diloco_h10_wint4, 80 steps"}  # fmt: skip
    assert table["dense (projected)"]["projected"]
    assert table["dense (projected)"]["time_to_target_s"] == pytest.approx(280.0)
    plain, wint4 = table["diloco_h10, 80 steps"], table["diloco_h10_wint4, 80 steps"]
    assert plain["target"] == 2.0 and plain["time_to_target_s"] == pytest.approx(40.0)
    assert plain["speedup"] == pytest.approx(280.0 / 40.0)
    assert wint4["time_to_target_s"] == pytest.approx(30.0) and wint4["stopped_early"]
    assert wint4["steps_run"] == 60
    assert wint4["vs_plain_diloco_step"] == 60
    assert wint4["vs_plain_diloco"] == pytest.approx(1.9 / 2.2 - 1)
    assert plain["vs_plain_diloco"] == 0.0
    assert table["dense, 20 steps"]["time_to_target_s"] is None
    text = ttq.format_table(ttq.summarize(rows + projected), rows + projected)
    assert "PROJECTED" in text and "280.0p" in text and "60*" in text
    # With a compute-only run, each time to target against the physical
    # limit: dense's 40 steps to 2.0 at local's 0.25 s a step.
    local = run("local", slow, 80, {0: 5.0, 80: 5.0}, 0.25)
    table = {s["config"]: s for s in ttq.summarize(rows + projected + local)}
    assert table["diloco_h10, 80 steps"]["limit_s"] == pytest.approx(10.0)
    assert table["diloco_h10, 80 steps"]["of_limit"] == pytest.approx(10.0 / 40.0)
    assert table["dense (projected)"]["of_limit"] == pytest.approx(10.0 / 280.0)
    assert table["dense, 20 steps"]["of_limit"] is None  # never reached it
    text = ttq.format_table(ttq.summarize(rows + projected + local), rows + projected + local)
    assert "of limit" in text and "25%p" in text
    # What jaxcomm.costmodel.recommend takes: each known configuration's
    # steps to dense's final quality, from runs that were not projected.
    assert ttq.recommend_lines(ttq.summarize(rows + projected)) == []  # dense never got there
    fast_runs = [*reference, *run("bf16", fast, 40, {0: 5.0, 20: 1.99, 40: 1.9}, 0.6),
                 *run("diloco_h10_wint4", fast, 40, {0: 5.0, 40: 1.5}, 0.5)]  # fmt: skip
    (line,) = ttq.recommend_lines(ttq.summarize(fast_runs))
    assert line.endswith("steps_to_target={'dense': 40, 'bf16': 20}"), line
