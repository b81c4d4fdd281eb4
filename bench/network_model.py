"""jaxcomm's cost model against step times measured on shaped links.

Reads the JSON rows of ``bench/network.py`` and does two things:

1. **Fits the link.** For each (rate, hosts, devices) with allreduce rows
   (paths ``auto`` and ``ring``, every wire), fits α and β of the ring model,
   ``time = 2(p-1)·α + 2(p-1)/p · bytes_on_wire · β`` with ``p`` the devices
   (gloo ranks), using :func:`jaxcomm.costmodel.fit_alpha_beta`. Bytes on the
   wire are the float32 bytes reduced x wire itemsize / 4. Prints α, β and
   the fit's error on each row.

2. **Predicts every training step** with :func:`jaxcomm.costmodel.simulate`:
   one step is compute, then the gradient exchange (``bucket_bytes=inf``:
   one collective, as the dense ``pmean`` is one fused all-reduce), whose
   bytes follow the configuration: float32 ``4·params``, a 16-bit wire
   ``2·params``, chunk-sparse ``density`` of that plus one float32 norm per
   chunk in a second allreduce. FP8 (``fp8``, ``fp8_ef``): one all-to-all
   and one all-gather per leaf (xla's default ``bucket_bytes=0``; XLA
   combines none of them), one byte an element plus int16 exponents, ``pα``
   each instead of the ring's ``2(p-1)α``. PowerSGD (``powersgd_r4``): the
   MLP's leaf shapes (from the row's ``features``/``hidden``/``classes``, or
   the worker's defaults when its parameter count matches) decide which
   leaves are compressed; the dense leaves, then every P, then every Q.

   The FP8 allreduce rows (path ``auto``, not fitted) are predicted with the
   same fit, as a check of the all-to-all + all-gather term alone.

   Sharded rows (``network.py --fsdp F``): only "data" crosses the link, so
   they are predicted with the fit of ``hosts`` ranks (``--devices-per-host
   1`` allreduce rows), the payload the process's shards, i.e. the whole
   model (its F "data" allreduces share the link). DiLoCo (``diloco_h10``)
   is held to its mean step (one sync in ten). Give them in a ``--train``
   run of their own: they are grouped with non-sharded rows of as many hosts.

   What is measured and what is predicted:

   * **compute** (forward, backward, optimizer and every CPU cost of the
     transform: casts, packing, norms) is a *measured input*: the
     configuration's step time on the fastest link, minus the model's
     communication there. Those rows are *calibration* (predicted =
     measured by construction) and are not counted as predictions. A
     configuration without its own fastest-link row borrows the compute of
     the one doing the same CPU work (``COMPUTE_FROM``), and all its rows
     are predictions.
   * **communication** is *predicted*: at a rate with allreduce rows, from
     that fit; elsewhere, β scaled by the ratio of rates from the nearest
     fitted rate (the link is the only per-byte cost), α kept.
   * **double buffering** is predicted without overlap: XLA's CPU runtime
     runs a collective inside the step's thunk sequence, the gloo call
     blocking the thread that would run the next compute, so nothing runs
     beside it. The simulator's GPU rule (``max(compute, communication)``)
     is printed beside it.

Usage::

    python bench/network_model.py --allreduce ar100.json --train tr100.json tr10g.json \\
        --png bench/results/network_model.png --json bench/results/network_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO]

from jaxcomm.collectives import DEFAULT_BUCKET_BYTES  # noqa: E402
from jaxcomm.costmodel import (  # noqa: E402  (the repository's jaxcomm, not an installed one)
    GradientTensor,
    LinkFit,
    Settings,
    Workload,
    cpu_host,
    fit_alpha_beta,
    simulate,
)

FIT_PATHS = ("auto", "ring")  # both are a ring across processes (gloo's, or ppermute's)
WIRE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # the fitted (ring) wires
FP8_WIRES = ("float8_e4m3fn", "float8_e5m2")  # all-to-all + all-gather: predicted, not fitted
DENSITY = 0.15  # bench/network_worker.py's chunk_sparse density
# bench/network_worker.py's MLP: (features, hidden), (hidden, hidden), (hidden, classes).
MLP_DEFAULTS = {"features": 1024, "hidden": 4096, "classes": 10}

# Every exchange is one collective of all gradients (bucket_bytes=inf).
CONFIG_SETTINGS = {
    "dense": Settings(bucket_bytes=math.inf),
    "allreduce": Settings(bucket_bytes=math.inf),
    "fusion": Settings(bucket_bytes=math.inf),
    # Same NIC bytes as the flat ring (see jaxcomm.costmodel.Cluster).
    "hierarchical": Settings(bucket_bytes=math.inf),
    "fp16": Settings(wire_dtype="float16", bucket_bytes=math.inf),
    "fp16_ef": Settings(wire_dtype="float16", bucket_bytes=math.inf),
    "bf16": Settings(wire_dtype="bfloat16", bucket_bytes=math.inf),
    "bf16_ef": Settings(wire_dtype="bfloat16", bucket_bytes=math.inf),
    # No overlap on CPU: see the module docstring.
    "double_buffering": Settings(bucket_bytes=math.inf),
    "chunk_sparse": Settings(density=DENSITY, bucket_bytes=math.inf),
    "chunk_sparse_fp16": Settings(wire_dtype="float16", density=DENSITY, bucket_bytes=math.inf),
    # xla's default bucket_bytes=0: one all-to-all + all-gather per leaf.
    "fp8": Settings(wire_dtype="float8_e4m3fn", bucket_bytes=0.0),
    "fp8_ef": Settings(wire_dtype="float8_e4m3fn", bucket_bytes=0.0),
    # network_worker's powersgd_r4: rank 4 on every matrix (mask=None).
    "powersgd_r4": Settings(powersgd_rank=4, powersgd_mask=None),
    "diloco_h10": Settings(sync_every=10, bucket_bytes=math.inf),
    # jaxcomm's TCP ring: ffi's default 4 MiB buckets, on the same link.
    "fp16_ffi": Settings(wire_dtype="float16", bucket_bytes=DEFAULT_BUCKET_BYTES),
}
# A configuration without its own fastest-link row does the same CPU work as this one.
COMPUTE_FROM = {"bf16": "fp16", "bf16_ef": "fp16_ef"}
WITHIN = 0.25  # the error a prediction is held to
LIMITS = """What the model does not know:
- compute, including a transform's own CPU work (casts, chunk packing, norms,
  top-k), is a measured input from the fastest link, not derived; a run whose
  CPU term differs from the calibration run's shows up as error in full;
