"""bench/quality.py's tables: per-seed changes against the same seed's dense,
their mean and range, the targets, and its argument checks (its runs are the
examples', which tests/test_lm_example.py and test_digits_example.py run)."""

from __future__ import annotations

import bench_modules
import pytest


@pytest.fixture(scope="module")
def bench():
    return bench_modules.load("quality")


def test_lm_rows_compare_each_seed_with_its_own_dense(bench):
    result = {
        "val_losses": {  # curves per seed; the last point is the final loss
            "dense": [[3.0, 2.0], [3.0, 2.5]],
            "csc": [[3.0, 2.1], [3.0, 2.5]],
        },
        "rows": [{"config": "dense", "bytes_ratio": 1.0}, {"config": "csc", "bytes_ratio": 0.2}],
    }
    rows = {r["config"]: r for r in bench.lm_rows(result)}
    csc = rows["csc"]
    assert csc["quality"] == pytest.approx(2.3)
    # Seed 0: 2.1 / 2.0 - 1 = 5%; seed 1: 0%. Not (2.3 / 2.25 - 1) = 2.2%.
    assert csc["change"] == pytest.approx(0.025)
    assert (csc["change_min"], csc["change_max"]) == (pytest.approx(0.0), pytest.approx(0.05))
    assert csc["bytes_ratio"] == 0.2 and rows["dense"]["change"] == 0.0
    # A stopped job: csc ran one seed of dense's two; it is compared on that one.
    result["val_losses"]["csc"] = [[3.0, 2.2]]
    csc = {r["config"]: r for r in bench.lm_rows(result)}["csc"]
    assert (csc["seeds"], csc["quality"], csc["dense_quality"]) == (1, 2.2, 2.0)
    assert csc["change"] == pytest.approx(0.1)
    assert [bench.verdict(c) for c in (0.02, 0.025, 0.031)] == [
        "within 2%",
        "within 3%",
        "above 3%",
    ]
    with pytest.raises(ValueError, match="no 'dense' run"):
        bench.lm_rows({"val_losses": {"csc": [[1.0]]}, "rows": []})


def test_digits_rows_give_points_against_dense(bench):
    result = {
        "rows": [
            {"config": "dense", "accuracy_pct": 96.5, "accuracy_sd": 0.3, "bytes_ratio": 1.0},
            {"config": "fp16+db", "accuracy_pct": 95.75, "accuracy_sd": 0.4, "bytes_ratio": 0.5},
        ]
    }
    rows = {r["config"]: r for r in bench.digits_rows(result)}
    assert rows["fp16+db"]["change_points"] == pytest.approx(-0.75)


def test_configs_filter_each_model_and_unknown_ones_are_named(bench, capsys):
    args = bench.parse_args(["--models", "lm,digits", "--configs", "powersgd,fp16+db"])
    assert bench.configs_for(args, "lm") == ["dense", "fp16+db", "powersgd"]
    assert bench.configs_for(args, "digits") == ["dense", "fp16+db"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "digits", "--configs", "powersgd"])
    assert "['powersgd'] are none of digits's" in capsys.readouterr().err


def test_several_files_merge_per_model_against_the_same_dense(bench):
    first = {
        "lm": {
            "val_losses": {"dense": [[3.0, 2.0]], "csc": [[3.0, 2.2]]},
            "rows": [
                {"config": "dense", "bytes_ratio": 1.0},
                {"config": "csc", "bytes_ratio": 0.2},
            ],
        },
        "digits": {"rows": [{"config": "dense", "accuracy_pct": 96.5}]},
    }
    later = {
        "lm": {
            "val_losses": {"dense": [[3.0, 2.0]], "int4+ef": [[3.0, 2.01]]},
            "rows": [
                {"config": "dense", "bytes_ratio": 1.0},
                {"config": "int4+ef", "bytes_ratio": 0.13},
            ],
        }
    }
    both = bench.merged([("a.json", first), ("b.json", later)])
    rows = {r["config"]: r for r in bench.lm_rows(both["lm"])}
    assert sorted(rows) == ["csc", "dense", "int4+ef"]
    assert rows["int4+ef"]["change"] == pytest.approx(0.005)
    assert rows["int4+ef"]["bytes_ratio"] == 0.13 and rows["csc"]["bytes_ratio"] == 0.2
    assert both["digits"] == first["digits"]
    assert "int4+ef" not in first["lm"]["val_losses"]  # the inputs are left as they were
    # Another dense (another seed, another program) would mix two baselines.
    later["lm"]["val_losses"]["dense"] = [[3.0, 2.1]]
    with pytest.raises(ValueError, match="b.json: lm's dense differs"):
        bench.merged([("a.json", first), ("b.json", later)])
