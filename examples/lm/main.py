"""Compare jaxcomm configurations on a byte-level language model over 8 CPU devices.

Trains the same small transformer on the Python standard library's source
once per configuration and seed, then prints the final validation loss
(nats per byte) with its change against dense, step time and bytes on the
wire per step and device, and plots validation loss against step.

Usage::

    python examples/lm/main.py
    python examples/lm/main.py --configs dense,db,db+dc --seeds 0,1 --steps 300
    python examples/lm/main.py --configs csc --density 0.3 --chunk-size 4096
    python examples/lm/main.py --fsdp 4 --configs dense,bf16,fp16+ef,csc  # a sharded model
"""

from __future__ import annotations

import os

# Must happen before jax is imported: the CPU device count is fixed at startup.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import train  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
DEFAULT_CONFIGS = "dense,bf16,fp16,fp16+ef,db,fp16+db,csc"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated, from: {', '.join(train.CONFIGURATIONS)}",
    )
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (losses are their mean)")
    p.add_argument("--steps", type=int, default=train.Run.steps)
    p.add_argument("--batch-per-device", type=int, default=train.Run.batch_per_device)
    p.add_argument("--lr", type=float, default=train.Run.lr, help="AdamW learning rate")
    p.add_argument("--b1", type=float, default=train.Run.b1, help="AdamW's β1 (momentum)")
    p.add_argument("--lr-warmup", type=int, default=0, help="linear lr warm-up steps")
    p.add_argument("--layers", type=int, default=train.Run.layers, help="transformer blocks")
    p.add_argument("--width", type=int, default=train.Run.width, help="model width")
    p.add_argument("--heads", type=int, default=train.Run.heads, help="attention heads")
    p.add_argument("--eval-every", type=int, default=train.Run.eval_every)
    p.add_argument("--density", type=float, default=None, help="override 'csc' density")
    p.add_argument("--chunk-size", type=int, default=None, help="override 'csc' chunk size")
    p.add_argument("--warmup-steps", type=int, default=None, help="override 'csc' warm-up")
    p.add_argument(
        "--residual-decay", type=float, default=None, help="override 'csc' residual decay"
    )
    p.add_argument("--dc", type=float, default=None, help="override 'db+dc' strength λ")
    p.add_argument("--rank", type=int, default=None, help="override 'powersgd' rank")
    p.add_argument(
        "--sync-every", type=int, default=None, help="override DiLoCo's H (diloco, sparseloco)"
    )
    p.add_argument(
        "--sparse-density", type=float, default=None, help="override 'sparseloco' density"
    )
    p.add_argument(
        "--outer-lr", type=float, default=None, help="override DiLoCo's outer learning rate"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="override DiLoCo's outer Nesterov momentum (0: none; with --outer-lr 1, "
        "plain averaging)",
    )
    p.add_argument("--train-bytes", type=int, default=data.TRAIN_BYTES)
    p.add_argument("--val-bytes", type=int, default=data.VAL_BYTES)
    p.add_argument("--out", default=OUT, help="directory of the PNG and JSON ('' for none)")
    p.add_argument("--tag", default="lm", help="file name stem in --out")
    p.add_argument(
        "--fsdp",
        type=int,
        default=1,
        help="shard the model over this many devices (docs/sharded.md); jaxcomm reduces "
        "over the rest",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars or lines")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in train.CONFIGURATIONS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {list(train.CONFIGURATIONS)}")
    if args.density is not None and not 0 < args.density <= 1:
        p.error(f"--density {args.density} must be in (0, 1]")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def comm_for(name: str, args) -> train.Comm:
    """The named configuration with the command line's overrides."""
    comm = train.CONFIGURATIONS[name]
    overrides = {}
    if comm.density is not None:
        for field, value in (
            ("density", args.density),
            ("chunk_size", args.chunk_size),
            ("warmup_steps", args.warmup_steps),
            ("residual_decay", args.residual_decay),
        ):
            if value is not None:
                overrides[field] = value
    if comm.delay_compensation is not None and args.dc is not None:
        overrides["delay_compensation"] = args.dc
    if comm.powersgd and args.rank is not None:
        overrides["powersgd_rank"] = args.rank
    if comm.sync_every is not None and args.sync_every is not None:
        overrides["sync_every"] = args.sync_every
    if comm.sparse_density is not None and args.sparse_density is not None:
        overrides["sparse_density"] = args.sparse_density
    if comm.sync_every is not None and comm.sparse_density is None:
        for field in ("outer_lr", "outer_momentum"):
            if getattr(args, field) is not None:
                overrides[field] = getattr(args, field)
    return dataclasses.replace(comm, **overrides)


def run_all(args, on_result=None) -> dict:
    """{config: [result per seed]}, with a progress bar (or line) per run.

    Seeds are the outer loop, so a run stopped early has every configuration
    at the first seeds. ``on_result(results)`` is called after each run.
    """
    corpus = data.load_corpus(train_bytes=args.train_bytes, val_bytes=args.val_bytes)
    print(
        f"corpus: {len(corpus.train_files)} training files, {len(corpus.val_files)} held out "
        f"({', '.join(corpus.val_files)}); sha256 {corpus.fingerprint()}",
        flush=True,
    )
    results = {}
    for seed in args.seeds:
        for name in args.configs:
            run = train.Run(
                comm=comm_for(name, args),
                seed=seed,
                steps=args.steps,
                batch_per_device=args.batch_per_device,
                lr=args.lr,
                b1=args.b1,
                lr_warmup=args.lr_warmup,
                layers=args.layers,
                width=args.width,
                heads=args.heads,
                eval_every=args.eval_every,
                train_bytes=args.train_bytes,
                val_bytes=args.val_bytes,
                fsdp=args.fsdp,
            )
            with _progress(f"{name} seed {seed}", args.no_progress) as update:
                result = train.train(run, progress=update, corpus=corpus)
            results.setdefault(name, []).append(result)
            print(
                f"{name} seed {seed}: val loss {result['val_loss']:.4f}, {result['wall_s']:.1f} s",
                flush=True,
            )
            if on_result is not None:
                on_result(results)
    return results


