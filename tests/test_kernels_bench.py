"""bench/kernels.py's XLA twins on CPU: each does its kernel's work, checked
against NumPy written out here (hand-made inputs, a short last chunk, chunk
masks), and the benchmark's own kernel section run with the twins standing in
for the CUDA handlers, so its NumPy references judge the twins at the real
chunk size. The kernels themselves are checked on a GPU in tests/test_cuda.py."""

from __future__ import annotations

import functools

import bench_modules
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

C = 4  # elements per chunk here: 23 elements are 5 whole chunks and one of 3
MASKS = [
    [True, False, True, False, False, True],  # the short last chunk packed
    [False, True, True, False, True, False],
    [True] * 6,
    [False] * 6,
]


@pytest.fixture(scope="module")
def bench():
    return bench_modules.load("kernels")


def _twin(bench, name, **attrs):
    """The twin as the benchmark calls it: attributes bound, under jit."""
    return jax.jit(functools.partial(bench.XLA_TWINS[name], **attrs))


def _bf16_bits(f32):
    """float32 -> bfloat16 bits, rounded to nearest even (finite inputs)."""
    bits = np.asarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_cast_twins_scale_in_float32_then_round_to_nearest_even(bench):
    x = np.array(
        [
            2 * (1 + 2**-8),  # * 0.5: halfway between two bfloat16s, to the even one
            2 * (1 + 3 * 2**-8),  # halfway, up to the even one
            -2 * (1 + 2**-8),
            2 * (1 + 2**-11),  # halfway between two float16s
            2 * (1 + 3 * 2**-11),
            140000.0,  # past float16's largest: inf
            3.0,
            -0.0,
            1e-3,
        ],
        np.float32,
    )
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(64).astype(np.float32)])
    for scale in (0.5, 0.1):
        # The product of two float32s is exact in float64; rounding it to
        # float32 is the kernel's float32 multiply.
        product = (x.astype(np.float64) * np.float64(np.float32(scale))).astype(np.float32)
        bf16 = np.asarray(_twin(bench, "cast_bf16", scale=np.float64(scale))(jnp.asarray(x)))
        f16 = np.asarray(_twin(bench, "cast_f16", scale=np.float64(scale))(jnp.asarray(x)))
        assert bf16.dtype == ml_dtypes.bfloat16 and f16.dtype == np.float16
        np.testing.assert_array_equal(bf16.view(np.uint16), _bf16_bits(product))
        with np.errstate(over="ignore"):  # 140000 is meant to overflow float16
            f16_expected = product.astype(np.float16)
        np.testing.assert_array_equal(f16.view(np.uint16), f16_expected.view(np.uint16))
    # The halfway cases above, by value: the rounding is not a truncation.
    half = np.asarray(_twin(bench, "cast_bf16", scale=np.float64(0.5))(jnp.asarray(x)))
    assert half[:3].astype(np.float32).tolist() == [1.0, 1 + 2**-6, -1.0]
    half = np.asarray(_twin(bench, "cast_f16", scale=np.float64(0.5))(jnp.asarray(x)))
    assert half[3:6].astype(np.float32).tolist() == [1.0, 1 + 2**-9, np.inf]


def _chunk(v, c):
    return v[c * C : (c + 1) * C]


