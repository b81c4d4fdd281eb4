"""Timelines of exchanges that outlive a step: when each travelled, against the steps.

A started exchange (``jaxcomm._ffi.async_timeline``: started, done on the
network, waited for, returned; time.monotonic's clock) is off the critical
path when it is done before the step that finishes it would end anyway.
These helpers turn a run's step spans and exchanges into that slack and into
a picture; ``bench/diloco_overlap.py`` and
``bench/network.py --workload train`` draw with them.
"""

from __future__ import annotations

import statistics


def exchanges_since(since: float) -> list[dict]:
    """This process's first device's started exchanges since ``since``
    (time.monotonic's clock): when each was started, done on the network,
    waited for and returned."""
    import jax

    from jaxcomm import _ffi

    me = jax.local_devices()[0].id
    keys = ("started", "reduced", "landed", "returned")
    return [
        dict(zip(keys, e[4:], strict=True))
        for e in _ffi.async_timeline()
        if e[0] == me and e[4] >= since
    ]


def on_network(run: dict) -> list[float]:
    """Seconds each exchange was on the network (reduced - started)."""
    return [e["reduced"] - e["started"] for e in run.get("exchanges", [])]


def slack(run: dict) -> list[float]:
    """Per exchange, how long before the end of the step that finished it
    (the step its done call ran in) it was done on the network: positive
    where it stayed off the critical path, negative where that step waited."""
    out = []
    for e in run.get("exchanges", []):
        ends = [b for a, b in run["step_times"] if a <= e["landed"] <= b]
        if ends:
            out.append(ends[0] - e["reduced"])
    return out


def describe(name: str, run: dict) -> str:
    """One line: the run's exchanges' mean time on the network, against its
    mean step, and how long before the end of the step that finished each
    it was done."""
    travel, spare = on_network(run), slack(run)
    steps = [b - a for a, b in run["step_times"]]
    line = (
        f"{name}: {len(travel)} exchanges, each {statistics.fmean(travel):.3f} s on the "
        f"network (mean) beside steps of {statistics.fmean(steps):.3f} s"
    )
    if spare:
        line += (
            f"; each was done {statistics.fmean(spare):.3f} s (mean; {min(spare):.3f} s at "
            "least) before the end of the step that finished it"
        )
    return line


def plot(runs: dict, path: str, title: str, *, xlabel: str = "bars: steps"):
    """Per run (name -> run with ``step_times`` and ``exchanges``), host 0's
    steps as bars and each exchange as a span from its start to its end on
    the network, marked where a later step asked for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, ax = plt.subplots(figsize=(11, 1.1 + 0.8 * len(names)))
    for y, name in enumerate(reversed(names)):
        r = runs[name]
        first = r["step_times"][0][0]
        bars = [(a - first, b - a) for a, b in r["step_times"]]
        ax.broken_barh(bars, (y - 0.3, 0.6), facecolors=["#4c72b0", "#8da0cb"] * len(bars))
        for e in r.get("exchanges", []):
            ax.plot(
                [e["started"] - first, e["reduced"] - first], [y + 0.38] * 2, "-", color="#dd8452"
            )
            ax.plot([e["landed"] - first], [y + 0.38], "v", color="#c44e52")
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel(f"seconds since the first timed step (host 0); {xlabel}")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
