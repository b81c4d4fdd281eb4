"""Which jaxcomm configuration reaches a quality soonest on a given link.

A configuration's time to a quality target is its step time times the steps
it takes to get there. The step time depends on the link and the model, and
the simulator predicts it (:func:`~jaxcomm.costmodel.simulate`). The steps
depend on the task and the optimizer, and no model predicts them well: they
are measured, on a short run of the user's own task (bench/time_to_quality.py
reports them as its "steps to" column, or count them in your own loop).
:func:`recommend` multiplies the two for every configuration measured, ranks
them, and gives each as a fraction of the physical limit: the compute-only
step times dense's steps (what training would take on an infinitely fast
network).

Examples:
  >>> import jax
  >>> from jaxcomm.costmodel import Cluster
  >>> grads = [jax.ShapeDtypeStruct((1024, 1024), "float32")] * 4
  >>> link = Cluster(gpus_per_node=1, nodes=4, intra_bandwidth=1e11, intra_latency=1e-6,
  ...                inter_bandwidth=12.5e6, inter_latency=1e-4)  # 4 hosts, 100 Mbit/s
  >>> r = recommend(grads, link, backward_time=0.04, forward_time=0.02,
  ...               steps_to_target={"dense": 100, "bf16": 100, "diloco_h10": 130})
  >>> r.best.name, round(r.best.of_limit, 2)
  ('diloco_h10', 0.18)
  >>> print(r.best.code)
  jaxcomm.diloco(inner, outer, axis, sync_every=10)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jaxcomm.costmodel.cluster import Cluster
from jaxcomm.costmodel.plan import _as_workload
from jaxcomm.costmodel.simulator import Settings, simulate


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration the recommender knows.

    Attributes:
      settings: what the simulator runs for it.
      code: the jaxcomm call that runs it (``inner``: your optimizer,
        ``axis``: the data-parallel axis, ``outer``: DiLoCo's outer optimizer).
    """

    settings: Settings
    code: str


