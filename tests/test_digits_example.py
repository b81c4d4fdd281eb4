"""One-epoch smoke run of the README's main job (examples/digits), every configuration."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples" / "digits"))

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")

import main  # noqa: E402


def test_one_epoch_of_every_configuration(tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = ["--epochs", "1", "--seeds", "0", "--no-progress", "--json", str(out), "--plot", ""]
    assert main.main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "fp16", "fp16+db", "fused", "hierarchical", "csc"}
    for r in rows.values():
        assert r["accuracy_pct"] > 50, r  # one epoch is far above chance (10%)
    assert rows["fp16"]["bytes_ratio"] == 0.5
    assert rows["csc"]["bytes_ratio"] < 1
    assert "test acc %" in capsys.readouterr().out
