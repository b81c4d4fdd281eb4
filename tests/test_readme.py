"""The README's Use snippets run as written: the shard_map one with each
transform it offers, and the pmap one after it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _use_snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Use") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _use_snippet() -> str:
    return _use_snippets()[0]


def _chunk_sparse_variant(code: str) -> str:
    """The snippet with its commented-out `# or: tx = chunk_sparse(...)` in use."""
    alt = re.search(r"# or: (tx = .*?\))\n\n", code, re.S).group(1)
    alt = re.sub(r"\n#\s*", " ", alt)
    return code.replace("\n\n\ndef step", f"\ntx = {alt.split('=', 1)[1].strip()}\n\n\ndef step", 1)


@pytest.mark.parametrize("variant", ["as written", "chunk_sparse"])
def test_use_snippet_runs_and_learns(variant, capsys):
    code = _use_snippet()
    if variant == "chunk_sparse":
        code = _chunk_sparse_variant(code)
        assert "jaxcomm.chunk_sparse(" in code.split("def step")[0].split("# or:")[-1]
    scope: dict = {}
    with warnings.catch_warnings():
        # Its density is reachable on the toy model: chunk_sparse does not warn.
        warnings.simplefilter("error", UserWarning)
        exec(compile(code, str(README), "exec"), scope)
    loss = float(capsys.readouterr().out.split()[-1])
    if variant == "chunk_sparse":  # past its warm-up, 3 of its 9 chunks travel: 24 of 68
        density = np.asarray(scope["jaxcomm"].get_stats(scope["opt_state"]).density)
        assert np.allclose(density, 24 / 68), density
    # y = x[:, :4] is learnable exactly; 20 steps of SGD must cut the initial
    # loss (the mean of y**2, about 1) well down.
    x = scope["x"]
    start = float(np.mean(np.asarray(x)[:, :4] ** 2))
    assert loss < 0.5 * start, (loss, start)


@pytest.mark.parametrize("variant", ["as written", "chunk_sparse"])
def test_pmap_snippet_runs_after_it_and_learns(variant, capsys):
    """The pmap snippet, in the Use snippet's scope: state built per device
    by tx.init under pmap, the loss cut, params the same on every device."""
    first, then = _use_snippets()[:2]
    if variant == "chunk_sparse":
        first = _chunk_sparse_variant(first)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        exec(compile(first, str(README), "exec"), scope)
        exec(compile(then, str(README), "exec"), scope)
    printed = capsys.readouterr().out
    loss = float(printed.split("pmap loss")[-1])
    x = np.asarray(scope["x"])
    start = float(np.mean(x[0, :, :4] ** 2))  # zero params predict 0
    assert loss < 0.5 * start, (loss, start)
    for leaf in jax.tree.leaves(scope["pparams"]):
        leaf = np.asarray(leaf)
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


def _multihost_command() -> list[str]:
    """The README's multi-host command, as arguments after `python`."""
    text = README.read_text()
    section = text[text.index("## Multi-host") :]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    words = command.replace("\\\n", " ").split()
    assert words[0] == "python"
    return words[1:]


def _launch(args: list[str], tmp_path) -> str:
    root = README.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=root, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.slow
def test_multihost_command_is_right_on_this_jax(tmp_path):
    """The README's two-process command, as written but for --out, says
    nothing of wrong values (on jaxlib 0.10 XLA's hierarchical path across
    CPU processes does) and ends where one process of 8 devices does with
    one in-process psum, within test_multihost.py's tolerance."""
    args = _multihost_command()
    args[args.index("--out") + 1] = str(tmp_path / "two.npz")
    printed = _launch(args, tmp_path)
    assert "wrong values" not in printed and "Warning" not in printed, printed
    one = [*args[: args.index("examples/multihost/train.py")], "examples/multihost/train.py"]
    one[one.index("-n") + 1], one[one.index("--devices-per-process") + 1] = "1", "8"
    _launch(
        [*one, "--algorithm", "dense", "--nodes", "2", "--out", str(tmp_path / "one.npz")], tmp_path
    )
    with np.load(tmp_path / "two.npz") as two, np.load(tmp_path / "one.npz") as ref:
        for name in ref.files:
            np.testing.assert_allclose(two[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