class _progress:
    """A tqdm bar when tqdm is installed, else a line every 50 steps; or nothing."""

    def __init__(self, label: str, off: bool):
        self.label, self.off, self.bar = label, off, None

    def __enter__(self):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None

        def update(step, total, loss):
            if self.off:
                return
            if tqdm is None:
                if step % 50 == 0 or step == total:
                    print(f"{self.label}: step {step}/{total} loss {loss:.3f}", flush=True)
                return
            if self.bar is None:
                self.bar = tqdm(total=total, desc=f"{self.label:<18}", leave=False)
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        return update

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def summarize(results: dict) -> list[dict]:
    rows = []
    for name, runs in results.items():
        val = np.array([r["val_loss"] for r in runs])
        rows.append(
            {
                "config": name,
                "val_loss": float(val.mean()),
                "val_loss_sd": float(val.std()),
                "step_ms": 1e3 * float(np.mean([r["step_time_s"] for r in runs])),
                "wall_s": float(np.mean([r["wall_s"] for r in runs])),
                "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in runs])),
            }
        )
    base = next((r for r in rows if r["config"] == "dense"), rows[0])
    for r in rows:
        r["val_loss_change"] = r["val_loss"] / base["val_loss"] - 1
        r["bytes_ratio"] = r["bytes_per_step"] / base["bytes_per_step"]
    return rows


def print_table(rows, seeds, n_devices, params, fsdp: int = 1) -> None:
    base = "dense" if any(r["config"] == "dense" for r in rows) else rows[0]["config"]
    layout = f" (model sharded over {fsdp}, data parallel over {n_devices // fsdp})"
    print(
        f"\n{n_devices} devices{layout if fsdp > 1 else ''}, {params:,} parameters, "
        f"mean over seeds {seeds}; changes against '{base}'"
    )
    w = max(10, *(len(r["config"]) + 1 for r in rows))  # diloco+delay is 12 wide
    head = (
        f"{'config':<{w}}{'val loss':>16}{'change':>9}{'step ms':>9}{'run s':>8}"
        f"{'bytes/step/dev':>16}{'bytes x':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        val = f"{r['val_loss']:.4f}±{r['val_loss_sd']:.4f}"
        print(
            f"{r['config']:<{w}}{val:>16}{100 * r['val_loss_change']:>+8.1f}%"
            f"{r['step_ms']:>9.1f}{r['wall_s']:>8.1f}"
            f"{r['bytes_per_step']:>16,.0f}{r['bytes_ratio']:>9.3f}"
        )
    print(
        "val loss: next-byte cross-entropy (nats) on fixed held-out windows after the last "
        "step; bytes/step/dev from jaxcomm.get_stats; run s includes compilation."
    )


def y_limits(curves: dict) -> tuple[float, float]:
    """From the lowest point to the untrained model's loss (every curve's
    first point), with a margin: the first points show, and a run that
    diverges above where it started goes off the top instead of squashing
    the others."""
    values = np.concatenate([np.asarray(c, float) for c in curves.values()])
    values = values[np.isfinite(values)]
    start = [float(c[0]) for c in curves.values() if np.isfinite(c[0])]
    lo, hi = float(values.min()), max(start, default=float(values.max()))
    pad = 0.04 * (hi - lo) if hi > lo else 0.1
    return lo - pad, hi + pad


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'jaxcomm[examples]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = {}
    for name, runs in results.items():
        curves[name] = np.mean([r["val_losses"] for r in runs], axis=0)
        ax.plot(runs[0]["val_steps"], curves[name], marker="o", ms=3, label=name, lw=1.2)
    ax.set(xlabel="step", ylabel="validation loss, nats/byte (mean over seeds)")
    ax.set_ylim(*y_limits(curves))
    ax.set_title("byte transformer on the stdlib, data-parallel over 8 CPU devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"validation curves: {path}")


def write_json(args, results: dict) -> str:
    """Every run so far (rewritten after each, so a stopped job keeps them)."""
    os.makedirs(args.out, exist_ok=True)
    out = {
        "args": vars(args),
        "rows": summarize(results),
        "val_steps": {k: v[0]["val_steps"] for k, v in results.items()},
        "val_losses": {k: [r["val_losses"] for r in v] for k, v in results.items()},
        "losses": {k: [r["losses"] for r in v] for k, v in results.items()},
        "wall_s": {k: [r["wall_s"] for r in v] for k, v in results.items()},
    }
    path = os.path.join(args.out, f"{args.tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    results = run_all(args, on_result=(lambda r: write_json(args, r)) if args.out else None)
    rows = summarize(results)
    params = next(iter(results.values()))[0]["params"]
    print_table(rows, args.seeds, jax.device_count(), params, args.fsdp)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.out:
        plot(results, os.path.join(args.out, f"{args.tag}.png"))
        print(f"results: {write_json(args, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
