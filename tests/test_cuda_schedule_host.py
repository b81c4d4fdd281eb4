"""The CUDA all-to-all allreduce (xla_ffi/cuda/alltoall.cc) without a GPU:
the allreduce handler, compiled against the host device and loopback NCCL
of xla_ffi/host_device/, runs on N host ranks (tests/cuda_host/alltoall_test.cc)
and each rank's output is checked here, bit for bit, against NumPy: the
inputs prescaled in float32, clamped to the wire's largest finite value for
a mean, rounded to the wire, added in float32 in rank order, clamped,
postscaled and rounded to the wire once. The data lie on a grid fine enough
that the wire rounds them and coarse enough that float32 adds them exactly,
so each sum is exact, while adding in the wire type would round it (checked:
the test can fail). Every rank must hold the same bits.
"""

from __future__ import annotations

import pathlib
import subprocess

import ml_dtypes
import numpy as np
import pytest
from test_cuda_host import OWN_COMMS_SOURCES, _host_binary

DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}
RANKS = (2, 3, 4, 8)
WIRES = ("float32", "float16", "bfloat16")


@pytest.fixture(autouse=True)
def _enough_devices():
    """Nothing here runs on a JAX device (see test_cuda_host.py)."""


def _acc(input_name):
    return np.float64 if input_name == "float64" else np.float32


def _clamp(a, dtype):
    hi = a.dtype.type(min(float(ml_dtypes.finfo(dtype).max), float(np.finfo(a.dtype).max)))
    return np.where(np.isfinite(a), np.clip(a, -hi, hi), a)


def reference(xs, input_name, wire_name, prescale, postscale, *, wire_adds=False):
    """What every rank must hold: xs is (N, n) in the input dtype. With
    `wire_adds`, the partial sums are rounded to the wire (what an
    implementation that adds in 16 bits would give)."""
    acc, wire = _acc(input_name), DTYPES[wire_name]
    saturate = prescale != 1.0
    a = xs.astype(acc) * acc(prescale)
    if saturate:
        a = _clamp(a, wire)
    e = a.astype(wire)
    s = e[0].astype(acc)
    for q in range(1, len(xs)):
        s = s + e[q].astype(acc)
        if wire_adds:
            s = s.astype(wire).astype(acc)
    if saturate:
        s = _clamp(s, wire)
    return (s * acc(postscale)).astype(wire).astype(DTYPES[input_name])


