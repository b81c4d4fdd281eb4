"""Every technique on its defaults against dense, on two transformer LMs and the digits MLP.

Quality at equal steps, on 8 CPU devices in one process (the quality of a
method does not depend on the network, only its speed does; for wall time on
shaped links see ``bench/time_to_quality.py``). Runs the examples' own
programs, one per model, with every configuration at its defaults:

- ``lm``: ``examples/lm/main.py`` as it is (2 blocks of width 128, AdamW 3e-3,
  300 steps); validation loss, lower is better;
- ``lm-w96``: the same program on another transformer (3 blocks of width 96,
  AdamW 2e-3);
- ``digits``: ``examples/digits/main.py`` (an MLP, momentum SGD); test accuracy.

and prints, per model and configuration, the mean quality over the seeds,
its change against dense (per seed against the same seed's dense, then the
mean and the range over seeds), the bytes sent per step against dense's,
and whether the change is within 2% (3%) of dense's loss. ``--markdown``
prints the same as Markdown tables (docs/lm.md holds them).

    python bench/quality.py --json quality.json            # every model, 3 seeds: hours
    python bench/quality.py --models lm --seeds 0 --configs dense,powersgd --steps 30
    python bench/quality.py --from-json quality.json --markdown
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# model -> (program, its extra arguments, the configurations run by default).
LM_CONFIGS = (
    "dense,bf16,fp16+ef,int8+ef,int4+ef,fp16+db,fp16+dga,csc,csc+fp8,powersgd,diloco,"
    "diloco+delay,sparseloco"
)
MODELS = {
    "lm": ("examples/lm/main.py", [], LM_CONFIGS),
    "lm-w96": (
        "examples/lm/main.py",
        ["--layers", "3", "--width", "96", "--lr", "2e-3"],
        LM_CONFIGS,
    ),
    "digits": ("examples/digits/main.py", [], "dense,fp16,fp16+db,fp16+dga,csc"),
}
BASELINE = "dense"
TARGETS = (0.02, 0.03)  # relative validation loss against dense (the LMs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default=",".join(MODELS), help=", ".join(MODELS))
    p.add_argument(
        "--configs",
        help="run only these of each model's configurations (dense is always run)",
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, help="LM steps (default: the example's, 300)")
    p.add_argument("--json", help="write every model's results here")
    p.add_argument(
        "--out-dir",
        help="where the examples write their JSON and plots, run by run (default: a "
        "temporary directory); each model's runs so far survive a stopped job there",
    )
    p.add_argument(
        "--from-json",
        help="no run: the tables from this file, or from several (comma-separated: their "
        "configurations merged per model, dense checked to be the same runs)",
    )
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = p.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    for model in args.model_list:
        if model not in MODELS:
            p.error(f"--models: unknown {model!r}; choose from {', '.join(MODELS)}")
    if args.configs:
        known = {c for model in args.model_list for c in MODELS[model][2].split(",")}
        unknown = [c for c in args.configs.split(",") if c and c not in known]
        if unknown:
            p.error(f"--configs: {unknown} are none of {args.models}'s: {sorted(known)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: comma-separated integers")
    return args


def say(message: str):
    print(f"quality: {message}", file=sys.stderr, flush=True)


def configs_for(args, model: str) -> list[str]:
    """Dense, then the model's configurations (those of --configs among them)."""
    configs = MODELS[model][2].split(",")
    if args.configs:
        configs = [c for c in configs if c in args.configs.split(",")]
    return [BASELINE] + [c for c in configs if c != BASELINE]


def run_model(args, model: str, directory: str) -> dict:
    """The example's JSON after running it with this model's configurations."""
    program, extra, _ = MODELS[model]
    argv = [sys.executable, os.path.join(REPO, program), *extra]
    argv += ["--configs", ",".join(configs_for(args, model)), "--seeds", args.seeds]
    if model == "digits":
        argv += ["--json", os.path.join(directory, "digits.json"), "--plot", ""]
        argv += ["--no-progress"]
        path = os.path.join(directory, "digits.json")
    else:
        if args.steps is not None:
            argv += ["--steps", str(args.steps)]
        argv += ["--out", directory, "--tag", model, "--no-progress"]
        path = os.path.join(directory, f"{model}.json")
    say(f"{model}: {' '.join(argv[1:])}")
    started = time.monotonic()
    subprocess.run(argv, check=True, cwd=REPO)
    say(f"{model}: {time.monotonic() - started:.0f} s")
    with open(path) as f:
        return json.load(f)


