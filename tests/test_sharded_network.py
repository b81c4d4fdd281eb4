"""bench/network.py --fsdp: the sharded MLP (HSDP) across processes.

Quick mode on 2 processes x 2 CPU devices, "fsdp" inside a process and
"data" across them, on links shaped to 10 Gbit/s (which a few steps of a tiny
model never fill): every configuration's final params, put together by each
process from its shards, against dense HSDP's (``lax.pmean`` over "data").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "network.py"
sys.path.insert(0, str(REPO / "bench"))

import netbed  # noqa: E402

from tests.catalog import CATALOG  # noqa: E402

pytestmark = [pytest.mark.network, pytest.mark.slow]

_REASON = netbed.check_can_isolate()
STEPS = 3
# The catalog's configurations that the bench runs too, on the one "data" axis
# between processes over XLA's collectives; "dense" is the bench's lax.pmean.
NETWORK = {c.network: c for c in CATALOG if c.network and c.backend == "xla" and len(c.axes) == 1}
CONFIGS = ("dense", *NETWORK)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The rows of one quick run and each (config, process)'s final params."""
    if _REASON is not None:
        pytest.skip(f"cannot make network namespaces: {_REASON}")
    tmp = tmp_path_factory.mktemp("fsdp")
    out, params_dir = tmp / "rows.json", tmp / "params"
    params_dir.mkdir()
    done = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--quick", "--workload", "train", "--fsdp", "2",
            "--hosts", "2", "--rate", "10gbit", "--steps", str(STEPS), "--hidden", "64",
            "--features", "64", "--configs", ",".join(CONFIGS), "--timeout", "120",
            "--json", str(out), "--params-out", str(params_dir),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text()) if "step_s" in r}
    params = {}
    for config in ("init", *CONFIGS):
        for process in (0, 1):
            with np.load(params_dir / f"{config}.{process}.npz") as f:
                params[config, process] = {k: f[k] for k in f.files}
    return done, rows, params


def _distance(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.sum((a[k] - b[k]) ** 2) for k in a)))


def test_every_configuration_trains_sharded_and_the_replicas_agree(run):
    done, rows, params = run
    assert set(rows) == set(CONFIGS)
    for config, row in rows.items():
        assert row["fsdp"] == 2 and row["hosts"] == 2 and row["devices"] == 4, row
        assert row["step_s"] > 0 and row["mean_step_s"] > 0
        # Both processes hold the same params after the exchanges over "data".
        for name, value in params[config, 0].items():
            np.testing.assert_array_equal(value, params[config, 1][name], err_msg=config)
    # Not asserted for DiLoCo (its loss is each process's own inner training).
    trained = ["dense", *(k for k, c in NETWORK.items() if not c.gradient_at_local_params)]
    for config in trained:
        assert rows[config]["loss_last"] < rows[config]["loss_first"], rows[config]
    assert "fsdp inside a host" in done.stdout and "/ dense" in done.stdout


def test_exchanges_match_dense_hsdp_where_the_math_says(run):
    _, _, params = run
    init, dense = params["init", 0], params["dense", 0]
    moved = _distance(dense, init)
    assert moved > 0
    # A float32 wire sums what pmean sums: float32 rounding apart. So does
    # chunk_sparse here: each shard's pool (~1k elements) is one chunk of its
    # default 32768, and a whole chunk travels each step (it warns so).
    for config in (*(k for k, c in NETWORK.items() if c.exact), "chunk_sparse"):
        assert _distance(params[config, 0], dense) <= 1e-5 * moved, config
    # A bfloat16 wire rounds each gradient to 8 significant bits, once per
    # hop: the params differ, by a bfloat16-sized part of their travel.
    bf16 = _distance(params["bf16", 0], dense)
    assert 0 < bf16 <= 2.0**-6 * moved
    # DiLoCo (sync every 10) has not synced in 3 steps: the outer params are the initial ones.
    for name, value in params["diloco_h10", 0].items():
        np.testing.assert_array_equal(value, init[name])
    # PowerSGD at rank 4 of 64 x 64 matrices: a low-rank step, other than
    # dense's, but its way.
    got = params["powersgd_r4", 0]
    assert _distance(got, dense) > 1e-3 * moved
    step = np.concatenate([(got[k] - init[k]).ravel() for k in init])
    ref = np.concatenate([(dense[k] - init[k]).ravel() for k in init])
    cosine = step @ ref / (np.linalg.norm(step) * np.linalg.norm(ref))
    assert cosine > 0.5, cosine
