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

Usage::

    python bench/time_to_quality.py --rate 100mbit --json ttq.json --png ttq.png
    python bench/time_to_quality.py --model digits --configs dense,powersgd_r4 --rate 1gbit
    python bench/time_to_quality.py --from-json a.json,b.json --png ttq.png   # table, plot again

Needs root (namespaces), as ``bench/network.py`` does; says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "bench"), REPO]

import netbed  # noqa: E402  (beside this file)
import network  # noqa: E402
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
        help=f"default {ALL_CONFIGS}; variants: {', '.join(quality_worker.VARIANTS)}",
    )
    parser.add_argument("--rate", default="100mbit", help="link rate(s), comma-separated")
    parser.add_argument("--hosts", type=int, default=4, help="processes, one per namespace")
    parser.add_argument("--steps", type=int, default=200, help="steps of every configuration")
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
        "--from-json", help="no run: table and plot from these JSON files (comma-separated)"
    )
    parser.add_argument("--timeout", type=float, default=7200, help="seconds for the whole run")
    args = parser.parse_args(argv)
    args.config_list = [c for c in args.configs.split(",") if c]
    for config in args.config_list:
        try:
            quality_worker.parse_config(config)
        except ValueError as e:
            parser.error(f"--configs: {e}")
    try:
        args.rates = [netbed.parse_rate(r) for r in args.rate.split(",") if r.strip()]
    except ValueError as e:
        parser.error(str(e))
    if args.hosts < 2:
        parser.error(f"--hosts {args.hosts}: need at least 2")
    args.devices_per_host = 1  # network.worker_env reads it
    return args


def say(message: str):
    print(f"time_to_quality: {message}", file=sys.stderr, flush=True)


def worker_argv(args, config: str) -> list[str]:
    argv = [sys.executable, WORKER, "--model", args.model, "--config", config]
    flags = ("steps", "eval_every", "batch_per_device", "width", "layers", "seed", "lr", "schedule")
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv


def run_inside(args) -> int:
    """Inside the namespaces: every rate, every configuration; rows to ``args.json``."""
    netbed.install_interrupt_handlers()
    deadline = time.monotonic() + args.timeout
    rows: list[dict] = []
    code = 0

    def on_line(host, line):
        if host == 0:  # process 0 reports; the others would repeat it
            print(f"  {line}", file=sys.stderr, flush=True)

    try:
        with netbed.Testbed(args.hosts, args.rates[0]) as bed:
            for rate in args.rates:
                bed.set_rate(rate)
                measured = netbed.measure_link(bed, seconds=2.0)
                rows.append({"rate_bps": rate, "config": "link", "measured_bps": measured})
                say(
                    f"{netbed.format_rate(rate)}: one TCP stream carries "
                    f"{measured / 1e6:.1f} Mbit/s; {args.hosts} hosts x 1 CPU device"
                )
                for config in args.config_list:
                    started = time.monotonic()
                    say(f"{netbed.format_rate(rate)} {config}: starting")
                    result = netbed.run_hosts(
                        bed,
                        worker_argv(args, config),
                        lambda host: network.worker_env(args, bed, host),
                        deadline=deadline,
                        on_line=on_line,
                    )
                    rows.extend({"rate_bps": rate, **r} for r in result.rows)
                    network.write_json(args.json, rows)
                    say(
                        f"{netbed.format_rate(rate)} {config}: "
                        f"{'done' if not result.code else result.failed} "
                        f"in {time.monotonic() - started:.0f} s"
                    )
                    if result.code == 124:
                        return 124
                    if result.code:
                        code = result.code  # a failing configuration; the others still run
    except netbed.Interrupted as interrupt:
        say(f"got {interrupt}; stopped every host and removed the namespaces")
        code = 128 + interrupt.signum
    except netbed.NetbedError as e:
        say(f"could not build the testbed: {e}")
        code = 2
    network.write_json(args.json, rows)
    return code


def run_name(config: str, steps: int | None, baseline_steps: int | None) -> str:
    """The configuration's name, with its step count where that differs from dense's."""
    if steps is None or baseline_steps is None or steps == baseline_steps:
        return config
    return f"{config}, {steps} steps"


def curves(rows: list[dict]) -> dict:
    """{(rate, run name): (evaluation rows by step, summary row or None)}."""
    baseline_steps = {
        r["rate_bps"]: r["steps"] for r in rows if r.get("summary") and r["config"] == BASELINE
    }
    out: dict = {}
    for r in rows:
        if r.get("config") == "link" or "error" in r:
            continue
        name = run_name(r["config"], r.get("steps"), baseline_steps.get(r["rate_bps"]))
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


def reached(quality: float, target: float, higher_is_better: bool) -> bool:
    return quality >= target if higher_is_better else quality <= target


def time_to(points: list[dict], target: float, higher_is_better: bool) -> float | None:
    """Wall time of the first evaluation at or past ``target``; None if never."""
    for r in points:
        if reached(r["quality"], target, higher_is_better):
            return r["wall_s"]
    return None


def target_quality(final: float, higher_is_better: bool, tolerance: float) -> float:
    """Dense's final quality, loosened by ``tolerance`` (relative): 0.01 takes
    1% more loss, or 1% less accuracy, as reached."""
    return final * (1 - tolerance) if higher_is_better else final * (1 + tolerance)


