"""One host of ``bench/network.py``: joins the job, runs one workload, prints rows.

Started by ``bench/network.py`` in each host's network namespace with the
variables ``python -m jaxcomm.launch`` sets (``JAXCOMM_COORDINATOR`` on host
0's link address, ``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID``), and
``JAXCOMM_SOCKET_IFNAME`` naming the host's link. Process 0 prints each
result as one ``@row {json}`` line on stdout; progress goes to stderr.

Workloads:

- ``allreduce``: ``jaxcomm.allreduce`` over every device of every host, per
  path (xla ``auto`` = gloo's psum, xla ``ring`` over ppermute,
  ``hierarchical`` over (host, local device), ``ffi``: the ring over jaxcomm's
  TCP transport), wire dtype and size; the median time of ``--repeats``
  calls, each checked against the closed form, and host 0's CPU seconds a call.
- ``check``: one float32 allreduce of seeded normal values per wire, compared
  with a float64 NumPy sum of every device's input; prints the largest error
  against the bound :func:`error_bound` states.
- ``train``: a wide MLP trained data-parallel with each gradient exchange
  configuration on a fresh batch each step; the median step time, one step
  in flight, and the held-out accuracy after every step: how many steps
  reach ``--target-acc`` and so the time to it (steps x median step time,
  which leaves out compilation and the evaluations). With ``--fsdp F`` the
  model is sharded (HSDP, docs/sharded.md): a ("data", "fsdp") mesh, "fsdp"
  the process's F devices, the weight matrices split over "fsdp" (``FSDP_SPECS``)
  and gathered in the forward pass, the batch split over both axes, and each
  configuration exchanging over "data" only; ``dense`` is ``lax.pmean`` over "data".
  ``--model lm`` trains ``examples/lm``'s byte transformer (its defaults) on
  random bytes with AdamW instead: losses and times, no accuracy.
  ``--hlo-overlap`` adds, per configuration, how much compute the compiled
  program schedules under each asynchronous collective (:func:`async_overlap`).
- ``overlap``: does XLA's CPU runtime run a collective and compute that does
  not depend on it at the same time? The median time of a program with only
  a chain of matmuls, one with only a ``lax.psum`` of ``--sizes-mib`` (the
  first size) per device, and one program with both, independent of each
  other (what a double-buffered step is: last step's gradient travels while
  this step's is computed). Overlap would make both take max, not the sum.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import resource
import statistics
import time

import timeline
from testbed_worker import describe_error, emit, join, load_example, progress

MIB = 1 << 20
# jaxcomm.allreduce algorithms on the xla backend, and "ffi": jaxcomm's own
# ring over its TCP transport (backend="ffi").
PATHS = ("auto", "ring", "hierarchical", "ffi")
# The overlap workload's collectives: lax.psum (gloo, blocks XLA's thread) or
# jaxcomm's ffi allreduce (TCP behind a future, XLA computes meanwhile).
OVERLAP_PATHS = ("auto", "ffi")
WIRES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# The train workload's models: the wide MLP, or examples/lm's byte transformer
# (its defaults) on random bytes.
MODELS = ("mlp", "lm")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload", choices=("allreduce", "check", "train", "overlap"), required=True
    )
    parser.add_argument("--paths", default="auto,ring,hierarchical")
    parser.add_argument("--wires", default="float32,float16,bfloat16")
    parser.add_argument("--sizes-mib", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="dense")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch-per-device", type=int, default=32)
    parser.add_argument("--target-acc", type=float, default=0.9)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fsdp", type=int, default=0, help="train: shard over F local devices")
    parser.add_argument("--model", choices=MODELS, default="mlp", help="train: what is trained")
    parser.add_argument(
        "--hlo-overlap",
        action="store_true",
        help="train: count the compute XLA scheduled under each asynchronous collective",
    )
    parser.add_argument("--params-out", help="train: write each config's final params here")
    return parser.parse_args(argv)


AXES = ("host", "local")
# --fsdp: the mesh's axes, and each weight matrix split over "fsdp" (the
# first layer by rows, the second by columns, the third by rows); biases whole.
FSDP_AXES = ("data", "fsdp")
FSDP_SPECS = {"w1": ("fsdp", None), "w2": (None, "fsdp"), "w3": ("fsdp", None)}


def host_mesh(names=AXES):
    """(host, local device) mesh: row i holds host i's devices in id order."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(jax.process_count(), -1)
    return Mesh(grid, names)


