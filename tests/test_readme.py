"""The README's Use snippet runs as written, with each transform it offers."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _use_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


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
    if variant == "chunk_sparse":
        # The snippet's toy model is one chunk: chunk_sparse says so.
        with pytest.warns(UserWarning, match="not reachable"):
            exec(compile(code, str(README), "exec"), scope)
    else:
        exec(compile(code, str(README), "exec"), scope)
    loss = float(capsys.readouterr().out.split()[-1])
    # y = x[:, :4] is learnable exactly; 20 steps of SGD must cut the initial
    # loss (the mean of y**2, about 1) well down.
    x = scope["x"]
    start = float(np.mean(np.asarray(x)[:, :4] ** 2))
    assert loss < 0.5 * start, (loss, start)
