"""Compare jaxcomm configurations on a data-parallel Flax run over 8 CPU devices.

Trains the same MLP on scikit-learn's digits once per configuration and seed,
then prints test accuracy, step time and bytes on the wire per step and
device, with ratios against dense FP32, and plots the loss curves into
``examples/digits/out/`` (git ignores it; ``--out-dir`` moves it).

Usage::

    python examples/digits/main.py
    python examples/digits/main.py --configs dense,csc --density 0.15 --seeds 0,1,2
    python examples/digits/main.py --pmap --configs dense,fp16+db

The README's digits table is generated from this program's ``--json``
output by ``examples/digits/readme.py`` (see there), not typed in.

Reading the plot: ``fp16``, ``fused`` and ``hierarchical`` train like
``dense`` (the mean loss of fused and hierarchical differs from dense's by
float32 rounding, 1e-9 to 1e-7; fp16's by 1e-6 to 1e-3), so the upper panel
shows them on top of each other; the lower panel shows each one's distance
from dense on a log scale.

``fp16+db`` spikes (to a loss of about 2 near step 35, then recovers): that
is double buffering, not the float16 wire. It applies step t-1's gradient at
step t, and a one-step-stale gradient under momentum 0.9 and lr 0.05
(effective step 0.5) is stable only up to about half the curvature that the
same optimizer with a fresh gradient tolerates. As the loss sharpens early
in training it crosses that limit and the loss jumps; dense stays below its
own. Double buffering over a float32 wire spikes the same way (to 2.15 in
steps 25-60 for both, seed 0); with a smaller step (lr 0.02, or momentum
0.8) there is no spike in the first 66 steps, but the start is slower:
stale gradients want a smaller learning rate than fresh ones.
``fp16+dga`` (``jaxcomm.double_buffered``) overlaps the same exchange with
each gradient taken where it will be applied, and does not spike.
"""

from __future__ import annotations

import os

# Must happen before jax is imported: the CPU device count is fixed at startup.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402

OUT_DIR = pathlib.Path(__file__).resolve().parent / "out"  # in .gitignore


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        default="dense,fp16,fp16+db,fp16+dga,fused,hierarchical,csc",
        help="comma-separated: dense, fp16, fp16+db, fp16+dga, fused, hierarchical, csc",
    )
    p.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds (accuracy is their mean)"
    )
    p.add_argument("--epochs", type=int, default=train.Run.epochs)
    p.add_argument("--batch", type=int, default=train.Run.batch, help="global batch size")
    p.add_argument("--lr", type=float, default=train.Run.lr)
    p.add_argument("--bucket-bytes", type=float, default=16384, help="fusion threshold of 'fused'")
    p.add_argument("--density", type=float, default=0.15, help="chunk-sparse density of 'csc'")
    p.add_argument("--warmup-steps", type=int, default=40, help="chunk-sparse warm-up of 'csc'")
    p.add_argument("--pmap", action="store_true", help="jax.pmap instead of jit + shard_map")
    p.add_argument(
        "--out-dir",
        default=str(OUT_DIR),
        help="where --plot and --json go unless they are absolute (default: beside this "
        "script, ignored by git)",
    )
    p.add_argument("--plot", default="digits_loss.png", help="PNG of the loss curves ('' for none)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    known = train.configurations(bucket_bytes=1, density=0.5, warmup_steps=0)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in known]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {sorted(known)}")
    if args.pmap and "hierarchical" in args.configs:
        p.error("'hierarchical' needs a 2-D mesh: run it without --pmap")
    if not 0 < args.density <= 1:
        p.error(f"--density {args.density} must be in (0, 1]")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def run_all(args) -> dict:
    """{config: [result per seed]}, with a progress bar per run."""
    comms = train.configurations(
        bucket_bytes=args.bucket_bytes, density=args.density, warmup_steps=args.warmup_steps
    )
    results = {}
    for name in args.configs:
        for seed in args.seeds:
            run = train.Run(
                comm=comms[name],
                seed=seed,
                epochs=args.epochs,
                batch=args.batch,
                lr=args.lr,
                use_pmap=args.pmap,
            )
            with _progress(f"{name} seed {seed}", args.no_progress) as update:
                results.setdefault(name, []).append(train.train(run, progress=update))
    return results


class _progress:
    """A tqdm bar when tqdm is installed and wanted; otherwise nothing."""

    def __init__(self, label: str, off: bool):
        self.label, self.off, self.bar = label, off, None

    def __enter__(self):
        def update(step, total, loss):
            if self.off:
                return
            if self.bar is None:
                try:
                    from tqdm import tqdm
                except ImportError:
                    self.off = True
                    return
                self.bar = tqdm(total=total, desc=f"{self.label:<22}", leave=False)
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        return update

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def summarize(results: dict) -> list[dict]:
    rows = []
    for name, runs in results.items():
        acc = np.array([r["test_accuracy"] for r in runs]) * 100
        rows.append(
            {
                "config": name,
                "accuracy_pct": float(acc.mean()),
                "accuracy_sd": float(acc.std()),
                "step_ms": 1e3 * float(np.mean([r["step_time_s"] for r in runs])),
                "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in runs])),
            }
        )
    base = next((r for r in rows if r["config"] == "dense"), rows[0])
    for r in rows:
        r["accuracy_delta"] = r["accuracy_pct"] - base["accuracy_pct"]
        r["time_ratio"] = r["step_ms"] / base["step_ms"]
        r["bytes_ratio"] = r["bytes_per_step"] / base["bytes_per_step"]
    return rows