def wire_dtype(name: str):
    import jax.numpy as jnp

    return None if name == "float32" else jnp.dtype(name)


def global_input(mesh, per_device: int, fill):
    """A (devices * per_device,) float32 array; device d's slice is ``fill(d, n)``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    order = {d: i for i, d in enumerate(mesh.devices.flat)}
    sharding = NamedSharding(mesh, P(AXES))
    arrays = [jax.device_put(fill(order[d], per_device), d) for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays((mesh.size * per_device,), sharding, arrays)


def reducer(mesh, path: str, wire):
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    def body(x):
        if path == "ffi":
            return jaxcomm.allreduce(x, AXES, algorithm="ring", wire_dtype=wire, backend="ffi")
        return jaxcomm.allreduce(x, AXES, algorithm=path, wire_dtype=wire, backend="xla")

    # Every device's copy of the sum comes back, so nothing relies on the
    # result being typed as replicated.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))


# Unit roundoff of the 8-bit wires: their allreduce is within (2u + u^2) x
# the largest |x| of any device per device summed (jaxcomm.allreduce's bound).
FP8_UNIT = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}


def check_closed_form(y, expected, tolerance=0.0):
    """Every local copy of the sum is ``expected`` within ``tolerance`` (small
    integers: exact on the 32- and 16-bit wires)."""
    import numpy as np

    for shard in y.addressable_shards:
        wrong = np.flatnonzero(np.abs(np.asarray(shard.data) - expected) > tolerance)
        if wrong.size:
            i = wrong[0]
            got = np.asarray(shard.data)
            raise AssertionError(
                f"device {shard.device.id}: {wrong.size} of {expected.size} elements differ "
                f"from the closed form, first at {i}: {got[i]} != {expected[i]}, "
                f"max |error| {np.abs(got[wrong] - expected[wrong]).max()}"
            )


def process_cpu_s() -> float:
    """User + system CPU seconds of this process, every thread."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of every core, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_busy_since(before: tuple[int, int]) -> float:
    """Fraction of the machine's cores busy since ``before`` (softirq included)."""
    busy, total = machine_busy()
    return (busy - before[0]) / max(1, total - before[1])


def run_allreduce(args):
    import jax
    import numpy as np

    mesh = host_mesh()
    hosts, local = mesh.devices.shape
    rows = []
    for path in args.paths.split(","):
        for wire_name in args.wires.split(","):
            for size_mib in [float(s) for s in args.sizes_mib.split(",")]:
                row = {"hosts": hosts, "devices": mesh.size, "path": path, "wire": wire_name}
                nbytes = int(size_mib * MIB)
                row["bytes"] = nbytes
                if path == "hierarchical" and local < 2:
                    row["error"] = "needs --devices-per-host 2"
                    emit(row, rows)
                    continue
                n = nbytes // 4
                # Device d holds (d + 1) * pattern: the sum is pattern * D(D+1)/2,
                # exact in float16 for these small integers.
                pattern = (np.arange(n) % 7 - 3).astype(np.float32)
                expected = pattern * (mesh.size * (mesh.size + 1) / 2)
                x = global_input(mesh, n, lambda d, n, p=pattern: p * (d + 1))
                try:
                    run = reducer(mesh, path, wire_dtype(wire_name))
                    y = jax.block_until_ready(run(x))  # compile + warm up
                    times = []
                    cpu_before, busy_before = process_cpu_s(), machine_busy()
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        y = jax.block_until_ready(run(x))
                        times.append(time.perf_counter() - start)
                    # CPU per call: this process (all threads), and how busy the
                    # whole machine was (every host shares its cores).
                    row["cpu_s"] = (process_cpu_s() - cpu_before) / args.repeats
                    row["machine_busy"] = machine_busy_since(busy_before)
                    u = FP8_UNIT.get(wire_name, 0.0)
                    largest = 3.0 * mesh.size  # |pattern| <= 3, device d holds (d + 1) x it
                    check_closed_form(y, expected, mesh.size * (2 * u + u * u) * largest)
                    row["time_s"] = statistics.median(times)
                except Exception as e:  # noqa: BLE001  (a failing path is a result)
                    row["error"] = describe_error(e)
                progress(
                    f"allreduce {path} {wire_name} {size_mib:g} MiB: {row.get('time_s')} s, "
                    f"{row.get('cpu_s')} CPU s a call, machine {row.get('machine_busy')} busy"
                )
                emit(row, rows)
    return rows