def _packed(x, mask):
    out = []
    for c, selected in enumerate(mask):
        if selected:
            out.extend(_chunk(x, c))
    return np.array(out + [0] * (len(x) - len(out)), x.dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("mask", MASKS)
def test_pack_twin_puts_the_selected_chunks_first_and_zeros_after(bench, mask, dtype):
    x = np.arange(1, 24).astype(dtype)  # 23 elements, none zero
    for name in ("pack_all", "pack_half"):
        got = _twin(bench, name, chunk_size=np.int64(C))(jnp.asarray(x), jnp.asarray(mask))
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(np.asarray(got), _packed(x, mask))


@pytest.mark.parametrize("mask", MASKS)
def test_unpack_twin_takes_the_selected_chunks_back_from_their_packed_places(bench, mask):
    x = np.arange(1, 24, dtype=np.float32)
    packed = -np.arange(1, 24, dtype=np.float32)  # every value told apart from x's
    expected = x.copy()
    k = 0
    for c, selected in enumerate(mask):
        if selected:
            expected[c * C : (c + 1) * C] = _chunk(packed, k)[: len(_chunk(x, c))]
            k += 1
    unpack = _twin(bench, "unpack_half", chunk_size=np.int64(C))
    got = unpack(jnp.asarray(packed), jnp.asarray(x), jnp.asarray(mask))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got), expected)
    # Unpacking what was packed puts the selected chunks back where they were.
    pack = _twin(bench, "pack_half", chunk_size=np.int64(C))
    back = unpack(pack(jnp.asarray(x), jnp.asarray(mask)), jnp.zeros(23), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(back), np.where(np.repeat(mask, C)[:23], x, 0))


@pytest.mark.parametrize("n", [23, 24])  # a short last chunk, and none
@pytest.mark.parametrize(
    ("name", "dtype"), [("norms_f32", np.float32), ("norms_bf16", ml_dtypes.bfloat16)]
)
def test_norms_twin_sums_each_chunks_absolute_values(bench, n, name, dtype):
    x = (np.arange(n) - 11.5) * 0.25 * np.where(np.arange(n) % 3 == 0, -1, 1)  # bf16-exact
    x = x.astype(dtype)
    x64 = x.astype(np.float64)
    expected = [np.abs(x64[c * C : (c + 1) * C]).sum() for c in range(-(-n // C))]
    got = _twin(bench, name, chunk_size=np.int64(C))(jnp.asarray(x))
    assert got.dtype == np.float32 and got.shape == (len(expected),)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


def test_kernel_section_checks_the_twins_against_its_references(bench, monkeypatch):
    """bench_kernels with each CUDA handler replaced by the twin of its work:
    the twins meet the NumPy references the kernels are held to (a mismatch
    exits), on 4 whole chunks of 32768 and a short fifth, every other one
    selected, the short one included."""
    handlers = {
        "jaxcomm_pack_chunks": bench.xla_pack,
        "jaxcomm_unpack_chunks": bench.xla_unpack,
        "jaxcomm_chunk_norms": bench.xla_norms,
    }

    def kernel(name, out, **attrs):
        work = handlers.get(name) or functools.partial(bench.xla_cast, dtype=out.dtype)
        return jax.jit(functools.partial(work, **attrs))

    monkeypatch.setattr(bench, "_register_kernels", lambda: None)
    monkeypatch.setattr(bench, "_ffi_kernel", kernel)
    n = 4 * bench.CHUNK + 100
    rows = bench.bench_kernels(4 * n, reps=1)
    assert [r["kernel"] for r in rows] == ["copy", "xla_scale", *bench.XLA_TWINS]
    for r in rows:
        if r["kernel"] in bench.XLA_TWINS:
            assert r["xla_bandwidth_GBps"] == pytest.approx(r["bytes"] / r["xla_us"] / 1e3)
            assert r["vs_xla"] == pytest.approx(r["GBps"] / r["xla_bandwidth_GBps"])
        else:
            assert r["xla_us"] is r["xla_bandwidth_GBps"] is r["vs_xla"] is None
    table = bench.kernel_table(rows)
    assert table[0].split() == "kernel us GB/s ratio xla us xla GB/s vs xla".split()
    assert [line.split()[0] for line in table[1:]] == [r["kernel"] for r in rows]
    assert table[1].split()[-3:] == ["-", "-", "-"]  # copy has no twin
    assert float(table[3].split()[-1]) == pytest.approx(rows[2]["vs_xla"], abs=0.005)


def test_kernels_below_the_target_are_listed(bench):
    rows = [
        {"kernel": "copy", "vs_xla": None},
        {"kernel": "slow", "vs_xla": 0.949},
        {"kernel": "at", "vs_xla": 0.95},
        {"kernel": "fast", "vs_xla": 1.3},
    ]
    assert bench.VS_XLA_TARGET == 0.95
    assert bench.below_xla_target(rows) == ["slow"]
