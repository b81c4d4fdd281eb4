"""bench/diloco_overlap.py's own logic: its arguments, and how it splits a
run's steps by whether a started exchange was on the network. Its runs need
network namespaces and belong to the benchmark; tests/test_network.py covers
the testbed itself."""

from __future__ import annotations

import bench_modules
import pytest


@pytest.fixture(scope="module")
def bench():
    return bench_modules.load("diloco_overlap")


def test_steps_are_split_by_the_exchanges_on_the_network(bench):
    run = {
        # Steps [0, 1), [1, 2), [2, 3.5), [3.5, 4); one exchange on the network
        # from 1.5 to 3.6: the second step overlaps it, the third lies inside,
        # the fourth begins before it ends.
        "step_times": [(0.0, 1.0), (1.0, 2.0), (2.0, 3.5), (3.5, 4.0)],
        "exchanges": [{"started": 1.5, "reduced": 3.6, "landed": 3.9, "returned": 3.95}],
    }
    busy, idle = bench.split_steps(run)
    assert busy == [1.0, 1.5, 0.5] and idle == [1.0]
    assert bench.split_steps({"step_times": [(0.0, 1.0)]}) == ([], [1.0])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--delay", "100"], "--delay 100 must be in [1, --sync-every 100)"),
        (["--configs", "local,eager"], "unknown 'eager'"),
        (["--rate", "fast"], "fast"),
    ],
)
def test_bad_arguments_are_named(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