def error_bound(wire_name: str, ranks: int, abs_sum):
    """Largest |result - exact sum| allowed, elementwise, for a sum over ``ranks`` ranks.

    Each input is rounded to the wire once, and the partial sum is rounded
    again at most once per hop (``ranks - 1`` reduce hops plus the gather),
    each time by at most half an ulp, ``2^-(p+1)`` relative, of a value no
    larger than ``sum_d |x_d|``: ``(ranks + 1) * 2^-(p+1) * sum_d |x_d|``,
    ``p`` the wire's significand bits (float32 23, float16 10, bfloat16 7).
    """
    bits = {"float32": 23, "float16": 10, "bfloat16": 7}[wire_name]
    return (ranks + 1) * 2.0 ** -(bits + 1) * abs_sum + 1e-30


def run_check(args):
    import jax
    import numpy as np

    mesh = host_mesh()
    n = 4096

    def values(d, n):
        return np.random.default_rng(1000 + d).normal(size=n).astype(np.float32)

    inputs = np.stack([values(d, n).astype(np.float64) for d in range(mesh.size)])
    exact, abs_sum = inputs.sum(0), np.abs(inputs).sum(0)
    x = global_input(mesh, n, values)
    for path in args.paths.split(","):
        for wire_name in args.wires.split(","):
            y = jax.block_until_ready(reducer(mesh, path, wire_dtype(wire_name))(x))
            worst, worst_abs = 0.0, 0.0
            bound = error_bound(wire_name, mesh.size, abs_sum)
            for shard in y.addressable_shards:
                err = np.abs(np.asarray(shard.data, np.float64) - exact)
                worst = max(worst, float((err / bound).max()))
                worst_abs = max(worst_abs, float(err.max()))
            emit(
                {
                    "hosts": mesh.devices.shape[0],
                    "devices": mesh.size,
                    "path": path,
                    "wire": wire_name,
                    "max_error_over_bound": worst,
                    "max_abs_error": worst_abs,
                }
            )


# --- train -------------------------------------------------------------------

TRAIN_CONFIGS = (
    "dense",
    "allreduce",
    "bf16",
    "bf16_ring",
    "bf16_ef",
    "fp16",
    "fp16_ef",
    "fusion",
    "hierarchical",
    "double_buffering",
    "chunk_sparse",
    "chunk_sparse_fp16",
    "fp8",
    "fp8_ef",
    "powersgd_r4",
    "diloco_h10",
    # Streaming DiLoCo: two fragments, each landing two steps after its sync.
    "streaming_diloco",
    # The same over jaxcomm's ffi collectives (TCP between processes).
    "allreduce_ffi",
    "bf16_ffi",
    "fp16_ffi",
    "double_buffering_ffi",
    "chunk_sparse_ffi",
    "chunk_sparse_fp16_ffi",
    # chunk_sparse one step late: each step's chunks travel during the next.
    "chunk_sparse_db_ffi",
    "chunk_sparse_fp16_db_ffi",
    # The same at density 0.05 (chunk_sparse's default elsewhere is 0.15).
    "chunk_sparse_d05_fp16_db_ffi",
    "unfused_ffi",
    "double_buffering_unfused_ffi",
    # jaxcomm.double_buffered: the same overlapped exchange, each gradient
    # taken where it will be applied.
    "dga",
    "dga_ffi",
    "dga_unfused_ffi",
    "compute",
)


