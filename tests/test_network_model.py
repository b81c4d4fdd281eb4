"""bench/network_model.py: the link fit and the step-time prediction, on synthetic rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import network_model  # noqa: E402

from jaxcomm.costmodel import LinkFit  # noqa: E402

MIB = 1 << 20
ALPHA, BETA, HOSTS = 2e-3, 1e-7, 4  # 2 ms a ring step, 10 MB/s
SLOW, FAST = 100_000_000, 10_000_000_000


def ring_time(nbytes_on_wire):
    return 2 * (HOSTS - 1) * ALPHA + 2 * (HOSTS - 1) / HOSTS * nbytes_on_wire * BETA


def allreduce_rows():
    rows = [{"rate_bps": SLOW, "hosts": HOSTS, "config": "link", "measured_bps": 9.6e7}]
    for path in ("auto", "ring"):
        for wire, itemsize in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
            for size in (16 * MIB, 64 * MIB):
                rows.append(
                    {
                        "rate_bps": SLOW,
                        "hosts": HOSTS,
                        "devices": HOSTS,
                        "path": path,
                        "wire": wire,
                        "bytes": size,
                        "time_s": ring_time(size * itemsize / 4),
                    }
                )
    # Another algorithm's rows do not enter the ring fit.
    rows.append({**rows[1], "path": "hierarchical", "time_s": 100.0})
    return rows


def train_row(rate, config, step_s, params=1_000_000):
    return {
        "rate_bps": rate,
        "hosts": HOSTS,
        "devices": HOSTS,
        "config": config,
        "params": params,
        "step_s": step_s,
    }


def test_fit_recovers_alpha_and_beta():
    fits = network_model.fit_links(allreduce_rows())
    assert list(fits) == [(SLOW, HOSTS, HOSTS)]
    fit = fits[(SLOW, HOSTS, HOSTS)]
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-6)
    assert fit.beta == pytest.approx(BETA, rel=1e-6)
    assert fit.p == HOSTS


def test_beta_scales_with_the_rate_away_from_a_fit():
    fits = network_model.fit_links(allreduce_rows())
    link, basis = network_model.link_at(fits, FAST, HOSTS, HOSTS)
    assert link.beta == pytest.approx(BETA / 100, rel=1e-6)
    assert link.alpha == pytest.approx(ALPHA, rel=1e-6)
    assert basis == "beta scaled from 100 Mbit/s"
    with pytest.raises(ValueError, match="no allreduce fit"):
        network_model.link_at(fits, SLOW, HOSTS, 2 * HOSTS)


def test_prediction_matches_hand_worked_steps():
    # At 10 Gbit/s a float32 ring of 4e6 bytes costs 6 x 2 ms + 1.5 x 4e6 x 1e-9 s
    # = 0.018 s, so a 0.518 s step holds 0.5 s of compute; float16 moves half:
    # 0.015 s, so 0.715 s holds 0.7 s.
    rows = [
        train_row(FAST, "dense", 0.518),
        train_row(FAST, "fp16", 0.715),
        train_row(SLOW, "dense", 1.0),
        train_row(SLOW, "bf16", 1.0),
        train_row(SLOW, "double_buffering", 1.0),
    ]
    fits = network_model.fit_links(allreduce_rows())
    got = {(r["rate_bps"], r["config"]): r for r in network_model.predict(rows, fits)}
    assert got[(FAST, "dense")]["compute_s"] == pytest.approx(0.5)
    assert got[(FAST, "dense")]["calibration"]
    assert got[(FAST, "fp16")]["compute_s"] == pytest.approx(0.7)
    # 100 Mbit/s: 0.5 + 0.012 + 1.5 x 4e6 x 1e-7 = 1.112 s.
    dense = got[(SLOW, "dense")]
    assert dense["predicted_step_s"] == pytest.approx(1.112)
    assert dense["error"] == pytest.approx(0.112)
    assert not dense["calibration"]
    # bfloat16 borrows float16's compute: 0.7 + 0.012 + 1.5 x 2e6 x 1e-7 = 1.012 s.
    assert got[(SLOW, "bf16")]["predicted_step_s"] == pytest.approx(1.012)
    assert got[(SLOW, "bf16")]["compute_from"] == "fp16 at 10000 Mbit/s"
    # Double buffering: no overlap on CPU (1.112 s); overlapped it would be max(0.5, 0.612).
    buffered = got[(SLOW, "double_buffering")]
    assert buffered["predicted_step_s"] == pytest.approx(1.112)
    assert buffered["predicted_overlapped_s"] == pytest.approx(0.612)


def test_chunk_sparse_step_by_hand():
    # 100 chunks of 32768: 15% of the float32 bytes, 1966080 B, then 100 float32
    # norms, 400 B; two collectives of 6 steps each.
    link = LinkFit(alpha=ALPHA, beta=BETA, p=HOSTS)
    settings = network_model.CONFIG_SETTINGS["chunk_sparse"]
    expected = 1.0 + 2 * 6 * ALPHA + 1.5 * (1966080 + 400) * BETA
    row = {"params": 100 * 32768}
    assert network_model.step_time(row, 1.0, link, settings) == pytest.approx(expected)


MLP_ROW = {"params": 21_020_682}  # the worker's default MLP: 1024 -> 4096 -> 4096 -> 10


def test_fp8_step_by_hand():
    # One all-to-all + all-gather per leaf (4 latencies each, 6 leaves), 4 ranks:
    # each sends 3 rows of (row + 2) bytes in each, rows of ceil(n / 4) bytes:
    # b1, b2 1024; b3 3; w1 1048576; w2 4194304; w3 10240.
    link = LinkFit(alpha=ALPHA, beta=BETA, p=HOSTS)
    rows = [1024, 1024, 3, 1048576, 4194304, 10240]
    expected = 1.0 + 6 * 4 * ALPHA + sum(6 * (r + 2) for r in rows) * BETA
    got = network_model.step_time(MLP_ROW, 1.0, link, network_model.CONFIG_SETTINGS["fp8"])
    assert got == pytest.approx(expected)


def test_powersgd_step_by_hand():
    # Rank 4, rate 2: w1 (1024, 4096), w2 (4096, 4096) and w3 (4096, 10)
    # ((4106) x 8 = 32848 <= 40960) are compressed: P 4096 + 16384 + 16384
    # elements, Q 16384 + 16384 + 40; the biases, 4096 + 4096 + 10, go densely.
    # Three float32 ring allreduces of 6 latencies each.
    link = LinkFit(alpha=ALPHA, beta=BETA, p=HOSTS)
    elements = (4096 + 4096 + 10) + (4096 + 16384 + 16384) + (16384 + 16384 + 40)
    expected = 1.0 + 3 * 6 * ALPHA + 1.5 * 4 * elements * BETA
    settings = network_model.CONFIG_SETTINGS["powersgd_r4"]
    assert network_model.step_time(MLP_ROW, 1.0, link, settings) == pytest.approx(expected)
    # Another model's rows carry its sizes.
    small = {
        "params": 8 * 16 + 16 + 16 * 16 + 16 + 16 * 2 + 2,
        "features": 8,
        "hidden": 16,
        "classes": 2,
    }
    assert network_model.leaf_shapes(small) == [(16,), (16,), (2,), (8, 16), (16, 16), (16, 2)]
    assert network_model.leaf_shapes({"params": 7}) is None


def test_command_writes_rows_and_plot(tmp_path, capsys):
    ar, tr = tmp_path / "ar.json", tmp_path / "tr.json"
    ar.write_text(json.dumps(allreduce_rows()))
    # A run that reached the target accuracy, and one that did not.
    reached = {**train_row(SLOW, "dense", 1.0), "steps_to_acc": 5, "time_to_acc_s": 5.0}
    unreached = {**train_row(FAST, "dense", 0.518), "steps_to_acc": None, "time_to_acc_s": None}
    tr.write_text(json.dumps([unreached, reached]))
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    code = network_model.main(
        ["--allreduce", str(ar), "--train", str(tr), "--json", str(out), "--png", str(png)]
        + ["--plot-configs", "dense"]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    keys = {"rate_bps", "hosts", "config", "step_s", "predicted_step_s", "time_to_acc_s"}
    assert all(keys <= set(r) for r in rows)
    assert {r["rate_bps"]: r["time_to_acc_s"] for r in rows} == {SLOW: 5.0, FAST: None}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "alpha = 2.000 ms, beta = 100.00 ns/B" in text
    assert "1 of 1 predicted rows within 25%" in text  # 1.112 s against 1.0 s


def test_rows_of_a_layout_without_allreduce_rows_are_skipped_and_named(capsys):
    # 2 devices per host (--devices-per-host 2) but allreduce rows only for 1.
    rows = [train_row(FAST, "dense", 0.518), {**train_row(SLOW, "dense", 1.0), "devices": 8}]
    got = network_model.predict(rows, network_model.fit_links(allreduce_rows()))
    assert [(r["rate_bps"], r["devices"]) for r in got] == [(FAST, HOSTS)]
    assert "no allreduce rows for 4 hosts x 2 devices" in capsys.readouterr().err