def lm_rows(result: dict) -> list[dict]:
    """Per configuration: final validation loss per seed, its change against
    the same seed's dense, and the bytes against dense's."""
    finals = {k: [curve[-1] for curve in v] for k, v in result["val_losses"].items()}
    if BASELINE not in finals:
        raise ValueError(f"no {BASELINE!r} run to compare with: {sorted(finals)}")
    bytes_ratio = {r["config"]: r["bytes_ratio"] for r in result["rows"]}
    rows = []
    for config, losses in finals.items():
        # The seeds both ran (a stopped job may hold fewer of some): the
        # runs go seed by seed in the same order.
        losses = losses[: len(finals[BASELINE])]
        changes = [v / d - 1 for v, d in zip(losses, finals[BASELINE], strict=False)]
        rows.append(
            {
                "config": config,
                "seeds": len(losses),
                "quality": statistics.fmean(losses),
                "dense_quality": statistics.fmean(finals[BASELINE][: len(losses)]),
                "change": statistics.fmean(changes),
                "change_min": min(changes),
                "change_max": max(changes),
                "bytes_ratio": bytes_ratio.get(config),
            }
        )
    return rows


def verdict(change: float) -> str:
    for target in TARGETS:
        if change <= target:
            return f"within {100 * target:.0f}%"
    return "above 3%"


def digits_rows(result: dict) -> list[dict]:
    """Per configuration: mean test accuracy (and its sd over seeds), and
    the change in points against dense's."""
    rows = {r["config"]: r for r in result["rows"]}
    if BASELINE not in rows:
        raise ValueError(f"no {BASELINE!r} run to compare with: {sorted(rows)}")
    base = rows[BASELINE]["accuracy_pct"]
    return [
        {
            "config": c,
            "quality": r["accuracy_pct"],
            "sd": r["accuracy_sd"],
            "change_points": r["accuracy_pct"] - base,
            "bytes_ratio": r["bytes_ratio"],
        }
        for c, r in rows.items()
    ]


def report(results: dict, markdown: bool) -> None:
    for model, result in results.items():
        seeds = result["args"].get("seeds")
        if model == "digits":
            rows = digits_rows(result)
            head = ["config", "test accuracy %", "vs dense, points", "bytes x dense"]
            cells = [
                [
                    r["config"],
                    f"{r['quality']:.2f} ± {r['sd']:.2f}",
                    f"{r['change_points']:+.2f}",
                    f"{r['bytes_ratio']:.3f}",
                ]
                for r in rows
            ]
        else:
            rows = lm_rows(result)
            head = [
                "config",
                "seeds",
                "val loss",
                "dense's",
                "vs dense",
                "per seed",
                "bytes x dense",
                "",
            ]
            cells = [
                [
                    r["config"],
                    str(r["seeds"]),
                    f"{r['quality']:.4f}",
                    f"{r['dense_quality']:.4f}",
                    f"{100 * r['change']:+.1f}%",
                    f"{100 * r['change_min']:+.1f}% .. {100 * r['change_max']:+.1f}%",
                    "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}",
                    "" if r["config"] == BASELINE else verdict(r["change"]),
                ]
                for r in rows
            ]
        print(f"\n{model}, seeds {seeds}")
        if markdown:
            print("| " + " | ".join(head) + " |")
            print("|" + "|".join("---" if i == 0 else "--:" for i in range(len(head))) + "|")
            for row in cells:
                print("| " + " | ".join([f"`{row[0]}`", *row[1:]]) + " |")
        else:
            widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
            print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
            for row in cells:
                print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def merged(parts: list[tuple[str, dict]]) -> dict:
    """Several runs' results (name, JSON) as one: per model, every file's
    configurations, the later file's where two ran the same one. Dense must
    be the same runs in each (its final losses or accuracy equal to 1e-4),
    or the changes against it would mix two baselines."""
    out: dict = {}
    for name, part in parts:
        for model, result in part.items():
            if model not in out:
                out[model] = copy.deepcopy(result)
                continue
            have = out[model]
            if not _same(_dense_finals(have), _dense_finals(result)):
                raise ValueError(
                    f"{name}: {model}'s dense differs from the earlier file's "
                    f"({_dense_finals(result)} against {_dense_finals(have)}): not the same runs"
                )
            if "val_losses" in result:
                have["val_losses"].update(result["val_losses"])
            rows = {r["config"]: r for r in have["rows"]}
            rows.update({r["config"]: r for r in result["rows"]})
            have["rows"] = list(rows.values())
    return out


def _dense_finals(result: dict) -> list[float]:
    """Dense's final loss per seed (an LM) or its mean accuracy (digits)."""
    if "val_losses" in result:
        return [curve[-1] for curve in result["val_losses"].get(BASELINE, [])]
    return [r["accuracy_pct"] for r in result["rows"] if r["config"] == BASELINE]


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lengths and values within 1e-4 relative."""
    return len(a) == len(b) and all(
        abs(x - y) <= 1e-4 * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True)
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        parts = []
        for path in args.from_json.split(","):
            with open(path) as f:
                parts.append((path, json.load(f)))
        results = merged(parts)
    else:
        results = {}
        with tempfile.TemporaryDirectory() as scratch:
            directory = args.out_dir or scratch
            os.makedirs(directory, exist_ok=True)
            for model in args.model_list:
                results[model] = run_model(args, model, directory)
                if args.json:  # after each model, so a stopped run keeps the others
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
    report(results, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