def gradient_exchange(config: str, inner, axes=AXES):
    """``None`` for the hand-written pmean baseline, else the optax chain
    exchanging over ``axes``."""
    import jax.numpy as jnp
    import optax

    import jaxcomm

    fp16, bf16 = jnp.float16, jnp.bfloat16
    options = {
        "allreduce": {},
        "bf16": {"wire_dtype": bf16},
        "bf16_ring": {"wire_dtype": bf16, "algorithm": "ring"},
        "bf16_ef": {"wire_dtype": bf16, "error_feedback": True},
        "fp16": {"wire_dtype": fp16},
        "fp16_ef": {"wire_dtype": fp16, "error_feedback": True},
        "fusion": {"bucket_bytes": math.inf},
        "hierarchical": {"algorithm": "hierarchical"},
        "double_buffering": {"double_buffering": True},
        "unfused": {"bucket_bytes": 0},
        "double_buffering_unfused": {"double_buffering": True, "bucket_bytes": 0},
        "fp8": {"wire_dtype": jnp.float8_e4m3fn},
        "fp8_ef": {"wire_dtype": jnp.float8_e4m3fn, "error_feedback": True},
    }
    if config in ("dense", "compute"):
        return None
    config, ffi, _ = config.partition("_ffi")
    backend = "ffi" if ffi else "xla"
    if config in options:
        return optax.chain(
            jaxcomm.allreduce_gradients(axes, backend=backend, **options[config]), inner
        )
    if config == "powersgd_r4":
        return optax.chain(
            jaxcomm.powersgd(axes, rank=4, start_step=0, mask=None, backend="xla"), inner
        )
    if config in ("dga", "dga_unfused"):
        unfused = {"bucket_bytes": 0} if config == "dga_unfused" else {}
        return jaxcomm.double_buffered(inner, axes, backend=backend, **unfused)
    if config == "diloco_h10":
        # The DiLoCo paper's outer optimizer (bench/quality_worker.py's default).
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        return jaxcomm.diloco(inner, outer, axes, sync_every=10, backend="xla")
    if config == "streaming_diloco":
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        return jaxcomm.diloco(
            inner, outer, axes, sync_every=10, fragments=2, delay=2, mixing=0.5, backend="xla"
        )
    wire = fp16 if "_fp16" in config else None
    return jaxcomm.chunk_sparse(
        inner,
        axes,
        density=0.05 if "_d05" in config else 0.15,
        wire_dtype=wire,
        backend=backend,
        double_buffering=config.endswith("_db"),
    )


def takes_local_params(config: str) -> bool:
    """Whether the configuration's state holds the params at which each
    device takes its gradient (``jaxcomm.local_params``)."""
    return config.startswith(("diloco", "streaming_diloco", "dga"))


