"""Meshes over the devices of every process of a job."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcomm.distributed.startup import as_int

__all__ = ["hierarchical_mesh"]


def hierarchical_mesh(
    inter_axis: str = "node", intra_axis: str = "local", *, nodes: int | None = None
) -> Mesh:
    """A 2-D mesh: processes along ``inter_axis``, their local devices along ``intra_axis``.

    Row i holds the devices of node i, process by process and by device id
    inside a process, so
    ``allreduce(..., (inter_axis, intra_axis), algorithm="hierarchical")``
    reduces inside each node first and only 1/L of the data crosses nodes.
    Flattened in row-major order the devices run process by process, which is
    the order ``PartitionSpec((inter_axis, intra_axis))`` shards a batch in.

    Args:
      inter_axis: name of the axis across nodes.
      intra_axis: name of the axis inside a node.
      nodes: rows of the mesh; ``jax.process_count()`` by default (one node per
        process). A multiple of the process count splits each process's
        devices into several rows: one process of 8 devices with ``nodes=2``
        has the shape of 2 processes x 4 devices. A divisor of it groups
        consecutive processes into one row: with one process per GPU, 4 GPUs a
        host and ranks numbered host by host (SLURM's default block
        distribution), ``nodes=jax.process_count() // 4`` puts each host's
        GPUs on ``intra_axis``.

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(nodes, devices // nodes)``.

    Raises:
      ValueError: processes with different device counts, or ``nodes`` that
        would split a process's devices unevenly or across rows.

    Examples:
      >>> mesh = hierarchical_mesh(nodes=2)  # one process, 8 CPU devices
      >>> dict(mesh.shape)
      {'node': 2, 'local': 4}
    """
    processes = jax.process_count()
    nodes = processes if nodes is None else as_int(nodes, "nodes")
    by_process = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    counts = {p: len(ds) for p, ds in by_process.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"processes hold different numbers of devices: {counts}")
    per_process = next(iter(counts.values()))
    splits = nodes >= processes and nodes % processes == 0 and per_process % (nodes // processes)
    if nodes < 1 or (nodes % processes and processes % nodes) or splits:
        raise ValueError(
            f"nodes={nodes} does not fit {processes} processes of {per_process} devices: "
            "it must divide the process count, or be a multiple of it that divides "
            "each process's devices evenly"
        )
    ordered = [d for p in sorted(by_process) for d in sorted(by_process[p], key=lambda d: d.id)]
    grid = np.array(ordered, dtype=object).reshape(nodes, len(ordered) // nodes)
    return Mesh(grid, (inter_axis, intra_axis))
