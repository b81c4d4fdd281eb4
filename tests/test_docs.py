"""Every ```python block of README.md and docs/*.md runs as a reader would
copy it: as its own file, in a fresh `python` process started in the repo
root, without the XLA_FLAGS that conftest.py sets for the tests (a block that
needs 8 CPU devices sets them itself, before it imports jax).

A block that goes on from the ones before it says so on the line right above
its fence, `<!-- continues the blocks above -->` (invisible on GitHub): it
runs appended to every python block above it in the same file, as one
program, the way a reader pastes them into one session. Blocks in other
languages (bash) are not run here.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTINUES = "<!-- continues the blocks above -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
TIMEOUT_S = 300


def _documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _programs() -> list:
    """One param per python block: the program it runs (after the blocks
    above it, if it continues them), with the id `file:block number`."""
    params = []
    for path in _documents():
        text = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        above = ""  # every python block of the file so far
        for number, match in enumerate(FENCE.finditer(text), 1):
            code = match.group(1)
            if text[: match.start()].rstrip("\n").rpartition("\n")[2].strip() == CONTINUES:
                assert above, f"{name}:{number} continues no block"
                code = above + code
            above += match.group(1)
            params.append(pytest.param(code, id=f"{name}:{number}"))
    return params


def test_every_marker_is_right_above_a_python_block():
    for path in _documents():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == CONTINUES:
                assert lines[i + 1 : i + 2] == ["```python"], f"{path.name}:{i + 1}"


@pytest.mark.slow
@pytest.mark.parametrize("program", _programs())
def test_block_runs_on_its_own(program, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(program)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # As if the file were in the repo root: `import jaxcomm` finds this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TMPDIR"] = str(tmp_path)  # what a block writes with tempfile stays here
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"exit {done.returncode}; stderr ends:\n{done.stderr[-4000:]}"