def train_step(tx, inner, communicate=True, axes=AXES, fsdp=False, local=False, logits_fn=None):
    """The step of one configuration: local gradients, exchange over ``axes``,
    update. ``fsdp``: the params are this device's shards (``FSDP_SPECS``);
    ``local``: the gradient is taken at ``jaxcomm.local_params``;
    ``logits_fn(params, x)``: the model (default the MLP)."""
    import jax
    import optax

    import jaxcomm

    logits_fn = logits_fn or mlp_logits

    def loss_fn(params, x, y):
        logits = logits_fn(gather_shards(params) if fsdp else params, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        # The reduce-scatter of the gathers' gradients sums the shards' rows.
        return loss / jax.lax.axis_size("fsdp") if fsdp else loss

    def step(params, opt_state, x, y):
        # This device's own gradient, so the exchange is the only
        # communication of the step.
        at = jaxcomm.local_params(opt_state) if local else params
        loss, grads = jaxcomm.local_value_and_grad(loss_fn, axes)(at, x, y)
        if tx is None:
            grads = jax.lax.pmean(grads, axes) if communicate else grads
            updates, opt_state = inner.update(grads, opt_state, params)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
        loss = jax.lax.psum(loss, "fsdp") if fsdp else loss
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

    return step


def gather_shards(params):
    """The whole params from this device's shards over "fsdp" (the FSDP forward)."""
    import jax

    whole = dict(params)
    for name, spec in FSDP_SPECS.items():
        whole[name] = jax.lax.all_gather(params[name], "fsdp", axis=spec.index("fsdp"), tiled=True)
    return whole


# Scheduled HLO: "%name = type opcode(%operand, ...)". What counts as
# compute between an asynchronous collective's start and its done.
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_COMPUTE_OPCODES = ("fusion", "custom-call", "convolution", "dot")
# An operand printed without "%", after its type or not.
_BARE_OPERAND = re.compile(r"\s*(?:[a-z]\w*\[[^\]]*\](?:\{[^}]*\})?\s+)?([\w.\-]+)")


def async_overlap(hlo_text: str) -> list[int]:
    """For each asynchronous collective of a compiled (scheduled) program,
    in program order: how many compute instructions (fusions, custom calls
    such as cuBLAS GEMMs, dots, convolutions) XLA scheduled between its
    ``*-start`` and its ``*-done``, inside the same computation. Empty where
    the backend runs collectives synchronously (XLA's CPU runtime)."""
    counts = []
    open_starts: dict[str, int] = {}  # start's name -> index into counts
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") or line.strip() == "}":
            open_starts = {}  # a new computation: its instructions are its own
            continue
        m = _HLO_INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode, rest = m.groups()
        if opcode.endswith("-start") and opcode != "copy-start":  # copies are not collectives
            open_starts[name] = len(counts)
            counts.append(0)
        elif opcode.endswith("-done"):
            # The operand, printed "%start" or, in some XLA versions, "f32[8]{0} %start".
            operand = re.search(r"%([\w.\-]+)", rest) or _BARE_OPERAND.match(rest)
            if operand:
                open_starts.pop(operand.group(1), None)
        elif opcode in _COMPUTE_OPCODES:
            for i in open_starts.values():
                counts[i] += 1
    return counts


HELD_OUT_PER_DEVICE = 256
CLASSES = 10


def mlp_problem(args):
    """The wide MLP: (params, logits_fn, draw(rng, n) -> (inputs, labels))
    with samples of ``CLASSES`` Gaussian clusters of ``--features`` each."""
    import numpy as np

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(CLASSES, args.features)).astype(np.float32)
    sizes = [(args.features, args.hidden), (args.hidden, args.hidden), (args.hidden, CLASSES)]
    params = {}
    for i, (fan_in, fan_out) in enumerate(sizes, start=1):
        w = rng.normal(size=(fan_in, fan_out)) * np.sqrt(2 / fan_in)
        params[f"w{i}"] = w.astype(np.float32)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)

    def draw(rng, n):
        """n samples: a class, and its centre plus unit normal noise."""
        labels = rng.integers(CLASSES, size=n).astype(np.int32)
        inputs = centres[labels] + rng.normal(size=(n, args.features)).astype(np.float32)
        return inputs, labels

    return params, mlp_logits, draw