def print_table(rows, seeds, n_devices) -> None:
    print(
        f"\n{n_devices} devices, mean over seeds {seeds}; ratios against "
        f"'{rows[0]['config'] if not any(r['config'] == 'dense' for r in rows) else 'dense'}'"
    )
    head = (
        f"{'config':<14}{'test acc %':>13}{'Δ acc':>8}{'step ms':>9}{'time x':>8}"
        f"{'bytes/step/dev':>16}{'bytes x':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r['accuracy_pct']:.2f}±{r['accuracy_sd']:.2f}"
        print(
            f"{r['config']:<14}{acc:>13}{r['accuracy_delta']:>+8.2f}{r['step_ms']:>9.2f}"
            f"{r['time_ratio']:>8.2f}{r['bytes_per_step']:>16,.0f}{r['bytes_ratio']:>9.3f}"
        )
    print(
        "bytes/step/dev: what each device sends per step under a bandwidth-optimal schedule "
        "(jaxcomm.get_stats); step times on CPU devices measure overhead, not a network."
    )


def output_path(out_dir: str, name: str) -> pathlib.Path:
    """``name`` under ``out_dir`` (an absolute ``name`` stays), its directory made."""
    path = pathlib.Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.resolve()


# Distinct at a glance in print and for colour-blind readers: configurations
# that train alike lie on each other, so line style and marker tell them apart.
STYLES = {
    "dense": dict(color="black", lw=2.4, alpha=0.35),
    "fp16": dict(color="tab:orange", ls="--", marker="o"),
    "fp16+db": dict(color="tab:green", ls="-", marker=None),
    "fp16+dga": dict(color="tab:olive", ls="-", marker=None),
    "fused": dict(color="tab:red", ls=":", marker="s"),
    "hierarchical": dict(color="tab:purple", ls="-.", marker="^"),
    "csc": dict(color="tab:brown", ls="-", marker="D"),
}


def loss_curves(results: dict) -> dict:
    """{config: per-step loss, mean over seeds}."""
    return {name: np.mean([r["losses"] for r in runs], axis=0) for name, runs in results.items()}


def distance_from(curves: dict, base: str) -> dict:
    """{config: |loss - base's loss| per step} for every other config; NaN
    where they are equal (nothing to draw on a log scale)."""
    ref = curves[base]
    return {
        name: np.where(c == ref, np.nan, np.abs(c - ref))
        for name, c in curves.items()
        if name != base
    }


def plot(results: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'jaxcomm[examples]')")
        return
    curves = loss_curves(results)
    base = "dense" if "dense" in curves else next(iter(curves))
    steps = np.arange(1, len(curves[base]) + 1)
    every = max(1, len(steps) // 12)

    def marks(name):  # markers of different configs at different steps
        return (list(STYLES).index(name) * every // len(STYLES) if name in STYLES else 0, every)

    panels = 2 if len(curves) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.2 * panels + 0.6), sharex=True, squeeze=False)
    top = axes[0, 0]
    for name, curve in curves.items():
        style = dict(STYLES.get(name, {}))
        style.setdefault("lw", 1.2)
        top.plot(steps, curve, label=name, markevery=marks(name), ms=4, **style)
    top.set(ylabel="training loss (mean over seeds)", yscale="log")
    top.set_title("digits MLP, data-parallel over 8 CPU devices")
    top.legend(ncol=2, fontsize="small")
    if panels == 2:
        bottom = axes[1, 0]
        for name, gap in distance_from(curves, base).items():
            style = dict(STYLES.get(name, {}), lw=1.0)
            label = name if np.isfinite(gap).any() else f"{name} (equal to {base})"
            bottom.plot(steps, gap, label=label, markevery=marks(name), ms=4, **style)
        bottom.set(ylabel=f"|loss - {base} loss|", yscale="log")
        bottom.legend(ncol=2, fontsize="small")
    axes[-1, 0].set(xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_all(args)
    rows = summarize(results)
    print_table(rows, args.seeds, jax.device_count())
    if args.json:
        out = {
            "args": {k: v for k, v in vars(args).items()},
            "rows": rows,
            "losses": {k: [r["losses"] for r in v] for k, v in results.items()},
        }
        path = output_path(args.out_dir, args.json)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"results: {path}")
    if args.plot:
        plot(results, output_path(args.out_dir, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
