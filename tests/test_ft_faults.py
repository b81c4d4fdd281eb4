"""The fault-injection harness (bench/faults.py) and the injector it drives (jaxcomm.ft.faults).

Fast: the injector, the scheduler and the analysis on hand-worked logs.
Slow: the harness's quick form end to end, processes really killed, stopped
and slowed under ``python -m jaxcomm.launch --replicas 3`` (DiLoCo, then
per-step bfloat16 data parallelism).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import bench_modules
import pytest

from jaxcomm.ft import faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
harness = bench_modules.load("faults")


def test_the_injector_fires_each_fault_once_and_rereads_a_changed_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps([{"replica": 1, "round": 2, "phase": "exchange", "action": "sleep"}])
    )
    injector = faults.Injector.watching(str(plan), replica_id=1, incarnation=0)
    other = faults.Injector.watching(str(plan), replica_id=1, incarnation=1)
    injector("exchange", 1)
    other("exchange", 2)
    assert not (tmp_path / "plan.json.fired").exists()
    injector("exchange", 2)
    injector("exchange", 2)
    fired = [json.loads(line) for line in (tmp_path / "plan.json.fired").read_text().splitlines()]
    assert [(f["round"], f["phase"]) for f in fired] == [(2, "exchange")]
    entries = json.loads(plan.read_text())
    entries.append({"replica": 1, "round": 5, "phase": "vote", "action": "sleep", "seconds": 0.01})
    plan.write_text(json.dumps(entries))
    os.utime(plan, ns=(1, 1))  # a new mtime even on a coarse clock
    injector("exchange", 2)
    injector("vote", 5)
    assert len((tmp_path / "plan.json.fired").read_text().splitlines()) == 2


def test_a_bad_plan_names_the_entry(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"replica": 0, "round": 1, "phase": "during", "action": "kill"}]))
    with pytest.raises(ValueError, match="entry 0.*phase in"):
        faults.load(str(plan))


def _args(**kw):
    base = dict(rounds=30, fault_every=3, kinds=["kill_exchange", "lighthouse", "stop_exchange"])
    base.update(timeout=5.0, mode="diloco", batch=2, sync_every=4)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_scheduler_aims_two_rounds_ahead_at_a_group_that_is_up(tmp_path):
    plan = str(tmp_path / "plan.json")
    scheduler = harness.Scheduler(_args(), plan)
    latest = {0: {"round": 1, "incarnation": 0}, 1: {"round": 1, "incarnation": 2}}
    latest[2] = {"round": -5, "incarnation": 0}  # far behind: down, or healing
    scheduler.update(latest, 0)  # round 3 is three ahead: not yet
    assert json.loads(open(plan).read()) == []
    scheduler.update(latest, 1)
    (fault,) = json.loads(open(plan).read())
    assert fault == {
        "replica": 0,
        "incarnation": 0,
        "round": 3,
        "phase": "exchange",
        "action": "kill",
        "seconds": 0.0,
    }
    scheduler.update(latest, 4)  # round 6: the lighthouse
    assert scheduler.lighthouse_at == [6]
    latest[0].update(round=7, incarnation=1)  # restarted after the kill
    latest[1]["round"] = 7
    scheduler.update(latest, 7)  # round 9; the groups up are 0 and 1, the third fault takes [2 % 2]
    third = json.loads(open(plan).read())[-1]
    assert third["round"] == 9 and third["action"] == "stop" and third["seconds"] == 9.0
    assert third["replica"] == 0 and third["incarnation"] == 1


def test_the_analysis_of_a_hand_worked_log():
    def entry(replica, round_, committed, t, h="a", contributors=2, epoch=None, healed=False):
        return {
            "replica": replica,
            "incarnation": 0,
            "round": round_,
            "committed": committed,
            "epoch": epoch if epoch is not None else round_ + 1,
            "members": [0, 1],
            "contributors": contributors,
            "healed": healed,
            "state_hash": h,
            "time": t,
        }

    entries = [
        entry(0, 0, True, 100.0, contributors=0),
        entry(1, 0, True, 100.0, contributors=0),
        entry(0, 1, True, 101.0),
        entry(1, 1, True, 101.1),
        entry(0, 1, True, 103.7),  # a late log line of round 1: not what decided round 2
        entry(0, 1, False, 104.0, epoch=9),  # the fault at 103.5 aborted round 2
        entry(1, 1, False, 104.2, epoch=9),
        entry(0, 2, True, 106.0, contributors=1),
        entry(1, 2, True, 106.0, contributors=1, h="b"),  # a member holding other bits
        {"replica": 0, "round": 2, "eval_loss": 3.0, "time": 106.5},
        {"replica": 0, "round": 2, "final_loss": 2.5, "time": 107.0},
    ]
    fired = [{"kind": "kill_exchange", "replica": 1, "round": 2, "time": 103.5}]
    result = harness.analyse(
        {"label": "t", "code": 0, "entries": entries, "fired": fired, "wall_s": 9.0}, _args()
    )
    tokens_per_member_round = 2 * 64 * 4
    assert result["rounds"] == 2 and result["aborted"] == 1
    assert (
        result["tokens"] == 3 * tokens_per_member_round
    )  # 2 contributors in round 1, 1 in round 2
    assert result["mismatched_rounds"] == [2] and not result["hashes_equal"]
    assert result["seconds"] == pytest.approx(5.0)  # round 1's commit to the last
    (fault,) = result["faults"]
    assert fault["decided_s"] == pytest.approx(0.5) and fault["resumed_s"] == pytest.approx(2.5)
    assert result["final_loss"] == 2.5 and result["curve"] == [(result["tokens"], 3.0)]
    curve = [(0, 5.0), (100, 3.0), (300, 2.0)]
    assert harness.loss_at(curve, 50) == pytest.approx(4.0) and harness.loss_at(
        curve, 200
    ) == pytest.approx(2.5)


def _quick(tmp_path, *extra):
    out = tmp_path / "faults.json"
    command = [
        sys.executable,
        "bench/faults.py",
        "--quick",
        "--skip-baseline",
        "--json",
        str(out),
        *extra,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["faults"], done.stdout


@pytest.mark.slow
def test_diloco_groups_survive_kills_stops_a_slow_group_and_a_lighthouse_restart(tmp_path):
    result, stdout = _quick(tmp_path)
    assert result["code"] == 0 and result["rounds"] == 24, stdout[-2000:]
    assert result["hashes_equal"], result["mismatched_rounds"]
    kinds = {f["kind"] for f in result["faults"]}
    assert kinds >= {
        "kill_inner",
        "kill_exchange",
        "stop_exchange",
        "slow",
        "lighthouse",
        "kill_vote",
    }, stdout
    # Every fault is decided (a round commits or aborts on a survivor) within 15 s, and the next
    # commit follows within 15 s as well: the deadline is 5 s and the heartbeat timeout 2 s.
    assert all(f["decided_s"] is not None and f["decided_s"] < 15 for f in result["faults"]), (
        result["faults"]
    )
    assert all(f["resumed_s"] is not None and f["resumed_s"] < 15 for f in result["faults"]), (
        result["faults"]
    )
    assert result["aborted"] >= 1 and result["healed"] >= 2
    slow = [f for f in result["faults"] if f["kind"] == "slow"]
    assert all(
        f["decided_s"] >= 2.0 for f in slow
    )  # waited for, not evicted: the round took its sleep


@pytest.mark.slow
def test_data_parallel_groups_lose_no_step_beyond_the_aborted_ones(tmp_path):
    result, stdout = _quick(tmp_path, "--mode", "dp", "--rounds", "18")  # 5 faults, one per kind
    assert result["code"] == 0 and result["rounds"] == 18 and result["hashes_equal"], stdout[-2000:]
    aborting = [
        f for f in result["faults"] if f["kind"] in ("kill_exchange", "stop_exchange", "kill_vote")
    ]
    assert 1 <= result["aborted"] <= len(aborting) + 1, result["faults"]


sys.path.insert(0, os.path.join(ROOT, "bench"))
import netbed  # noqa: E402  (bench/, as test_network imports it)

_CANNOT = netbed.check_can_isolate()


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(_CANNOT is not None, reason=f"cannot make network namespaces: {_CANNOT}")
def test_a_group_cut_off_by_a_partitioned_link_is_left_out_then_heals(tmp_path):
    out = tmp_path / "partition.json"
    # 3 groups, rounds of 10 steps, the link down for 8 s after round 6 (the bench's
    # defaults: 60 rounds, 12 s); the cut group heals about 20 rounds later.
    command = [sys.executable, "bench/ft_partition.py", "--rounds", "45", "--cut-seconds", "8"]
    command += ["--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert facts["others committed rounds while it was cut off"]
    assert facts["it was in none of their quorums then"] is True
    assert facts["it healed after the link came back, at round"] is not None
    assert facts["hashes equal after every committed round"] is True