def lm_problem(args):
    """examples/lm's byte transformer at that example's defaults, on random
    bytes: (params, logits_fn, draw(rng, n) -> (tokens, next tokens))."""
    import jax
    import numpy as np
    from flax import nnx

    (model_module,) = load_example("lm", "model")
    model = model_module.ByteTransformer(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.tree.map(np.asarray, state)

    def logits_fn(params, tokens):
        return nnx.merge(graphdef, params)(tokens)

    def draw(rng, n):
        windows = rng.integers(256, size=(n, model.context + 1)).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    return params, logits_fn, draw


def mlp_logits(params, x):
    import jax

    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    h = jax.nn.relu(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def held_out_accuracy(params, x, y, fsdp=False):
    """The fraction of held-out samples classified right, over every device's."""
    import jax

    logits = mlp_logits(gather_shards(params) if fsdp else params, x)
    return jax.lax.pmean((logits.argmax(-1) == y).mean(), FSDP_AXES if fsdp else AXES)


def to_accuracy(accs: list[float], target: float, step_s: float) -> dict:
    """What the held-out accuracies (before training, then after each step)
    say about reaching ``target``: the steps it took and their time at the
    median step, or ``None`` for both if it was not reached."""
    steps = next((i for i, a in enumerate(accs) if a >= target), None)
    return {
        "target_acc": target,
        "acc_first": accs[0],
        "acc_last": accs[-1],
        "steps_to_acc": steps,
        "time_to_acc_s": None if steps is None else steps * step_s,
    }


def run_train(args):
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    fsdp = args.fsdp > 0
    lm = args.model == "lm"
    if lm and (fsdp or args.params_out):
        raise ValueError("--model lm: without --fsdp and --params-out")
    mesh = host_mesh(FSDP_AXES if fsdp else AXES)
    axes, rows = ("data" if fsdp else AXES), P(mesh.axis_names)  # exchange; batch split
    hosts, local = mesh.devices.shape
    if fsdp and local != args.fsdp:
        raise ValueError(f"--fsdp {args.fsdp}: each process has {local} devices")
    params_np, logits_fn, draw_np = (lm_problem if lm else mlp_problem)(args)
    param_count = sum(v.size for v in jax.tree.leaves(params_np))
    progress(f"train: {param_count / 1e6:.1f}M parameters, {hosts} hosts x {local} devices")
    batch = args.batch_per_device * mesh.size
    if lm:
        param_specs = jax.tree.map(lambda _: P(), params_np)
    else:
        param_specs = {k: P(*FSDP_SPECS.get(k, ())) if fsdp else P() for k in params_np}

    def sharded(value, spec=rows):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])

    def draw(rng, n):
        return tuple(sharded(v) for v in draw_np(rng, n))

    params0 = jax.tree.map(sharded, params_np, param_specs)
    # Every configuration sees the same batches, and is judged on the same
    # held-out samples, drawn apart from them.
    batches = [draw(np.random.default_rng([1, i]), batch) for i in range(args.steps + 1)]
    held_out = draw(np.random.default_rng(2), HELD_OUT_PER_DEVICE * mesh.size)
    accuracy = None  # the LM's loss is its measure
    if not lm:
        accuracy = jax.jit(
            jax.shard_map(
                functools.partial(held_out_accuracy, fsdp=fsdp),
                mesh=mesh,
                in_specs=(param_specs, rows, rows),
                out_specs=P(),
            )
        )

    if args.params_out:
        save_params(args.params_out, "init", params0)
    out = []
    for config in args.configs.split(","):
        row = {"hosts": hosts, "devices": mesh.size, "config": config, "params": param_count}
        row.update(model=args.model, batch_per_device=args.batch_per_device)
        if fsdp:
            row["fsdp"] = args.fsdp
        # The leaf shapes follow from these (the cost model's PowerSGD term needs them).
        if not lm:
            row.update(features=args.features, hidden=args.hidden, classes=CLASSES)
        try:
            if config == "hierarchical" and local < 2:
                raise ValueError("needs --devices-per-host 2")
            # examples/lm's optimizer family for its model.
            inner = optax.adamw(1e-3) if lm else optax.sgd(0.01, momentum=0.9)
            tx = gradient_exchange(config, inner, axes)
            optimizer = inner if tx is None else tx
            with jax.set_mesh(mesh):
                # Sharded params: tx.init places the state like them (docs/sharded.md).
                shapes = (
                    optimizer.init(params0) if fsdp else jax.eval_shape(optimizer.init, params0)
                )
            specs = jaxcomm.state_specs(shapes, axes)
            init = jax.jit(
                jax.shard_map(optimizer.init, mesh=mesh, in_specs=(P(),), out_specs=specs)
            )
            opt_state = shapes if fsdp else init(params0)
            step = train_step(
                tx,
                inner,
                config != "compute",
                axes,
                fsdp,
                local=takes_local_params(config),
                logits_fn=logits_fn,
            )
            run = jax.jit(
                jax.shard_map(
                    step,
                    mesh=mesh,
                    in_specs=(param_specs, specs, rows, rows),
                    out_specs=(param_specs, specs, P()),
                    # compute: each device keeps its own update (no exchange).
                    check_vma=config != "compute",
                )
            )
            params = params0
            if args.hlo_overlap:
                hlo = run.lower(params, opt_state, *batches[0]).compile().as_text()
                under = async_overlap(hlo)
                row["async_collectives"] = len(under)
                row["compute_under_collectives"] = under
            times, losses = [], []
            # compute: each device holds its own params, which no accuracy describes.
            accs = (
                []
                if config == "compute" or accuracy is None
                else [float(accuracy(params, *held_out))]
            )
            spans = []  # each timed step's (start, end) on time.monotonic's clock
            faults = 0  # minor page faults of the timed steps (jaxcomm/_host_memory.py)
            for i in range(args.steps + 1):  # the first compiles
                x, y = batches[i]
                start, began = time.perf_counter(), time.monotonic()
                faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                # One step in flight: overlapping CPU collectives can abort.
                # A trace of host 0's last step, to see what ran when (thunks).
                profile = os.environ.get("JAXCOMM_BENCH_PROFILE")
                if profile and i == args.steps and jax.process_index() == 0:
                    with jax.profiler.trace(f"{profile}/{config}", create_perfetto_trace=True):
                        params, opt_state, loss = jax.block_until_ready(
                            run(params, opt_state, x, y)
                        )
                else:
                    params, opt_state, loss = jax.block_until_ready(run(params, opt_state, x, y))
                if i:
                    times.append(time.perf_counter() - start)
                    spans.append((began, time.monotonic()))
                    faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
                losses.append(float(loss))
                seconds = time.perf_counter() - start
                if accs:
                    accs.append(float(accuracy(params, *held_out)))
                progress(f"train {config} step {i}: {seconds:.3f} s")
            row["step_s"] = statistics.median(times)
            row["page_faults_per_step"] = faults / len(times)
            # DiLoCo's syncs are rare steps: the mean is its cost per step.
            row["mean_step_s"] = statistics.mean(times)
            # DiLoCo's stats are its last step's, not a mean step's.
            if config != "compute" and not config.startswith(("diloco", "streaming")):
                row.update(traffic(run, (params, opt_state, *batches[0]), tx, opt_state))
                row["collective_latency_s"] = latency(mesh, axes, config)
            row["loss_first"], row["loss_last"] = losses[0], losses[-1]
            exchanges = timeline.exchanges_since(spans[0][0])
            if exchanges:  # exchanges that outlive a step: when each travelled
                row["step_times"], row["exchanges"] = spans, exchanges
            if args.params_out:
                save_params(args.params_out, config, params)
            if accs:
                row.update(to_accuracy(accs, args.target_acc, row["step_s"]))
        except Exception as e:  # noqa: BLE001  (a failing configuration is a result)
            row["error"] = describe_error(e)
            progress(f"train {config}: {row['error']}")
        emit(row, out)
    return out


