"""bench/timeline.py and bench/network.py's step breakdown: how long before
the end of its finishing step each started exchange was done, and where a
step's time goes, on hand-worked runs."""

from __future__ import annotations

import bench_modules
import pytest


@pytest.fixture(scope="module")
def timeline():
    return bench_modules.load("timeline")


@pytest.fixture(scope="module")
def network():
    return bench_modules.load("network")


RUN = {
    # Steps [0, 1), [1, 2), [2, 3). Exchange 1 starts at 0.9, is done at 1.6
    # and asked for at 1.05 (in step 2, which ends at 2): 0.4 s to spare.
    # Exchange 2 starts at 1.9, is done at 3.2, asked for at 2.1 (step 3,
    # ending at 3): 0.2 s late.
    "step_times": [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)],
    "exchanges": [
        {"started": 0.9, "reduced": 1.6, "landed": 1.05, "returned": 1.61},
        {"started": 1.9, "reduced": 3.2, "landed": 2.1, "returned": 3.21},
    ],
}


def test_slack_is_the_finishing_steps_end_less_the_exchanges(timeline):
    assert timeline.on_network(RUN) == pytest.approx([0.7, 1.3])
    assert timeline.slack(RUN) == pytest.approx([0.4, -0.2])
    line = timeline.describe("db", RUN)
    assert "2 exchanges, each 1.000 s" in line and "0.100 s (mean; -0.200 s at least)" in line


def test_breakdown_splits_each_step_against_the_compute_only_step(network):
    rows = [
        {"config": "link", "rate_bps": 100e6, "measured_bps": 80e6},
        {"config": "compute", "rate_bps": 100e6, "step_s": 0.5},
        # 5 MB at 10 MB/s = 0.5 s of wire, 2 x 0.01 s of latency; bound 0.52 s.
        {"config": "slow", "rate_bps": 100e6, "step_s": 0.98, "bytes_sent": 5e6,
         "collectives": 2, "collective_latency_s": 0.01},
        {**RUN, "config": "hidden", "rate_bps": 100e6, "step_s": 0.55, "bytes_sent": 5e6,
         "collectives": 1, "collective_latency_s": 0.0},
    ]  # fmt: skip
    lines = network.breakdown(rows)
    assert "80.0 Mbit/s" in lines[1]
    slow = lines[3].split()
    assert slow == ["slow", "0.980", "0.500", "0.500", "0.020", "-0.040", "1.96x", "1.88x"]
    hidden = lines[4].split()
    assert hidden[-2:] == ["1.10x", "1.10x"]
    assert lines[5].startswith("hidden: 2 exchanges")
    assert network.breakdown(rows[2:]) == []  # no compute-only step: nothing to split