class Cases:
    def __init__(self, tmp):
        self.tmp, self.lines, self.expect = tmp, [], {}

    def add(
        self,
        name,
        xs,
        *,
        input_name="float32",
        wire="float32",
        algorithm="alltoall",
        prescale=1.0,
        postscale=1.0,
        mask=None,
        chunk_size=0,
        max_chunks=0,
        unselected="local",
    ):
        n_ranks, n = xs.shape
        xs = xs.astype(DTYPES[input_name])
        (self.tmp / f"{name}.in").write_bytes(xs.tobytes())
        nchunks = 0
        want = np.broadcast_to(reference(xs, input_name, wire, prescale, postscale), xs.shape)
        if mask is not None:
            nchunks = len(mask)
            (self.tmp / f"{name}.mask").write_bytes(np.asarray(mask, np.uint8).tobytes())
            reduced = np.flatnonzero(mask)
            if max_chunks:
                reduced = reduced[:max_chunks]
            selected = np.zeros(n, bool)
            for c in reduced:
                selected[c * chunk_size : (c + 1) * chunk_size] = True
            other = np.zeros_like(xs) if unselected == "zero" else xs
            want = np.where(selected, want, other)
        self.lines.append(
            f"{name} {n_ranks} {n} {input_name} {wire} {algorithm} {prescale!r} {postscale!r} "
            f"{chunk_size} {nchunks} {max_chunks} {unselected}"
        )
        # Unselected chunks keep each rank's own values; all else agrees.
        same = mask is None or unselected == "zero"
        # ncclAllReduce where NCCL adds in the input's dtype; otherwise one
        # grouped all-to-all and one ncclAllGather, whatever N.
        nccl_adds = algorithm == "direct" and input_name == wire in ("float32", "float64")
        launches = 0 if n == 0 else 1 if nccl_adds else 2
        self.expect[name] = (want, input_name, same, launches)

    def run(self, exe):
        (self.tmp / "cases.txt").write_text("\n".join(self.lines) + "\n")
        run = subprocess.run([str(exe), str(self.tmp)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        assert run.stdout.splitlines()[-1] == "ok"
        for name, (want, input_name, same, launches) in self.expect.items():
            made = np.frombuffer((self.tmp / f"{name}.launches").read_bytes(), np.int32)
            assert list(made) == [launches] * len(want), (name, made)
            got = np.frombuffer(
                (self.tmp / f"{name}.out").read_bytes(), DTYPES[input_name]
            ).reshape(want.shape)
            bits = np.dtype(f"u{want.dtype.itemsize}")
            # Those of the reference, and so the same on every rank.
            np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=name)
            if same:
                first = got[:1].view(bits).repeat(len(got), 0)
                np.testing.assert_array_equal(got.view(bits), first, err_msg=name)
        return run.stdout


def _grid(rng, n_ranks, n, scale=1024):
    """Multiples of 1/scale in [-8, 8]: float32 holds every sum of N <= 8 of
    them (rounded to a 16-bit wire or not) exactly."""
    return rng.integers(-8 * scale, 8 * scale + 1, size=(n_ranks, n)) / scale


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    source = (pathlib.Path(__file__).parent / "cuda_host" / "alltoall_test.cc").read_text()
    return _host_binary(
        tmp_path_factory,
        "alltoall_test",
        source,
        extra_sources=OWN_COMMS_SOURCES,
        flags=("-DJAXCOMM_HOST_DEVICE=1", "-DJAXCOMM_XLA_COMMS=0", "-pthread"),
    )


def test_reference_would_catch_adds_in_the_wire_type():
    """The grid data's exact sums differ from sums rounded to a 16-bit wire
    at every hop: the comparisons below can tell float32 adds from 16-bit ones."""
    xs = _grid(np.random.default_rng(0), 8, 4099).astype(np.float32)
    for wire in ("float16", "bfloat16"):
        exact = reference(xs, "float32", wire, 1.0, 1.0)
        rounded = reference(xs, "float32", wire, 1.0, 1.0, wire_adds=True)
        assert np.sum(exact != rounded) > 100, wire


@pytest.mark.slow
def test_alltoall_sums_exactly_for_every_wire_and_group_size(exe, tmp_path):
    """N in {2, 3, 4, 8}, every wire, lengths below N, not divisible by N and
    empty; the plain sum and the mean (prescale 1/N); float16 and bfloat16
    inputs (which NCCL would add in 16 bits) through 'direct' and 'alltoall'."""
    rng = np.random.default_rng(1)
    cases = Cases(tmp_path)
    for n_ranks in RANKS:
        for wire in WIRES:
            for n in sorted({0, 1, n_ranks - 1, 1001, 4099}):
                xs = _grid(rng, n_ranks, n)
                cases.add(f"sum_{n_ranks}_{wire}_{n}", xs, wire=wire)
            cases.add(
                f"mean_{n_ranks}_{wire}", _grid(rng, n_ranks, 1001), wire=wire,
                prescale=1.0 / n_ranks,
            )  # fmt: skip
            # 'direct' narrows through the same schedule.
            cases.add(f"direct_{n_ranks}_{wire}", _grid(rng, n_ranks, 999), wire=wire,
                      algorithm="direct")  # fmt: skip
        for narrow in ("float16", "bfloat16"):
            for algorithm in ("direct", "alltoall"):
                cases.add(
                    f"in_{narrow}_{algorithm}_{n_ranks}", _grid(rng, n_ranks, 777),
                    input_name=narrow, wire=narrow, algorithm=algorithm,
                )  # fmt: skip
        cases.add(
            f"f64_{n_ranks}", _grid(rng, n_ranks, 333), input_name="float64", wire="float32",
            prescale=0.5, postscale=2.0,
        )  # fmt: skip
    cases.run(exe)


@pytest.mark.slow
def test_alltoall_clamps_a_mean_to_the_wire_and_never_returns_inf(exe, tmp_path):
    """Means of values at and near the wire's largest finite value: the
    encoded shards and their float32 sum may round past it, and are clamped
    to it (the clamp the ring applies). Without the clamp some would be inf."""
    rng = np.random.default_rng(2)
    cases = Cases(tmp_path)
    unclamped_inf = 0
    for n_ranks in RANKS:
        for wire in ("float16", "bfloat16"):
            hi = float(ml_dtypes.finfo(DTYPES[wire]).max)
            xs = hi * rng.uniform(0.97, 1.0, size=(n_ranks, 515))
            xs[:, :5] = hi  # every rank at the top
            xs[:, 5:10] = -hi
            xs = xs.astype(np.float32)
            cases.add(f"clamp_{n_ranks}_{wire}", xs, wire=wire, prescale=1.0 / n_ranks)
            want = reference(xs, "float32", wire, 1.0 / n_ranks, 1.0)
            assert np.all(np.isfinite(want))
            a = (xs * np.float32(1.0 / n_ranks)).astype(DTYPES[wire]).astype(np.float32)
            with np.errstate(over="ignore"):
                unclamped_inf += int(np.sum(~np.isfinite(a.sum(0).astype(DTYPES[wire]))))
    assert unclamped_inf > 0  # the clamp is what keeps them finite
    cases.run(exe)


@pytest.mark.slow
def test_masked_alltoall_sums_only_the_selected_chunks(exe, tmp_path):
    """The chunk-sparse exchange packs the selected chunks (the first
    max_chunks of them where set) and runs the same schedule on them; the
    other chunks keep each rank's values, or zeros."""
    rng = np.random.default_rng(3)
    cases = Cases(tmp_path)
    chunk = 16
    for n_ranks in RANKS:
        for wire in WIRES:
            for n in (100, 1001):
                nchunks = -(-n // chunk)
                mask = rng.random(nchunks) < 0.3
                mask[-1] = True  # the short last chunk travels too
                for max_chunks, unselected in ((0, "local"), (3, "zero")):
                    cases.add(
                        f"masked_{n_ranks}_{wire}_{n}_{max_chunks}",
                        _grid(rng, n_ranks, n),
                        wire=wire,
                        mask=mask,
                        chunk_size=chunk,
                        max_chunks=max_chunks,
                        unselected=unselected,
                        prescale=1.0 / n_ranks if max_chunks else 1.0,
                    )
    cases.run(exe)


def test_alltoall_is_an_ffi_algorithm_on_gpu_only():
    """algorithm="alltoall" passes the checks made when a transform is built
    (the platform is not known yet), and on CPU the ffi backend refuses it
    by name when traced: its handlers have no such schedule."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    jaxcomm.allreduce_gradients("d", backend="ffi", algorithm="alltoall")
    with pytest.raises(ValueError, match="algorithm='alltoall' is not one of backend 'xla'"):
        jaxcomm.allreduce_gradients("d", backend="xla", algorithm="alltoall")
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU refusal needs the CPU platform")
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    f = jax.shard_map(
        lambda v: jaxcomm.allreduce(v, "d", backend="ffi", algorithm="alltoall"),
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    x = jax.device_put(
        np.ones(len(jax.devices()) * 4, np.float32), jax.sharding.NamedSharding(mesh, P("d"))
    )
    with pytest.raises(ValueError, match="algorithm='alltoall' is not one of backend 'ffi'"):
        jax.jit(f).lower(x)