def traffic(run, args, tx, opt_state) -> dict:
    """What a step sends, per device: ``bytes_sent`` and ``collectives`` from
    jaxcomm's stats, or for the hand-written pmean (no jaxcomm state) its
    all-reduces in the compiled program and their bytes on a ring."""
    import jax
    import numpy as np

    import jaxcomm

    if tx is not None:
        stats = jaxcomm.get_stats(opt_state)
        return {"bytes_sent": float(stats.bytes_sent), "collectives": int(stats.collectives)}
    hlo = run.lower(*args).compile().as_text()
    calls = [
        line for line in hlo.splitlines() if " all-reduce(" in line or "all-reduce-start(" in line
    ]
    payload = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
    n = jax.process_count()
    return {"bytes_sent": 2 * (n - 1) / n * payload, "collectives": len(calls)}


def latency(mesh, axes, config: str, rounds: int = 9) -> float:
    """Median seconds of a one-element allreduce over ``axes`` on the
    configuration's backend (jaxcomm's TCP transport for ``*_ffi``, else
    XLA's gloo): what each collective costs beyond its bytes."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    backend = "ffi" if "_ffi" in config else "xla"
    spec = P(mesh.axis_names)
    x = jax.make_array_from_callback(
        (mesh.size,), NamedSharding(mesh, spec), lambda i: np.ones(1, np.float32)
    )
    run = jax.jit(
        jax.shard_map(
            lambda v: jaxcomm.allreduce(v, axes, backend=backend),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    times = []
    for i in range(rounds + 1):  # the first compiles
        start = time.perf_counter()
        jax.block_until_ready(run(x))
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def save_params(directory: str, config: str, params: dict):
    """This process's whole copy of ``params`` (its devices' shards put
    together), as ``{config}.{process}.npz`` in ``directory``."""
    import jax
    import numpy as np

    whole = {}
    for name, value in params.items():
        whole[name] = np.zeros(value.shape, value.dtype)
        for shard in value.addressable_shards:
            whole[name][shard.index] = np.asarray(shard.data)
    np.savez(os.path.join(directory, f"{config}.{jax.process_index()}.npz"), **whole)


def run_overlap(args):
    import jax.numpy as jnp
    import numpy as np

    mesh = host_mesh()
    n = int(float(args.sizes_mib.split(",")[0]) * MIB) // 4
    width = args.hidden // 4  # the matmul chain's size: --hidden 4096 gives 1024 x 1024
    x = global_input(mesh, n, lambda d, n: np.full(n, d + 1.0, np.float32))
    a = global_input(mesh, width * width, lambda d, n: np.full(n, 1.0 / width, np.float32))

    def compute(m):
        m = m.reshape(width, width)
        for _ in range(args.steps):
            m = jnp.tanh(m @ m)
        return m.reshape(-1)

    for path in args.paths.split(","):
        emit(overlap_row(args, mesh, x, a, n, width, compute, path))


def overlap_row(args, mesh, x, a, n, width, compute, path: str) -> dict:
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    def reduce(v):
        if path == "ffi":
            return jaxcomm.allreduce(v, AXES, backend="ffi")
        return jax.lax.psum(v, AXES)

    bodies = {
        "compute": lambda v, m: (v, compute(m)),
        "allreduce": lambda v, m: (reduce(v), m),
        "both": lambda v, m: (reduce(v), compute(m)),
    }
    row = {
        "path": path,
        "hosts": mesh.devices.shape[0],
        "devices": mesh.size,
        "bytes": n * 4,
        "width": width,
    }
    runs = {
        name: jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), P(AXES)), out_specs=P(AXES))
        )
        for name, body in bodies.items()
    }
    for run in runs.values():
        jax.block_until_ready(run(x, a))  # compile and warm up
    # Round-robin, so that a change in the machine's load hits all three alike.
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(x, a))
            times[name].append(time.perf_counter() - start)
    for name in runs:
        row[f"{name}_s"] = statistics.median(times[name])
        progress(f"overlap {path}: {name} {row[f'{name}_s']:.3f} s")
    # 1: both ran fully at once (max of the two); 0: one after the other (sum).
    saved = row["compute_s"] + row["allreduce_s"] - row["both_s"]
    row["overlap"] = saved / min(row["compute_s"], row["allreduce_s"])
    return row


def main(argv=None):
    args = parse_args(argv)
    join(fail_rank=args.fail_rank, say_interface=True)
    workloads = {
        "allreduce": run_allreduce,
        "check": run_check,
        "train": run_train,
        "overlap": run_overlap,
    }
    workloads[args.workload](args)


if __name__ == "__main__":
    main()
