"""Time to quality on shaped network links: validation quality against wall time per configuration.

For each link rate and each gradient-exchange configuration, starts
``--hosts`` processes on the testbed of ``bench/network.py`` (one network
namespace per host, links shaped with ``tc tbf``, ``bench/netbed.py``) and
trains one model with ``bench/quality_worker.py`` for the same number of
steps, measuring validation quality every ``--eval-every`` steps. Then:

- JSON (``--json``): every row the workers printed (one per evaluation, one
  summary per run) and the measured link per rate;
- a table per rate: bytes per step and device, median step time, final
  quality, the wall time at which the run first reached dense's final
  quality (at an evaluation), and the speed-up against dense's wall time to
  its own final quality;
- a PNG (``--png``): quality against wall time, one line per configuration,
  one panel per rate.

Runs of different lengths: ``--max-steps`` for every configuration but
dense, ``name:N`` in ``--configs`` for one, ``--stop-at-quality`` (a number,
or ``dense``) to stop the others once they reach it. ``--project-from
run.json`` stands in for a dense run only a few steps long at this rate: the
longest dense curve of ``run.json`` at this rate's measured wall time per
step, marked projected in the table, the JSON and the plot.

Usage::

    python bench/time_to_quality.py --rate 100mbit --json ttq.json --png ttq.png
    python bench/time_to_quality.py --model digits --configs dense,powersgd_r4 --rate 1gbit
    python bench/time_to_quality.py --from-json a.json,b.json --png ttq.png   # table, plot again
    python bench/time_to_quality.py --rate 10mbit --steps 20 --max-steps 400 \
        --stop-at-quality 2.2977 --project-from ttq.json --configs dense,diloco_h50

Needs root (namespaces), as ``bench/network.py`` does; says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "bench"), REPO]

import netbed  # noqa: E402  (beside this file)
import quality_worker  # noqa: E402  (imports JAX only when run)

WORKER = os.path.join(REPO, "bench", "quality_worker.py")
ALL_CONFIGS = ",".join(quality_worker.CONFIGS)
BASELINE = "dense"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=quality_worker.MODELS, default="lm")
    parser.add_argument(
        "--configs",
        default=ALL_CONFIGS,
        help=f"default {ALL_CONFIGS}; variants: {', '.join(quality_worker.VARIANTS)}; "
        "name:N runs that one for N steps (e.g. dense:20,local:100)",
    )
    parser.add_argument("--rate", default="100mbit", help="link rate(s), comma-separated")
    parser.add_argument("--hosts", type=int, default=4, help="processes, one per namespace")
    parser.add_argument(
        "--steps", type=int, default=200, help="steps of dense (and of every other configuration "
        "unless --max-steps)",
    )  # fmt: skip
    parser.add_argument(
        "--max-steps",
        type=int,
        help="steps of every configuration but dense (the most they run with --stop-at-quality)",
    )
    parser.add_argument(
        "--stop-at-quality",
        help="every configuration but dense stops after its first evaluation at or past this "
        "quality: a number, or 'dense' for this rate's dense final quality in this run "
        "(dense must come first in --configs)",
    )
    parser.add_argument(
        "--project-from",
        help="a JSON file of a run whose dense went its whole course (another rate): where "
        "this run's dense is shorter, dense's curve is projected as that run's losses at "
        "this run's dense wall time per step, and is the target; marked 'projected'",
    )
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch-per-device", type=int, default=16)
    parser.add_argument("--width", type=int, default=192, help="lm: width; digits: hidden width")
    parser.add_argument("--layers", type=int, default=3, help="lm: transformer blocks")
    parser.add_argument("--lr", type=float, help="optimizer step (default: the model's)")
    parser.add_argument(
        "--schedule",
        choices=quality_worker.SCHEDULES,
        default="constant",
        help="the step over the run (the worker's --schedule)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="table: dense's final quality within this relative margin counts as reached",
    )
    parser.add_argument("--json", help="write the rows here (default: a temporary file)")
    parser.add_argument("--png", help="write the plot here")
    parser.add_argument(
        "--log-time", action="store_true", help="plot: wall time on a logarithmic axis"
    )
    parser.add_argument(
        "--from-json", help="no run: table and plot from these JSON files (comma-separated)"
    )
    parser.add_argument("--timeout", type=float, default=7200, help="seconds for the whole run")
    args = parser.parse_args(argv)
    args.config_list, args.config_steps = [], {}
    for item in filter(None, args.configs.split(",")):
        config, _, steps = item.partition(":")
        try:
            quality_worker.parse_config(config)
            if steps:
                args.config_steps[config] = int(steps)
        except ValueError as e:
            parser.error(f"--configs: {e}")
        args.config_list.append(config)
    if args.stop_at_quality not in (None, BASELINE):
        try:
            float(args.stop_at_quality)
        except ValueError:
            parser.error(f"--stop-at-quality {args.stop_at_quality}: a number or {BASELINE!r}")
    try:
        args.rates = [netbed.parse_rate(r) for r in args.rate.split(",") if r.strip()]
    except ValueError as e:
        parser.error(str(e))
    if args.hosts < 2:
        parser.error(f"--hosts {args.hosts}: need at least 2")
    args.devices_per_host = 1
    return args


def say(message: str):
    print(f"time_to_quality: {message}", file=sys.stderr, flush=True)


def config_steps(args, config: str) -> int:
    """The steps ``config`` runs: its own (name:N), else --steps for dense and
    --max-steps (if given) for the others."""
    if config in args.config_steps:
        return args.config_steps[config]
    if config == BASELINE or args.max_steps is None:
        return args.steps
    return args.max_steps


def worker_argv(args, config: str, stop_at: float | None = None) -> list[str]:
    argv = [sys.executable, WORKER, "--model", args.model, "--config", config]
    argv += ["--steps", str(config_steps(args, config))]
    flags = ("eval_every", "batch_per_device", "width", "layers", "seed", "lr", "schedule")
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    if stop_at is not None and config != BASELINE:
        argv += ["--stop-at-quality", repr(stop_at)]
    return argv


def stop_quality(args, rows: list[dict], rate: float) -> float | None:
    """What --stop-at-quality asks for at ``rate``, given the rows so far."""
    if args.stop_at_quality is None:
        return None
    if args.stop_at_quality != BASELINE:
        return float(args.stop_at_quality)
    finals = [
        r["quality"]
        for r in rows
        if r.get("summary") and r["config"] == BASELINE and r["rate_bps"] == rate
    ]
    return finals[-1] if finals else None


def run_inside(args) -> int:
    """Inside the namespaces: every rate, every configuration; rows to ``args.json``."""

    def commands(rate, rows):
        # Lazily: --stop-at-quality dense reads dense's rows at this rate.
        for config in args.config_list:
            yield config, worker_argv(args, config, stop_quality(args, rows, rate))

    def on_line(host, line):
        if host == 0:  # process 0 reports; the others would repeat it
            print(f"  {line}", file=sys.stderr, flush=True)

    return netbed.run_testbed(
        commands,
        netbed.Layout.of(args),
        say=say,
        on_line=on_line,
        keep_going=True,  # a failing configuration; the others still run
    )


def run_name(config: str, steps: int | None, baseline_steps: int | None) -> str:
    """The configuration's name, with its step count where that differs from dense's."""
    if steps is None or baseline_steps is None or steps == baseline_steps:
        return config
    return f"{config}, {steps} steps"


PROJECTED = f"{BASELINE} (projected)"


def baselines(rows: list[dict]) -> dict:
    """{rate: (run name, steps)} of the run each rate's table is timed against:
    a projected dense where there is one, else dense."""
    out: dict = {}
    for r in rows:
        if r.get("summary") and r.get("config") == BASELINE and "error" not in r:
            if r.get("projected"):
                out[r["rate_bps"]] = (PROJECTED, r["steps"])
            elif out.get(r["rate_bps"], ("",))[0] != PROJECTED:
                out[r["rate_bps"]] = (BASELINE, r["steps"])
    return out


def curves(rows: list[dict]) -> dict:
    """{(rate, run name): (evaluation rows by step, summary row or None)}."""
    base = baselines(rows)
    out: dict = {}
    for r in rows:
        if r.get("config") == "link" or "error" in r:
            continue
        if r.get("projected"):
            name = PROJECTED
        else:
            name = run_name(r["config"], r.get("steps"), base.get(r["rate_bps"], (0, None))[1])
        key = (r["rate_bps"], name)
        points, summary = out.get(key, ([], None))
        if r.get("summary"):
            summary = r
        else:
            points.append(r)
        out[key] = (points, summary)
    for points, _ in out.values():
        points.sort(key=lambda r: r["step"])
    return out


def project_dense(rows: list[dict], reference: list[dict], source: str = "") -> list[dict]:
    """Rows of a projected dense run for each rate whose dense ran fewer steps
    than the longest dense run of ``reference`` (another rate): the
    reference's evaluations (the runs are deterministic: the same losses at
    every rate), each at its step times this rate's dense wall time per step.
    Every row says ``"projected": True`` and where it came from; a rate
    that has a projection already gets none."""
    done = {r["rate_bps"] for r in rows if r.get("projected")}
    dense = [
        r for r in reference if r.get("config") == BASELINE and "error" not in r
        and not r.get("projected")
    ]  # fmt: skip
    finals = [r for r in dense if r.get("summary")]
    if not finals:
        return []
    ref = max(finals, key=lambda r: r.get("steps_run", r["steps"]))
    ref_steps = ref.get("steps_run", ref["steps"])
    ref_points = sorted(
        (
            r for r in dense if not r.get("summary") and r["rate_bps"] == ref["rate_bps"]
            and r["steps"] == ref["steps"]
        ),
        key=lambda r: r["step"],
    )  # fmt: skip
    out = []
    for short in rows:
        if not (short.get("summary") and short.get("config") == BASELINE) or "error" in short:
            continue
        ran = short.get("steps_run", short["steps"])
        if short.get("projected") or short["rate_bps"] in done or ran >= ref_steps:
            continue
        per_step = short["wall_s"] / ran
        common = {
            "rate_bps": short["rate_bps"],
            "model": short["model"],
            "config": BASELINE,
            "projected": True,
            "steps": ref_steps,
            "params": short["params"],
            "quality_name": short["quality_name"],
            "higher_is_better": short["higher_is_better"],
            "projected_from": {
                "file": source,
                "rate_bps": ref["rate_bps"],
                "steps": ref_steps,
                "measured_steps": ran,
                "wall_s_per_step": per_step,
            },
        }
        out += [
            {**common, "step": p["step"], "wall_s": p["step"] * per_step, "quality": p["quality"]}
            for p in ref_points
        ]
        out.append(
            {
                **common,
                "summary": True,
                "steps_run": ref_steps,
                "wall_s": ref_steps * per_step,
                "quality": ref["quality"],
                "step_s": short["step_s"],
                "mean_step_s": short.get("mean_step_s"),
                "bytes_per_step": short["bytes_per_step"],
                "compile_s": short["compile_s"],
            }
        )
        done.add(short["rate_bps"])
    return out


def plain_diloco(config: str) -> str | None:
    """The plain DiLoCo run a DiLoCo or SparseLoCo variant is set against:
    diloco_h{H} with its H; None for the other configurations."""
    options = quality_worker.parse_config(config)
    if isinstance(options, quality_worker.DiLoCoConfig | quality_worker.SparseLoCoConfig):
        return f"diloco_h{options.sync_every}"
    return None


def at_equal_steps(points: list[dict], other: list[dict]) -> tuple[float, int] | None:
    """(quality of ``points`` over ``other``'s - 1, step) at the last step both evaluated."""
    mine = {r["step"]: r["quality"] for r in points}
    theirs = {r["step"]: r["quality"] for r in other}
    common = [t for t in mine if t in theirs and t > 0]
    if not common:
        return None
    step = max(common)
    return mine[step] / theirs[step] - 1, step


def reached(quality: float, target: float, higher_is_better: bool) -> bool:
    return quality >= target if higher_is_better else quality <= target


def time_to(points: list[dict], target: float, higher_is_better: bool) -> float | None:
    """Wall time of the first evaluation at or past ``target``; None if never."""
    for r in points:
        if reached(r["quality"], target, higher_is_better):
            return r["wall_s"]
    return None


def steps_to(points: list[dict], target: float, higher_is_better: bool) -> int | None:
    """Step of the first evaluation at or past ``target``; None if never."""
    return next(
        (r["step"] for r in points if reached(r["quality"], target, higher_is_better)), None
    )


def limit_s(runs: dict, rate: float, base, target: float, higher: bool) -> float | None:
    """The physical limit of the time to ``target``: dense's steps to it, each
    as long as the compute-only step (``local``'s, the same model on the
    same hosts with nothing exchanged)."""
    local = next(
        (s for (r, _), (_, s) in runs.items() if r == rate and s and s["config"] == "local"), None
    )
    steps = steps_to(base[0], target, higher)
    if local is None or not steps:
        return None
    return local["step_s"] * steps


def target_quality(final: float, higher_is_better: bool, tolerance: float) -> float:
    """Dense's final quality, loosened by ``tolerance`` (relative): 0.01 takes
    1% more loss, or 1% less accuracy, as reached."""
    return final * (1 - tolerance) if higher_is_better else final * (1 + tolerance)


def summarize(rows: list[dict], tolerance: float = 0.0) -> list[dict]:
    """One row per (rate, configuration) with what the table shows."""
    runs = curves(rows)
    base_names = baselines(rows)
    table = []
    for (rate, config), (points, summary) in runs.items():
        if summary is None:
            continue
        higher = summary["higher_is_better"]
        base = runs.get((rate, base_names.get(rate, (BASELINE,))[0]))
        entry = {
            "rate_bps": rate,
            "config": config,
            "name": summary["config"],  # the configuration's own, without the run's length
            "projected": bool(summary.get("projected")),
            "model": summary["model"],
            "params": summary["params"],
            "quality_name": summary["quality_name"],
            "bytes_per_step": summary["bytes_per_step"],
            "step_s": summary["step_s"],
            "mean_step_s": summary.get("mean_step_s"),
            "steps_run": summary.get("steps_run", summary.get("steps")),
            "stopped_early": bool(summary.get("stopped_early")),
            "compile_s": summary["compile_s"],
            "wall_s": summary["wall_s"],
            "final_quality": summary["quality"],
            "target": None,
            "time_to_target_s": None,
            "speedup": None,
            "dense_to_final_s": None,
            "speedup_at_final": None,
            "vs_plain_diloco": None,
            "vs_plain_diloco_step": None,
            "limit_s": None,
            "of_limit": None,
            "steps_to_target": None,
        }
        reference = plain_diloco(summary["config"]) if not entry["projected"] else None
        if reference is not None:
            others = [
                p for (r, _), (p, s) in runs.items()
                if r == rate and s is not None and s["config"] == reference
            ]  # fmt: skip
            if others:
                compared = at_equal_steps(points, max(others, key=len))
                if compared is not None:
                    entry["vs_plain_diloco"], entry["vs_plain_diloco_step"] = compared
        # local never moves the params it is evaluated at: only its steps count.
        if base is not None and base[1] is not None and summary["config"] != "local":
            final = base[1]["quality"]
            target = target_quality(final, higher, tolerance)
            entry["target"] = target
            entry["time_to_target_s"] = time_to(points, target, higher)
            entry["steps_to_target"] = steps_to(points, target, higher)
            base_time = time_to(base[0], target, higher)
            if entry["time_to_target_s"] and base_time:
                entry["speedup"] = base_time / entry["time_to_target_s"]
            entry["limit_s"] = limit_s(runs, rate, base, target, higher)
            if entry["limit_s"] and entry["time_to_target_s"]:
                entry["of_limit"] = entry["limit_s"] / entry["time_to_target_s"]
            entry["quality_vs_dense"] = summary["quality"] / final - 1
            # The other way round: how long dense took to get where this run ended.
            there = time_to(base[0], summary["quality"], higher)
            own = time_to(points, summary["quality"], higher)  # may be before the last step
            entry["dense_to_final_s"] = there
            if there and own:
                entry["speedup_at_final"] = there / own
        table.append(entry)
    return table


def format_table(summary: list[dict], rows: list[dict], tolerance: float = 0.0) -> str:
    lines = []
    links = {r["rate_bps"]: r["measured_bps"] for r in rows if r.get("config") == "link"}
    projected = {r["rate_bps"]: r["projected_from"] for r in rows if r.get("projected")}
    for rate in sorted({s["rate_bps"] for s in summary}):
        entries = [s for s in summary if s["rate_bps"] == rate]
        first = entries[0]
        measured = links.get(rate)
        lines.append(
            f"\n{first['model']} ({first['params']:,} parameters) at {netbed.format_rate(rate)}"
            + (f" (one TCP stream: {measured / 1e6:.1f} Mbit/s)" if measured else "")
            + f"; target = {BASELINE}'s final {first['quality_name']}"
            + (f" within {100 * tolerance:g}%" if tolerance else "")
            + (f": {first['target']:.4f}" if first["target"] is not None else "")
        )
        if rate in projected:
            source = projected[rate]
            lines.append(
                f"PROJECTED: '{PROJECTED}' is {BASELINE}'s {source['steps']} steps at "
                f"{netbed.format_rate(source['rate_bps'])} ({source['file'] or 'reference'}) "
                f"at this rate's measured {source['wall_s_per_step']:.3f} s of wall time a "
                f"step ({source['measured_steps']} steps run here); its times and every "
                "speed-up against it are projections"
            )
        width = max(25, *(len(s["config"]) + 2 for s in entries))  # long variant names
        head = (
            f"{'config':<{width}}{'bytes/step':>12}{'step s':>9}{'mean s':>9}{'steps':>7}"
            f"{'final':>9}{'vs dense':>9}{'vs diloco':>15}{'wall s':>9}{'to target s':>13}"
            f"{'speed-up':>10}{'of limit':>10}{'dense there s':>15}{'speed-up there':>16}"
        )
        lines += [head, "-" * len(head)]
        for s in entries:
            vs, to, up = s.get("quality_vs_dense"), s["time_to_target_s"], s["speedup"]
            there, up_there = s["dense_to_final_s"], s["speedup_at_final"]
            mean, vd = s["mean_step_s"], s["vs_plain_diloco"]
            own = "p" if s["projected"] else ""  # this run's own times are projected
            against = "p" if rate in projected else ""  # times against a projected dense
            steps = f"{s['steps_run']}{'*' if s['stopped_early'] else ''}"
            at = s["vs_plain_diloco_step"]
            cells = [
                f"{s['config']:<{width}}",
                f"{s['bytes_per_step']:>12,.0f}",
                f"{s['step_s']:>9.3f}",
                f"{'-' if mean is None else f'{mean:.3f}':>9}",
                f"{steps:>7}",
                f"{s['final_quality']:>9.4f}",
                f"{'-' if vs is None else f'{100 * vs:+.1f}%':>9}",
                f"{'-' if vd is None else f'{100 * vd:+.1f}%@{at}':>15}",
                f"{s['wall_s']:.1f}{own}".rjust(9),
                (
                    "-"
                    if s["target"] is None
                    else "not reached"
                    if to is None
                    else f"{to:.1f}{own}"
                ).rjust(13),
                ("-" if up is None else f"{up:.2f}x{against}").rjust(10),
                ("-" if s["of_limit"] is None else f"{100 * s['of_limit']:.0f}%{against}").rjust(
                    10
                ),
                ("-" if there is None else f"{there:.1f}{against}").rjust(15),
                ("-" if up_there is None else f"{up_there:.2f}x{against}").rjust(16),
            ]
            lines.append("".join(cells))
    lines.append(
        "bytes/step: sent per device per step (jaxcomm.get_stats, mean over steps); step s: "
        "median; mean s: mean step; steps: steps run (* stopped at its first evaluation "
        "reaching --stop-at-quality); vs diloco: quality against plain diloco_h{H}'s at "
        "the last step both evaluated (@step); wall s: training time of all steps (no "
        "compile, no evaluation); to target: wall time of the first evaluation reaching "
        "dense's final quality; speed-up: dense's time to it / this one's; of limit: the "
        "physical limit (local's compute-only step x dense's steps to target) / this "
        "run's time to target; dense there: "
        "dense's wall time to this run's final quality (first evaluation), '-' if never; "
        "speed-up there: that / this run's own time to it; p: projected."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, log_time: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = curves(rows)
    rates = sorted({rate for rate, _ in runs})
    configs = list(dict.fromkeys(config for _, config in runs))

    # One colour per method; its error-feedback variant dashed, a longer run
    # dash-dotted; dense black, a projected dense dashed.
    def family(name):
        return name.split(",")[0].split(" ")[0].replace("_noef", "").replace("_ef", "")

    families = [f for f in dict.fromkeys(family(c) for c in configs) if f != BASELINE]
    palette = plt.get_cmap("tab20").colors if len(families) > 10 else None
    size = (5.2, 3.8) if len(configs) <= 8 else (7.0, 5.0)  # room for a long legend
    fig, axes = plt.subplots(
        1, len(rates), figsize=(size[0] * len(rates), size[1]), squeeze=False, sharey=True
    )
    for ax, rate in zip(axes[0], rates, strict=True):
        name = None
        for config in configs:
            if (rate, config) not in runs or config.startswith("local"):
                continue  # local's params never leave the initial ones
            points, _ = runs[rate, config]
            name = points[0]["quality_name"]
            method = family(config)
            index = families.index(method) if method != BASELINE else 0
            color = (
                "black"
                if method == BASELINE
                else palette[index % len(palette)]
                if palette
                else f"C{index % 10}"
            )
            style = "--" if config == PROJECTED else "-." if "," in config else "-"
            style = "--" if method != config.split(",")[0] and style == "-" else style
            ax.plot(
                [r["wall_s"] for r in points],
                [r["quality"] for r in points],
                style,
                marker="o",
                ms=2,
                lw=1.1,
                color=color,
                label=config,
            )
        base = (rate, baselines(rows).get(rate, (BASELINE,))[0])
        if base in runs and runs[base][1] is not None:
            target = runs[base][1]["quality"]
            ax.axhline(target, ls=":", lw=0.8, color="gray")  # what the table times
        ax.set(title=f"{netbed.format_rate(rate)} per host", xlabel="training wall time, s")
        if log_time:  # linear up to 10 s (the evaluations at 0 s), logarithmic beyond
            ax.set_xscale("symlog", linthresh=10.0)
            ax.set_xlim(left=0)
        ax.set_ylabel(name or "quality")
        if name == "val_loss":
            low = min(r["quality"] for points, _ in runs.values() for r in points)  # shared y
            ax.set_ylim(low - 0.05, min(ax.get_ylim()[1], low + 1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left" if log_time else "upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(args, rows: list[dict]):
    summary = summarize(rows, args.tolerance)
    print(format_table(summary, rows, args.tolerance), flush=True)
    for line in recommend_lines(summary):
        print(line, flush=True)
    if args.png:
        plot(rows, args.png, args.log_time)
        print(f"plot: {args.png}", flush=True)


def recommend_lines(summary: list[dict]) -> list[str]:
    """Per rate, the measured steps to dense's final quality of the runs
    jaxcomm.costmodel.recommend knows, as its ``steps_to_target``: what it
    takes to predict the best configuration on another link."""
    from jaxcomm.costmodel.recommend import CANDIDATES

    lines = []
    for rate in sorted({s["rate_bps"] for s in summary}):
        steps = {}
        for s in summary:
            if s["rate_bps"] == rate and s["name"] in CANDIDATES and not s["projected"]:
                # Of several runs of one configuration, the one that got there.
                if steps.get(s["name"]) is None:
                    steps[s["name"]] = s["steps_to_target"]
        if "dense" in steps and steps["dense"]:
            lines.append(
                f"{netbed.format_rate(rate)}: for jaxcomm.costmodel.recommend on your link, "
                f"steps_to_target={steps!r}"
            )
    return lines


def with_projection(args, rows: list[dict]) -> list[dict]:
    """``rows`` and, with --project-from, dense's projected rows (``project_dense``)."""
    if not args.project_from:
        return rows
    with open(args.project_from) as f:
        reference = json.load(f)
    return rows + project_dense(rows, reference, os.path.basename(args.project_from))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        rows = []
        for path in args.from_json.split(","):
            with open(path) as f:
                rows += json.load(f)
        report(args, with_projection(args, rows))
        return 0
    if os.environ.get(netbed.INSIDE_ENV) == "1":
        return run_inside(args)
    argv = sys.argv[1:] if argv is None else list(argv)
    temporary = None
    if args.json is None:
        temporary = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        args.json = temporary.name
        argv += ["--json", args.json]
    say(f"{len(args.config_list)} configurations x {len(args.rates)} rates, rows in {args.json}")
    code = netbed.rerun_isolated(__file__, argv, timeout_s=args.timeout + 60, say=say)
    if os.path.exists(args.json) and os.path.getsize(args.json):
        with open(args.json) as f:
            rows = with_projection(args, json.load(f))
        if args.project_from:
            netbed.write_json(args.json, rows)  # the projection, marked, beside the runs
        report(args, rows)
    if temporary is not None:
        os.unlink(args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
