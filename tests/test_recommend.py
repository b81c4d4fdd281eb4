"""jaxcomm.costmodel.recommend: predicted step times x measured steps, ranked."""

from __future__ import annotations

import math

import jax
import pytest

from jaxcomm.costmodel import Candidate, Cluster, Settings, recommend, simulate
from jaxcomm.costmodel.plan import _as_workload

# 4 hosts on 100 Mbit/s links, one device each.
LINK = Cluster(
    gpus_per_node=1,
    nodes=4,
    intra_bandwidth=1e11,
    intra_latency=1e-6,
    inter_bandwidth=12.5e6,
    inter_latency=1e-4,
)
GRADS = [jax.ShapeDtypeStruct((1024, 1024), "float32")] * 4
TIMES = dict(backward_time=0.04, forward_time=0.02)


def test_time_is_the_simulated_step_times_the_measured_steps():
    """Each choice's time is simulate()'s step for its settings times its
    steps; the limit is (forward + backward) x dense's steps; the ranking
    is by time, with the runs that never reached the target last."""
    steps = {"dense": 100, "bf16": 110, "chunk_sparse": 300, "diloco_h10": None}
    r = recommend(GRADS, LINK, steps_to_target=steps, **TIMES)
    workload = _as_workload(GRADS, **TIMES, batch=1)
    assert r.compute_s == pytest.approx(0.06)
    assert r.limit_s == pytest.approx(6.0)
    from jaxcomm.costmodel.recommend import CANDIDATES

    by_name = {c.name: c for c in r.choices}
    for name, n in steps.items():
        want = simulate(workload, LINK, CANDIDATES[name].settings).iteration_time
        assert by_name[name].step_s == pytest.approx(want)
        if n is None:
            assert by_name[name].time_s is None and by_name[name].of_limit is None
        else:
            assert by_name[name].time_s == pytest.approx(want * n)
            assert by_name[name].of_limit == pytest.approx(6.0 / (want * n))
    times = [c.time_s for c in r.choices if c.time_s is not None]
    assert times == sorted(times)
    assert r.choices[-1].name == "diloco_h10"
    # 16 MB at 100 Mbit/s: dense's step is about 2 s, bf16's half that.
    assert by_name["bf16"].step_s < 0.6 * by_name["dense"].step_s
    assert r.best.name == "chunk_sparse"
    assert "chunk_sparse(inner, axis, density=0.15)" in str(r)


def test_a_candidate_of_ones_own():
    mine = {
        "dense": Candidate(Settings(bucket_bytes=math.inf), "dense()"),
        "fast": Candidate(Settings(wire_dtype="float16", bucket_bytes=math.inf), "fast()"),
    }
    r = recommend(GRADS, LINK, steps_to_target={"dense": 10, "fast": 10}, candidates=mine, **TIMES)
    assert r.best.code == "fast()"


@pytest.mark.parametrize(
    "steps,options,message",
    [
        ({"dense": 10, "dgc": 5}, {}, r"names \['dgc'\], which are not candidates"),
        ({"bf16": 10}, {}, "needs dense's steps"),
        ({"dense": None}, {}, "needs dense's steps"),
        ({"dense": 10, "bf16": 0}, {}, r"steps_to_target\['bf16'\] = 0"),
        ({"dense": 10}, {"backward_time": 0.0, "forward_time": 0.0}, "compute-only step is 0 s"),
    ],
)
def test_bad_input_names_the_argument(steps, options, message):
    with pytest.raises(ValueError, match=message):
        recommend(GRADS, LINK, steps_to_target=steps, **{**TIMES, **options})