- the host's own per-byte cost of a collective: beta is the link's, scaled with
  the rate, so where the host and not the link limits (10 Gbit/s here) that
  cost sits in the calibrated compute term;
- overlap on CPU: none is assumed (XLA's CPU runtime runs the collective in the
  step's own sequence); 'overlapped' shows the GPU rule for comparison;
- an FP8 allreduce's own CPU work (scaling, encoding, float32 adds) is not in
  its communication term (it is in the calibrated compute of a training row);
- PowerSGD on xla: XLA's combiner merges the dense leaves' all-reduce with P's
  (independent of each other), one ring latency fewer than the model's three."""


def say(message: str):
    print(f"network_model: {message}", file=sys.stderr, flush=True)


def load_rows(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows.extend(json.load(f))
    return rows


def bytes_on_wire(row: dict) -> float:
    """The row's float32 bytes as its wire carries them."""
    return row["bytes"] * WIRE_ITEMSIZE[row["wire"]] / 4


def is_fitted(row: dict) -> bool:
    """A timed allreduce row of a ring path and a ring wire: what the fit takes."""
    return row.get("path") in FIT_PATHS and "time_s" in row and row.get("wire") in WIRE_ITEMSIZE


def fit_links(rows) -> dict[tuple[int, int, int], LinkFit]:
    """α, β per (rate_bps, hosts, devices) from the timed ring-path allreduce rows."""
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for r in rows:
        if is_fitted(r):
            groups.setdefault((r["rate_bps"], r["hosts"], r["devices"]), []).append(r)
    fits = {}
    for key, group in sorted(groups.items()):
        nbytes = [bytes_on_wire(r) for r in group]
        if len(set(nbytes)) < 2:
            say(f"{key}: one size on the wire only, no fit")
            continue
        fits[key] = fit_alpha_beta(nbytes, [r["time_s"] for r in group], p=key[2])
    return fits


def fit_table(rows, fits) -> str:
    lines = []
    for (rate, hosts, devices), fit in fits.items():
        lines.append(
            f"link {rate / 1e6:g} Mbit/s, {hosts} hosts x {devices // hosts} devices: "
            f"alpha = {fit.alpha * 1e3:.3f} ms, beta = {fit.beta * 1e9:.2f} ns/B "
            f"(1/beta = {8 / fit.beta / 1e6:.1f} Mbit/s, "
            f"{100 * 8 / fit.beta / rate:.1f}% of the rate)"
        )
        lines.append(
            f"  {'path':<6}{'wire':<10}{'MiB f32':>8}{'measured s':>12}{'fit s':>9}{'err':>8}"
        )
        for r in rows:
            if is_fitted(r):
                if (r["rate_bps"], r["hosts"], r["devices"]) != (rate, hosts, devices):
                    continue
                fitted = fit.predict(bytes_on_wire(r))
                lines.append(
                    f"  {r['path']:<6}{r['wire']:<10}{r['bytes'] / 2**20:>8g}"
                    f"{r['time_s']:>12.3f}{fitted:>9.3f}{100 * (fitted / r['time_s'] - 1):>+7.1f}%"
                )
    return "\n".join(lines)


def link_at(fits, rate_bps: int, hosts: int, devices: int) -> tuple[LinkFit, str]:
    """The fit at this rate, else the nearest fitted rate's, β scaled by the rate ratio."""
    same = {k[0]: f for k, f in fits.items() if k[1:] == (hosts, devices)}
    if not same:
        raise ValueError(f"no allreduce fit for {hosts} hosts, {devices} devices")
    if rate_bps in same:
        return same[rate_bps], "fitted"
    nearest = min(same, key=lambda r: abs(math.log(r / rate_bps)))
    fit = same[nearest]
    scaled = dataclasses.replace(fit, beta=fit.beta * nearest / rate_bps)
    return scaled, f"beta scaled from {nearest / 1e6:g} Mbit/s"


def leaf_shapes(row: dict) -> list[tuple[int, ...]] | None:
    """The MLP's leaf shapes in tree order (b1, b2, b3, w1, w2, w3), or None if unknown."""
    sizes = {k: row.get(k, v) for k, v in MLP_DEFAULTS.items()}
    f, h, c = sizes["features"], sizes["hidden"], sizes["classes"]
    shapes = [(h,), (h,), (c,), (f, h), (h, h), (h, c)]
    if sum(math.prod(s) for s in shapes) != row["params"]:
        return None  # another model: only its parameter count is known
    return shapes


def step_time(row: dict, compute_s: float, link: LinkFit, settings: Settings) -> float:
    """One step of ``row``'s model: ``compute_s`` of compute, then ``settings``'
    exchange on ``link``."""
    shapes = leaf_shapes(row)
    if shapes is None:
        tensors = (GradientTensor(row["params"], compute_s),)
    else:  # backward produces the leaves in reverse tree order
        tensors = tuple(
            GradientTensor(math.prod(s), compute_s if i == 0 else 0.0, shape=s)
            for i, s in enumerate(reversed(shapes))
        )
    workload = Workload(tensors, forward_time=0.0, batch=1)
    cluster = cpu_host(devices=link.p, alpha=link.alpha, beta=link.beta)
    return simulate(workload, cluster, settings).iteration_time


def communication_time(row: dict, link: LinkFit, settings: Settings) -> float:
    return step_time(row, 0.0, link, settings)


def fp8_allreduce_rows(rows, fits) -> list[dict]:
    """The FP8 allreduce rows (not fitted) against the model, with the fit of their link."""
    out = []
    for r in rows:
        if r.get("wire") not in FP8_WIRES or "time_s" not in r:
            continue
        key = (r["rate_bps"], r["hosts"], r["devices"])
        if key not in fits:
            continue
        fit = fits[key]
        cluster = cpu_host(devices=fit.p, alpha=fit.alpha, beta=fit.beta)
        workload = Workload((GradientTensor(r["bytes"] // 4, 0.0),), forward_time=0.0, batch=1)
        predicted = simulate(workload, cluster, Settings(wire_dtype=r["wire"])).iteration_time
        # The same bytes as a ring would take (2(p-1) latencies), for comparison.
        ring = fit.predict(r["bytes"] / 4)
        out.append({**r, "predicted_s": predicted, "ring_s": ring})
    return out


def fp8_table(rows) -> str:
    lines = [
        "FP8 allreduce rows (not fitted): all-to-all + all-gather with the ring fit",
        f"  {'rate':<10}{'wire':<15}{'MiB f32':>8}{'measured s':>12}{'model s':>9}"
        f"{'err':>8}{'as ring s':>11}",
    ]
    for r in rows:
        lines.append(
            f"  {r['rate_bps'] / 1e6:<10g}{r['wire']:<15}{r['bytes'] / 2**20:>8g}"
            f"{r['time_s']:>12.3f}{r['predicted_s']:>9.3f}"
            f"{100 * (r['predicted_s'] / r['time_s'] - 1):>+7.1f}%{r['ring_s']:>11.3f}"
        )
    return "\n".join(lines)


def compute_terms(train_rows, fits) -> dict[tuple[int, int, str], tuple[float, int]]:
    """Measured compute per (hosts, devices, config): (seconds, rate it was taken at).

    Taken from each configuration's row at the fastest rate of its (hosts,
    devices) group: the step time minus the model's communication there.
    """
    fastest: dict[tuple[int, int], int] = {}
    for r in train_rows:
        group = (r["hosts"], r["devices"])
        fastest[group] = max(fastest.get(group, 0), r["rate_bps"])
    terms = {}
    for r in train_rows:
        if r["rate_bps"] != fastest[(r["hosts"], r["devices"])]:
            continue
        link, _ = link_at(fits, r["rate_bps"], r["hosts"], r["devices"])
        comm = communication_time(r, link, CONFIG_SETTINGS[r["config"]])
        if comm > r["step_s"]:
            say(f"{r['config']}: communication alone {comm:.3f} s > step {r['step_s']:.3f} s")
        terms[(r["hosts"], r["devices"], r["config"])] = (
            max(r["step_s"] - comm, 0.0),
            r["rate_bps"],
        )
    return terms


def on_data_axis(row: dict) -> dict:
    """A sharded row as the link sees it: ``hosts`` ranks, each the whole
    model; DiLoCo's step its mean (syncs included)."""
    if not row.get("fsdp") or "step_s" not in row:
        return row
    step = row["mean_step_s"] if CONFIG_SETTINGS[row["config"]].sync_every else row["step_s"]
    return {**row, "devices": row["hosts"], "step_s": step}


def predict(train_rows, fits) -> list[dict]:
    """One row per timed training row: measured, predicted, and how it was predicted."""
    rows = [r for r in train_rows if "step_s" in r and r.get("config") in CONFIG_SETTINGS]
    rows = [on_data_axis(r) for r in rows]
    fitted = {key[1:] for key in fits}  # (hosts, devices)
    for group in sorted({(r["hosts"], r["devices"]) for r in rows} - fitted):
        say(
            f"no allreduce rows for {group[0]} hosts x {group[1] // group[0]} devices "
            "(--devices-per-host): their training rows are skipped"
        )
    rows = [r for r in rows if (r["hosts"], r["devices"]) in fitted]
    terms = compute_terms(rows, fits)
    out = []
    for r in rows:
        hosts, devices, config = r["hosts"], r["devices"], r["config"]
        compute_from = config
        if (hosts, devices, config) not in terms:
            compute_from = COMPUTE_FROM.get(config, "dense")
        if (hosts, devices, compute_from) not in terms:
            say(f"{config} at {r['rate_bps'] / 1e6:g} Mbit/s: no compute term; skipped")
            continue
        compute, at = terms[(hosts, devices, compute_from)]
        link, link_basis = link_at(fits, r["rate_bps"], hosts, devices)
        settings = CONFIG_SETTINGS[config]
        if settings.uses_powersgd and leaf_shapes(r) is None:
            say(f"{config}: leaf shapes unknown for {r['params']} parameters; skipped")
            continue
        predicted = step_time(r, compute, link, settings)
        row = {
            "rate_bps": r["rate_bps"],
            "hosts": hosts,
            "devices": devices,
            "config": config,
            "params": r["params"],
            "step_s": r["step_s"],
            "predicted_step_s": predicted,
            "time_to_acc_s": r.get("time_to_acc_s"),  # measured, where the run reached it
            "error": predicted / r["step_s"] - 1,
            "compute_s": compute,
            "compute_from": f"{compute_from} at {at / 1e6:g} Mbit/s",
            "communication_s": communication_time(r, link, settings),
            "link": link_basis,
            "calibration": compute_from == config and r["rate_bps"] == at,
            **{k: r[k] for k in MLP_DEFAULTS if k in r},  # the leaf shapes, for the plot
        }
        if config == "double_buffering":
            overlapped = dataclasses.replace(settings, double_buffering=True)
            row["predicted_overlapped_s"] = step_time(r, compute, link, overlapped)
        out.append(row)
    return out


def prediction_table(rows) -> str:
    lines = []
    for rate in sorted({r["rate_bps"] for r in rows}):
        lines.append(f"\n== {rate / 1e6:g} Mbit/s per host")
        lines.append(
            f"{'config':<19}{'measured s':>11}{'predicted s':>12}{'error':>8}"
            f"{'compute s':>11}{'comm s':>9}  basis"
        )
        for r in (r for r in rows if r["rate_bps"] == rate):
            basis = "calibration" if r["calibration"] else f"compute of {r['compute_from']}"
            if "predicted_overlapped_s" in r:
                basis += f"; overlapped {r['predicted_overlapped_s']:.3f} s"
            lines.append(
                f"{r['config']:<19}{r['step_s']:>11.3f}{r['predicted_step_s']:>12.3f}"
                f"{100 * r['error']:>+7.1f}%{r['compute_s']:>11.3f}{r['communication_s']:>9.3f}"
                f"  {basis}"
            )
    predicted = [r for r in rows if not r["calibration"]]
    within = sum(abs(r["error"]) <= WITHIN for r in predicted)
    lines.append(
        f"\n{within} of {len(predicted)} predicted rows within {100 * WITHIN:g}% "
        f"({len(rows) - len(predicted)} calibration rows not counted)"
    )
    return "\n".join(lines)


def plot(rows, fits, path: str):
    """Step time against link rate per configuration: measured points, model lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = np.logspace(7.5, 10.3, 57)
    # One series per configuration and layout (devices per host).
    series = list(dict.fromkeys((r["config"], r["hosts"], r["devices"]) for r in rows))
    layouts = {s[1:] for s in series}
    for i, (config, hosts, devices) in enumerate(series):
        color = f"C{i % 10}"
        mine = [
            r for r in rows if (r["config"], r["hosts"], r["devices"]) == (config, hosts, devices)
        ]
        label = config if len(layouts) == 1 else f"{config}, {devices // hosts}/host"
        first = mine[0]
        line = [
            step_time(
                first,
                first["compute_s"],
                link_at(fits, rate, first["hosts"], first["devices"])[0],
                CONFIG_SETTINGS[config],
            )
            for rate in rates
        ]
        style = ("-", "--", ":", "-.")[i % 4]  # some configurations share a line
        ax.plot(rates, line, style, color=color, label=label)
        ax.plot([r["rate_bps"] for r in mine], [r["step_s"] for r in mine], "o", color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per host (bit/s)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time: measured (points), cost model (lines)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--allreduce", nargs="+", required=True, help="allreduce JSON rows")
    parser.add_argument("--train", nargs="+", required=True, help="training JSON rows")
    parser.add_argument("--png", help="write the plot here")
    parser.add_argument("--plot-configs", help="plot only these configurations (comma-separated)")
    parser.add_argument("--json", help="write the prediction rows here")
    args = parser.parse_args(argv)

    allreduce_rows = load_rows(args.allreduce)
    fits = fit_links(allreduce_rows)
    if not fits:
        say("no allreduce rows to fit")
        return 1
    print(fit_table(allreduce_rows, fits))
    fp8_rows = fp8_allreduce_rows(allreduce_rows, fits)
    if fp8_rows:
        print(fp8_table(fp8_rows))
    train_rows = load_rows(args.train)
    rows = predict(train_rows, fits)
    print(prediction_table(rows))
    for r in rows:
        if not r["calibration"] and abs(r["error"]) > WITHIN:
            print(
                f"not within {100 * WITHIN:g}%: {r['config']} at {r['rate_bps'] / 1e6:g} Mbit/s "
                f"({100 * r['error']:+.1f}%), compute {r['compute_s']:.3f} s taken from "
                f"{r['compute_from']}"
            )
    print(LIMITS)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        say(f"wrote {args.json}")
    if args.png:
        shown = set(args.plot_configs.split(",")) if args.plot_configs else None
        plot([r for r in rows if shown is None or r["config"] in shown], fits, args.png)
        say(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
