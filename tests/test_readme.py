"""The README's Use snippets run as written: the shard_map one with each
transform it offers, and the pmap one after it."""

from __future__ import annotations

import pathlib
import re
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
