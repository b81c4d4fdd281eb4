"""The README's main job: a short run of examples/demo trains and agrees with pmean."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples" / "demo"))

import train  # noqa: E402


def test_demo_matches_pmean():
    ours = train.train(train.Config(steps=40, log_every=0, backend="ffi"))
    reference = train.train(train.Config(steps=40, log_every=0, reduce="pmean"))
    assert ours["final_loss"] < ours["losses"][0] / 4  # it learns
    for name in reference["params"]:
        np.testing.assert_allclose(
            ours["params"][name], reference["params"][name], rtol=1e-5, atol=1e-6
        )