_DENSE = "optax.chain(jaxcomm.allreduce_gradients(axis{}), inner)"
_SPARSE = "jaxcomm.chunk_sparse(inner, axis, density=0.15{})"
# Named as bench/time_to_quality.py and bench/network.py name them, so that
# their "steps to" columns can be passed as they are. Dense buckets overlap
# backward, as allreduce_gradients' do where the collectives are asynchronous.
CANDIDATES = {
    "dense": Candidate(Settings(bucket_bytes=4 << 20, overlap=True), _DENSE.format("")),
    "bf16": Candidate(
        Settings(wire_dtype="bfloat16", bucket_bytes=4 << 20, overlap=True),
        _DENSE.format(", wire_dtype=jnp.bfloat16"),
    ),
    "bf16_ef": Candidate(
        Settings(wire_dtype="bfloat16", bucket_bytes=4 << 20, overlap=True),
        _DENSE.format(", wire_dtype=jnp.bfloat16, error_feedback=True"),
    ),
    "double_buffered": Candidate(
        Settings(bucket_bytes=4 << 20, overlap=True, double_buffering=True),
        "jaxcomm.double_buffered(inner, axis)",
    ),
    "chunk_sparse": Candidate(Settings(density=0.15, bucket_bytes=math.inf), _SPARSE.format("")),
    "chunk_sparse_fp16": Candidate(
        Settings(density=0.15, wire_dtype="float16", bucket_bytes=math.inf),
        _SPARSE.format(", wire_dtype=jnp.float16"),
    ),
    "chunk_sparse_fp16_db": Candidate(
        Settings(density=0.15, wire_dtype="float16", bucket_bytes=math.inf, double_buffering=True),
        _SPARSE.format(", wire_dtype=jnp.float16, double_buffering=True"),
    ),
    "powersgd_r4": Candidate(Settings(powersgd_rank=4), "jaxcomm.powersgd(axis, rank=4)"),
    "diloco_h10": Candidate(
        Settings(sync_every=10, bucket_bytes=math.inf),
        "jaxcomm.diloco(inner, outer, axis, sync_every=10)",
    ),
    "diloco_h50": Candidate(
        Settings(sync_every=50, bucket_bytes=math.inf),
        "jaxcomm.diloco(inner, outer, axis, sync_every=50)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One configuration's prediction.

    Attributes:
      name: its name in :data:`CANDIDATES`.
      code: the jaxcomm call that runs it.
      step_s: the predicted step time.
      steps: the measured steps to the target (``None``: it never got there).
      time_s: step_s x steps (``None`` where steps is).
      of_limit: the limit over time_s: 1.0 is training at compute speed with
        dense's steps (``None`` where steps is).
    """

    name: str
    code: str
    step_s: float
    steps: float | None
    time_s: float | None
    of_limit: float | None


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` returns.

    Attributes:
      choices: every configuration measured, soonest to the target first;
        those that never reached it last.
      compute_s: the compute-only step (forward + backward).
      limit_s: compute_s x dense's steps to the target.
      cluster: the cluster predicted for.
    """

    choices: tuple[Choice, ...]
    compute_s: float
    limit_s: float
    cluster: Cluster

    @property
    def best(self) -> Choice:
        """The configuration that reaches the target soonest."""
        return self.choices[0]

    def __str__(self) -> str:
        c = self.cluster
        lines = [
            f"jaxcomm recommend: {c.p} devices ({c.nodes} nodes x {c.gpus_per_node}), "
            f"compute-only step {self.compute_s * 1e3:.1f} ms, limit {self.limit_s:.1f} s",
            f"  {'config':<22}{'step ms':>10}{'steps':>8}{'time s':>10}{'of limit':>10}",
        ]
        for ch in self.choices:
            steps = "never" if ch.steps is None else f"{ch.steps:g}"
            time = "-" if ch.time_s is None else f"{ch.time_s:.1f}"
            frac = "-" if ch.of_limit is None else f"{ch.of_limit:.0%}"
            lines.append(f"  {ch.name:<22}{ch.step_s * 1e3:>10.1f}{steps:>8}{time:>10}{frac:>10}")
        lines.append(f"  use: {self.best.code}")
        return "\n".join(lines)


def recommend(
    grads_or_shapes,
    cluster: Cluster,
    *,
    steps_to_target: Mapping[str, float | None],
    backward_time: float = 0.0,
    forward_time: float = 0.0,
    batch: int = 1,
    candidates: Mapping[str, Candidate] | None = None,
) -> Recommendation:
    """Ranks configurations by predicted time to a quality target on `cluster`.

    Args:
      grads_or_shapes: a :class:`Workload`, or a gradient pytree (arrays,
        ``jax.ShapeDtypeStruct`` or shape tuples), as :func:`plan` takes.
      cluster: the cluster to predict for (the user's link, not the testbed's).
      steps_to_target: measured steps each configuration took to reach the
        target quality (``None``: it did not), by name in `candidates`; must
        include ``"dense"``, whose steps set the limit.
      backward_time, forward_time, batch: for a pytree, as :func:`plan`'s.
      candidates: the configurations known by name (default
        :data:`CANDIDATES`).

    Returns:
      A :class:`Recommendation`; ``print`` it for the table and the call to use.
    """
    candidates = CANDIDATES if candidates is None else candidates
    unknown = sorted(set(steps_to_target) - set(candidates))
    if unknown:
        raise ValueError(
            f"steps_to_target names {unknown}, which are not candidates; known: "
            f"{sorted(candidates)} (pass candidates= to add your own)"
        )
    dense_steps = steps_to_target.get("dense")
    if dense_steps is None:
        raise ValueError(
            "steps_to_target needs dense's steps to the target (the limit is the "
            "compute-only step times them): measure dense on the same task"
        )
    for name, steps in steps_to_target.items():
        if steps is not None and not steps > 0:
            raise ValueError(f"steps_to_target[{name!r}] = {steps!r}: a positive count or None")
    workload = _as_workload(grads_or_shapes, backward_time, forward_time, batch)
    compute_s = workload.compute_time
    if not compute_s > 0:
        raise ValueError(
            "the compute-only step is 0 s: give backward_time and forward_time (or a "
            "Workload with them), or no limit can be computed"
        )
    limit_s = compute_s * dense_steps
    choices = []
    for name, steps in steps_to_target.items():
        step_s = simulate(workload, cluster, candidates[name].settings).iteration_time
        time_s = None if steps is None else step_s * steps
        choices.append(
            Choice(
                name=name,
                code=candidates[name].code,
                step_s=step_s,
                steps=steps,
                time_s=time_s,
                of_limit=None if time_s is None else limit_s / time_s,
            )
        )
    choices.sort(key=lambda c: (c.time_s is None, c.time_s or 0.0))
    return Recommendation(tuple(choices), compute_s, limit_s, cluster)
