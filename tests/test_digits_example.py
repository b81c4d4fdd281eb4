"""One-epoch smoke run of the README's main job (examples/digits), every
configuration, and where its outputs go."""

import importlib.util
import json
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from tests import example_modules

ROOT = pathlib.Path(__file__).parents[1]

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")

(main, readme) = example_modules.load("digits", "main", "readme")

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.slow
def test_one_epoch_of_every_configuration(tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = ["--epochs", "1", "--seeds", "0", "--no-progress", "--json", str(out)]
    argv += ["--out-dir", str(tmp_path / "plots"), "--plot", "loss.png"]
    assert main.main(argv) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "fp16", "fp16+db", "fp16+dga", "fused", "hierarchical", "csc"}
    for r in rows.values():
        assert r["accuracy_pct"] > 50, r  # one epoch is far above chance (10%)
    assert rows["fp16"]["bytes_ratio"] == 0.5
    assert rows["csc"]["bytes_ratio"] < 1
    printed = capsys.readouterr().out
    assert "test acc %" in printed
    # What the README quotes is read from this file's rows, as printed.
    summary = readme.summary(json.loads(out.read_text()))
    for r in summary["rows"]:
        assert f"{r['accuracy_pct']:.2f}±{r['accuracy_sd']:.2f}" in printed
    if HAS_MATPLOTLIB:
        png = (tmp_path / "plots" / "loss.png").resolve()
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"loss curves: {png}" in printed


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_plot_goes_where_git_does_not_look():
    args = main.parse_args([])
    png = main.output_path(args.out_dir, args.plot)
    assert png.parent != ROOT
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(png)])
    assert ignored.returncode == 0, f"{png} is not ignored by git"


def test_distance_from_dense_leaves_out_equal_steps():
    curves = {"dense": np.array([2.0, 1.0, 0.5]), "fused": np.array([2.0, 1.0 + 1e-7, 0.5])}
    gap = main.distance_from(curves, "dense")
    assert list(gap) == ["fused"]
    np.testing.assert_array_equal(np.isnan(gap["fused"]), [True, False, True])
    np.testing.assert_allclose(gap["fused"][1], 1e-7, rtol=1e-6)


def test_readme_numbers_are_the_programs_saved_output():
    """The README's digits table is readme.py's rendering of the committed
    results.json (main.py's output, summarised), and that file is from a run
    with main.py's default options, the command the README gives."""
    results = json.loads(readme.RESULTS.read_text())
    assert readme.readme_block(readme.README.read_text()) == readme.render(results)
    defaults = vars(main.parse_args([]))
    assert results["args"] == {k: defaults[k] for k in readme.KEPT_ARGS}
    assert [r["config"] for r in results["rows"]] == defaults["configs"]