def summarize(rows: list[dict], tolerance: float = 0.0) -> list[dict]:
    """One row per (rate, configuration) with what the table shows."""
    runs = curves(rows)
    table = []
    for (rate, config), (points, summary) in runs.items():
        if summary is None:
            continue
        higher = summary["higher_is_better"]
        base = runs.get((rate, BASELINE))
        entry = {
            "rate_bps": rate,
            "config": config,
            "model": summary["model"],
            "params": summary["params"],
            "quality_name": summary["quality_name"],
            "bytes_per_step": summary["bytes_per_step"],
            "step_s": summary["step_s"],
            "compile_s": summary["compile_s"],
            "wall_s": summary["wall_s"],
            "final_quality": summary["quality"],
            "target": None,
            "time_to_target_s": None,
            "speedup": None,
            "dense_to_final_s": None,
            "speedup_at_final": None,
        }
        if base is not None and base[1] is not None:
            final = base[1]["quality"]
            target = target_quality(final, higher, tolerance)
            entry["target"] = target
            entry["time_to_target_s"] = time_to(points, target, higher)
            base_time = time_to(base[0], target, higher)
            if entry["time_to_target_s"] and base_time:
                entry["speedup"] = base_time / entry["time_to_target_s"]
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
        width = max(25, *(len(s["config"]) + 2 for s in entries))  # long variant names
        head = (
            f"{'config':<{width}}{'bytes/step':>12}{'step s':>9}{'final':>9}{'vs dense':>9}"
            f"{'wall s':>9}{'to target s':>13}{'speed-up':>10}{'dense there s':>15}"
            f"{'speed-up there':>16}"
        )
        lines += [head, "-" * len(head)]
        for s in entries:
            vs, to, up = s.get("quality_vs_dense"), s["time_to_target_s"], s["speedup"]
            there, up_there = s["dense_to_final_s"], s["speedup_at_final"]
            lines.append(
                f"{s['config']:<{width}}{s['bytes_per_step']:>12,.0f}{s['step_s']:>9.3f}"
                f"{s['final_quality']:>9.4f}"
                f"{'' if vs is None else f'{100 * vs:+.1f}%':>9}"
                f"{s['wall_s']:>9.1f}"
                f"{'not reached' if to is None else f'{to:.1f}':>13}"
                f"{'' if up is None else f'{up:.2f}x':>10}"
                f"{'-' if there is None else f'{there:.1f}':>15}"
                f"{'-' if up_there is None else f'{up_there:.2f}x':>16}"
            )
    lines.append(
        "bytes/step: sent per device per step (jaxcomm.get_stats, mean over steps); step s: "
        "median; wall s: training time of all steps (no compile, no evaluation); to target: "
        "wall time of the first evaluation reaching dense's final quality; speed-up: "
        "dense's time to it / this one's; dense there: dense's wall time to this run's final "
        "quality (first evaluation), '-' if never; speed-up there: that / this run's own time "
        "to it."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = curves(rows)
    rates = sorted({rate for rate, _ in runs})
    configs = list(dict.fromkeys(config for _, config in runs))

    # One colour per method; its error-feedback variant dashed, a longer run dash-dotted.
    def family(name):
        return name.split(",")[0].replace("_noef", "").replace("_ef", "")

    families = [f for f in dict.fromkeys(family(c) for c in configs) if f != BASELINE]
    fig, axes = plt.subplots(
        1, len(rates), figsize=(5.2 * len(rates), 3.8), squeeze=False, sharey=True
    )
    for ax, rate in zip(axes[0], rates, strict=True):
        name = None
        for config in configs:
            if (rate, config) not in runs:
                continue
            points, _ = runs[rate, config]
            name = points[0]["quality_name"]
            method = family(config)
            color = "black" if method == BASELINE else f"C{families.index(method) % 10}"
            style = "-." if "," in config else "--" if method != config else "-"
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
        if (rate, BASELINE) in runs and runs[rate, BASELINE][1] is not None:
            target = runs[rate, BASELINE][1]["quality"]
            ax.axhline(target, ls=":", lw=0.8, color="gray")  # what the table times
        ax.set(title=f"{netbed.format_rate(rate)} per host", xlabel="training wall time, s")
        ax.set_ylabel(name or "quality")
        if name == "val_loss":
            low = min(r["quality"] for points, _ in runs.values() for r in points)  # shared y
            ax.set_ylim(low - 0.05, min(ax.get_ylim()[1], low + 1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(args, rows: list[dict]):
    summary = summarize(rows, args.tolerance)
    print(format_table(summary, rows, args.tolerance), flush=True)
    if args.png:
        plot(rows, args.png)
        print(f"plot: {args.png}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        rows = []
        for path in args.from_json.split(","):
            with open(path) as f:
                rows += json.load(f)
        report(args, rows)
        return 0
    if os.environ.get(netbed.INSIDE_ENV) == "1":
        return run_inside(args)
    reason = netbed.check_can_isolate()
    if reason is not None:
        say(f"cannot make network namespaces here: {reason}")
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    temporary = None
    if args.json is None:
        temporary = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        args.json = temporary.name
        argv += ["--json", args.json]
    say(f"{len(args.config_list)} configurations x {len(args.rates)} rates, rows in {args.json}")
    code = netbed.run_isolated(
        [sys.executable, os.path.abspath(__file__), *argv], timeout_s=args.timeout + 60
    )
    if os.path.exists(args.json) and os.path.getsize(args.json):
        with open(args.json) as f:
            report(args, json.load(f))
    if temporary is not None:
        os.unlink(args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
