"""Predicted data-parallel scaling of AlexNet-BN and ResNet-50 from jaxcomm's cost model.

Nothing here runs on a GPU: the step of every configuration is simulated with
``jaxcomm.costmodel.simulate`` on model profiles derived from the Flax
definitions in ``jaxcomm.costmodel.profiles``. The inputs are those of
the GradientFlow paper's evaluation (scenario 1) and of a commodity Ethernet
cluster (scenario 2):

Scenario 1 (``--json PATH``): clusters of nodes of 8 GPUs on two PCIe switches
of 4, 56 Gbps InfiniBand between nodes (``pcie_infiniband``): ``pascal128``
(16 nodes) and ``volta512`` (64 nodes), per-GPU batch 128, one-GPU throughputs
(images/s, FP32 / mixed precision) AlexNet 1.7K / 1.9K and ResNet-50 172 / 223
on Pascal, AlexNet 2.9K / 3.7K and ResNet-50 301 / 621 on Volta. Every
configuration uses NCCL 2's flat ring across all GPUs:

  nccl                     FP32 compute and wire, one allreduce per tensor after backward
  nccl+mp                  mixed precision compute, FP16 wire
  nccl+mp+overlap          ... each tensor's allreduce starts when its gradient exists
  nccl+mp+la+overlap       ... lazy allreduce: buckets of >= θ bytes, best θ of 0, 64K..256M, inf
  nccl+mp+la+csc+overlap   ... chunk-sparse exchange of 15% of the chunks (best θ again)

The JSON is ``{model: {cluster: {configuration: images_per_second}}}`` with
models ``alexnet``, ``resnet50`` and clusters ``pascal128``, ``volta512``.

Scenario 2 (written to ``<PATH stem>_ethernet.json``): 1 to 4 nodes of 8 V100
(NVLink inside a node) on 25 Gbps Ethernet (``nvlink_ethernet``), ResNet-50 at
batch 64 per GPU, FP32 compute at Volta's 301 images/s (GradientFlow's
number at batch 128, assumed to hold at 64). As in ChainerMN all gradients go in one
packed allreduce after backward (θ = inf, flat ring), configurations ``fp32``,
``fp16`` (FP16 wire), ``fp32+db`` and ``fp16+db`` (double buffering). Layout:
``{"resnet50": {gpus: {configuration: {"images_per_second", "scaling_efficiency"}}}}``
with ``gpus`` in ``"8"``, ``"16"``, ``"24"``, ``"32"``.

Plots (matplotlib, skipped with a message without it): ``<stem>.png``, predicted
images/s against GPUs (1 to all nodes) per configuration for each model and
cluster, and ``<stem>_ethernet.png``, scaling efficiency against GPUs.

Usage::

  python bench/scaling.py --json /tmp/scaling.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

from _common import pyplot

from jaxcomm.costmodel import (
    Settings,
    alexnet_bn,
    nvlink_ethernet,
    pcie_infiniband,
    plan,
    resnet50,
    simulate,
)

BATCH = 128
CSC_DENSITY = 0.15
THETAS = (0.0, *(float(1 << k) for k in range(16, 29)), math.inf)  # 0, 64 KiB .. 256 MiB, inf
PROFILES = {"alexnet": alexnet_bn, "resnet50": resnet50}
CLUSTER_NODES = {"pascal128": 16, "volta512": 64}
# One-GPU images/s (FP32, mixed precision), as in the GradientFlow paper.
ONE_GPU = {
    "pascal128": {"alexnet": (1700.0, 1900.0), "resnet50": (172.0, 223.0)},
    "volta512": {"alexnet": (2900.0, 3700.0), "resnet50": (301.0, 621.0)},
}
CONFIGS = {  # name: (mixed precision, overlap, lazy allreduce, density)
    "nccl": (False, False, False, 1.0),
    "nccl+mp": (True, False, False, 1.0),
    "nccl+mp+overlap": (True, True, False, 1.0),
    "nccl+mp+la+overlap": (True, True, True, 1.0),
    "nccl+mp+la+csc+overlap": (True, True, True, CSC_DENSITY),
}

ETHERNET_BATCH = 64
ETHERNET_ONE_GPU = 301.0  # V100 ResNet-50 FP32 images/s (GradientFlow's, at batch 128)
ETHERNET_NODES = (1, 2, 3, 4)
ETHERNET_CONFIGS = {  # name: (wire dtype, double buffering)
    "fp32": ("float32", False),
    "fp16": ("float16", False),
    "fp32+db": ("float32", True),
    "fp16+db": ("float16", True),
}


def run_config(model: str, cluster_name: str, config: str, nodes: int):
    """Simulates one configuration; returns (result, θ) with θ the best threshold searched."""
    mixed, overlap, lazy, density = CONFIGS[config]
    images_per_second = ONE_GPU[cluster_name][model][mixed]
    workload = PROFILES[model]().workload(images_per_second=images_per_second, batch=BATCH)
    cluster = pcie_infiniband(nodes=nodes)
    results = []
    for theta in THETAS if lazy else (0.0,):
        settings = Settings(
            wire_dtype="float16" if mixed else "float32",
            bucket_bytes=theta,
            overlap=overlap,
            density=density,
            algorithm="ring",
        )
        results.append((simulate(workload, cluster, settings), theta))
    return min(results, key=lambda rt: rt[0].iteration_time)


def scenario_one():
    """{model: {cluster: {config: (result, θ)}}} at the full cluster sizes."""
    return {
        model: {
            name: {config: run_config(model, name, config, nodes) for config in CONFIGS}
            for name, nodes in CLUSTER_NODES.items()
        }
        for model in PROFILES
    }


def scenario_two():
    """{gpus: {config: result}} for ResNet-50 on NVLink nodes and 25 Gbps Ethernet."""
    workload = resnet50().workload(images_per_second=ETHERNET_ONE_GPU, batch=ETHERNET_BATCH)
    table = {}
    for nodes in ETHERNET_NODES:
        cluster = nvlink_ethernet(nodes=nodes)
        row = {}
        for config, (wire, double_buffering) in ETHERNET_CONFIGS.items():
            settings = Settings(
                wire_dtype=wire,
                bucket_bytes=math.inf,
                overlap=False,
                double_buffering=double_buffering,
            )
            row[config] = simulate(workload, cluster, settings)
        table[cluster.p] = row
    return table


def print_scenario_one(results) -> None:
    print("# Scenario 1: 8 GPUs/node on two PCIe switches of 4, 56 Gbps InfiniBand, batch 128")
    print("# images/s (scaling efficiency; best theta for la)")
    for model, clusters in results.items():
        for name, configs in clusters.items():
            one = ONE_GPU[name][model]
            print(f"\n{model} on {name} (one GPU: {one[0]:g} FP32, {one[1]:g} mixed precision)")
            for config, (r, theta) in configs.items():
                extra = f"  theta={_size(theta)}" if CONFIGS[config][2] else ""
                print(
                    f"  {config:<24} {r.throughput:>11,.0f} img/s  "
                    f"({r.scaling_efficiency:6.1%}){extra}"
                )


def print_plans() -> None:
    print("\n# What jaxcomm.plan recommends (mixed precision, overlap; not in the JSON)")
    for model in PROFILES:
        for name, nodes in CLUSTER_NODES.items():
            one = ONE_GPU[name][model][1]
            workload = PROFILES[model]().workload(images_per_second=one, batch=BATCH)
            p = plan(workload, pcie_infiniband(nodes=nodes), bucket_bytes=THETAS)
            print(
                f"  {model:<9} {name:<10} theta={_size(p.bucket_bytes):<9} "
                f"{p.algorithm:<13} {p.wire_dtype:<9} "
                f"{workload.batch * p.cluster.p / p.result.iteration_time:>11,.0f} img/s "
                f"({p.result.scaling_efficiency:.1%})"
            )


def print_scenario_two(table) -> None:
    print("\n# Scenario 2: ResNet-50, batch 64, 8 x V100 (NVLink) per node, 25 Gbps Ethernet")
    print("# scaling efficiency (images/s)")
    print("  GPUs " + "".join(f"{c:>22}" for c in ETHERNET_CONFIGS))
    for gpus, row in table.items():
        cells = "".join(
            f"{r.scaling_efficiency:>9.1%} ({r.throughput:>8,.0f})" for r in row.values()
        )
        print(f"  {gpus:>4} {cells}")


def write_json(path: pathlib.Path, one, two) -> pathlib.Path:
    data = {
        model: {
            name: {config: round(r.throughput, 1) for config, (r, _) in configs.items()}
            for name, configs in clusters.items()
        }
        for model, clusters in one.items()
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    ethernet = path.with_name(path.stem + "_ethernet.json")
    rows = {
        str(gpus): {
            config: {
                "images_per_second": round(r.throughput, 1),
                "scaling_efficiency": round(r.scaling_efficiency, 4),
            }
            for config, r in row.items()
        }
        for gpus, row in two.items()
    }
    ethernet.write_text(json.dumps({"resnet50": rows}, indent=2) + "\n")
    return ethernet


def write_plots(path: pathlib.Path, two) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for row, model in enumerate(PROFILES):
        for col, (name, max_nodes) in enumerate(CLUSTER_NODES.items()):
            ax = axes[row][col]
            nodes = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_nodes]
            gpus = [8 * n for n in nodes]
            for config in CONFIGS:
                ips = [run_config(model, name, config, n)[0].throughput for n in nodes]
                ax.plot(gpus, ips, marker="o", label=config)
            ideal = ONE_GPU[name][model][1]
            ax.plot(gpus, [ideal * g for g in gpus], "k--", lw=1, label="ideal (mixed precision)")
            ax.set(xscale="log", yscale="log", title=f"{model} on {name}", xlabel="GPUs")
            ax.set_ylabel("predicted images/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    gpus = list(two)
    for config in ETHERNET_CONFIGS:
        ax.plot(gpus, [two[g][config].scaling_efficiency for g in gpus], marker="o", label=config)
    ax.set(
        xlabel="GPUs (8 per node)",
        ylabel="scaling efficiency",
        title="ResNet-50, batch 64, V100 nodes on 25 Gbps Ethernet",
        xticks=gpus,
        ylim=(0, 1.05),
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "_ethernet.png"), dpi=100)
    plt.close(fig)
    print(f"# plots: {path.with_suffix('.png')}, {path.with_name(path.stem + '_ethernet.png')}")


def _size(nbytes: float) -> str:
    if math.isinf(nbytes):
        return "inf"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}B"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the predictions (and plots) here")
    args = parser.parse_args(argv)
    one, two = scenario_one(), scenario_two()
    print_scenario_one(one)
    print_plans()
    print_scenario_two(two)
    if args.json:
        path = pathlib.Path(args.json)
        ethernet = write_json(path, one, two)
        print(f"# wrote {path} and {ethernet}")
        write_plots(path, two)


if __name__ == "__main__":
    main()
