"""Bad input gives a clear error naming the argument and what is allowed.

Options are checked when a transform is built; data (dtypes, axis names, a
missing ffi handler) when the collective or the transform's step is traced.
Every bad input tried is a row of one of these tables:

- COLLECTIVES: jaxcomm.allreduce, reduce_scatter and all_gather, traced on 2 devices.
- ALLREDUCE_GRADIENTS_OPTIONS, CHUNK_SPARSE_OPTIONS: at construction.
- TRANSFORM_STEPS: allreduce_gradients and chunk_sparse, at their first traced step.
- FFI_MISSING x FFI_CALLS: backend="ffi" without the compiled extension, or
  without a handler for this platform, for every entry point.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm.collectives import _extension
from tests.harness import mesh_of, random_grads, run_sharded, run_steps

# What the messages list as allowed.
INPUT_DTYPES = "jaxcomm collectives take float32, float16, bfloat16, float64"
WIRE_DTYPES = "use None or one of float16, bfloat16, float32, float64"
OPS = r"use one of \('sum', 'mean'\)"
ALGORITHMS = r"use one of \('auto', 'ring', 'hierarchical', 'direct', 'alltoall'\)"
BACKENDS = r"use one of \('auto', 'xla', 'ffi'\)"
HIERARCHICAL = r"algorithm='hierarchical' needs axis_name=\(inter_axis, intra_axis\)"
DIRECT = r"algorithm='direct' is the shared-memory schedule of backend='ffi'"
BOUND_I = r"not bound here; the axes bound here are \('i',\) \(bound by shard_map's mesh or pmap's"

AR, RS, AG = jaxcomm.allreduce, jaxcomm.reduce_scatter, jaxcomm.all_gather
F32, F16 = np.float32, jnp.float16
MASK2 = jnp.ones(2, bool)  # the 2 chunks of an 8-element input in chunks of 4

# (description, collective, kwargs (axis_name defaults to "i"), input dtype,
#  expected exception, message pattern). Inputs are 8 elements per device.
COLLECTIVES = [
    ("allreduce: integer input", AR, {}, np.int32, TypeError, f"x has dtype int32; {INPUT_DTYPES}"),
    (
        "allreduce: integer input, float16 wire",
        AR,
        {"wire_dtype": F16},
        np.int32,
        TypeError,
        f"x has dtype int32; {INPUT_DTYPES}",
    ),
    ("allreduce: bool input", AR, {}, np.bool_, TypeError, f"x has dtype bool; {INPUT_DTYPES}"),
    (
        "allreduce: complex input",
        AR,
        {},
        np.complex64,
        TypeError,
        f"x has dtype complex64; {INPUT_DTYPES}",
    ),
    ("allreduce: unknown op", AR, {"op": "max"}, F32, ValueError, f"op='max' .*{OPS}"),
    (
        "allreduce: unknown algorithm",
        AR,
        {"algorithm": "tree"},
        F32,
        ValueError,
        f"algorithm='tree' .*{ALGORITHMS}",
    ),
    (
        "allreduce: unknown backend",
        AR,
        {"backend": "mpi"},
        F32,
        ValueError,
        f"backend='mpi' .*{BACKENDS}",
    ),
    (
        "allreduce: integer wire dtype",
        AR,
        {"wire_dtype": jnp.int16},
        F32,
        TypeError,
        f"wire_dtype=int16 is not supported; {WIRE_DTYPES}",
    ),
    (
        "allreduce: bool wire dtype",
        AR,
        {"wire_dtype": bool},
        F32,
        TypeError,
        f"wire_dtype=bool is not supported; {WIRE_DTYPES}",
    ),
    (
        "allreduce: complex wire dtype",
        AR,
        {"wire_dtype": jnp.complex64},
        F32,
        TypeError,
        f"wire_dtype=complex64 is not supported; {WIRE_DTYPES}",
    ),
    (
        "allreduce: wire dtype that is not a dtype",
        AR,
        {"wire_dtype": "nope"},
        F32,
        TypeError,
        f"wire_dtype='nope' is not a dtype; {WIRE_DTYPES}",
    ),
    (
        "allreduce: hierarchical on one axis",
        AR,
        {"algorithm": "hierarchical"},
        F32,
        ValueError,
        f"{HIERARCHICAL}, got \\('i',\\)",
    ),
    (
        "allreduce: hierarchical, second axis not bound",
        AR,
        {"algorithm": "hierarchical", "axis_name": ("i", "j")},
        F32,
        ValueError,
        rf"axis_name=\('i', 'j'\): 'j' is {BOUND_I}",
    ),
    (
        "allreduce: direct on xla",
        AR,
        {"algorithm": "direct", "backend": "xla"},
        F32,
        ValueError,
        f"{DIRECT}; with backend='xla' use 'auto'",
    ),
    (
        "allreduce: unbound axis",
        AR,
        {"axis_name": "nope"},
        F32,
        ValueError,
        rf"axis_name='nope' is {BOUND_I}",
    ),
    (
        "allreduce: no axis",
        AR,
        {"axis_name": ()},
        F32,
        ValueError,
        "axis_name must name at least one axis",
    ),
    (
        "allreduce: repeated axis",
        AR,
        {"axis_name": ("i", "i")},
        F32,
        ValueError,
        r"axis_name=\('i', 'i'\) repeats an axis",
    ),
    (
        "allreduce: unknown unselected",
        AR,
        {"chunk_mask": MASK2, "chunk_size": 4, "unselected": "drop"},
        F32,
        ValueError,
        r"unselected='drop' is not supported; use one of \('local', 'zero'\)",
    ),
    *[
        (
            f"allreduce: chunk_size={size!r}",
            AR,
            {"chunk_mask": jnp.ones(1, bool), "chunk_size": size},
            F32,
            ValueError,
            f"chunk_size={size!r} must be a positive integer",
        )
        for size in (0, -1, 4.0, True)
    ],
    (
        "allreduce: mask of wrong length",
        AR,
        {"chunk_mask": jnp.ones(5, bool), "chunk_size": 4},
        F32,
        ValueError,
        r"chunk_mask has shape \(5,\); an input of 8 elements in chunks of 4 needs shape \(2,\)",
    ),
    (
        "allreduce: non-boolean mask",
        AR,
        {"chunk_mask": jnp.ones(2), "chunk_size": 4},
        F32,
        TypeError,
        "chunk_mask must be boolean, got float32",
    ),
    *[
        (
            f"allreduce: max_chunks={bound!r}",
            AR,
            {"chunk_mask": MASK2, "chunk_size": 4, "max_chunks": bound, "backend": "xla"},
            F32,
            ValueError,
            f"max_chunks={bound!r} must be None or an integer in \\[1, 2\\]",
        )
        for bound in (0, 3, 1.5)
    ],
    (
        "reduce_scatter: integer input",
        RS,
        {"wire_dtype": F16},
        np.int32,
        TypeError,
        f"x has dtype int32; {INPUT_DTYPES}",
    ),
    (
        "reduce_scatter: complex input",
        RS,
        {},
        np.complex64,
        TypeError,
        f"x has dtype complex64; {INPUT_DTYPES}",
    ),
    ("reduce_scatter: unknown op", RS, {"op": "max"}, F32, ValueError, f"op='max' .*{OPS}"),
    (
        "reduce_scatter: unknown backend",
        RS,
        {"backend": "mpi"},
        F32,
        ValueError,
        f"backend='mpi' .*{BACKENDS}",
    ),
    (
        "reduce_scatter: integer wire dtype",
        RS,
        {"wire_dtype": jnp.int16},
        F32,
        TypeError,
        f"wire_dtype=int16 is not supported; {WIRE_DTYPES}",
    ),
    (
        "reduce_scatter: unbound axis",
        RS,
        {"axis_name": "nope"},
        F32,
        ValueError,
        rf"axis_name='nope' is {BOUND_I}",
    ),
    (
        "all_gather: integer input",
        AG,
        {},
        np.int32,
        TypeError,
        f"x has dtype int32; {INPUT_DTYPES}",
    ),
    (
        "all_gather: complex input",
        AG,
        {},
        np.complex64,
        TypeError,
        f"x has dtype complex64; {INPUT_DTYPES}",
    ),
    (
        "all_gather: unknown backend",
        AG,
        {"backend": "mpi"},
        F32,
        ValueError,
        f"backend='mpi' .*{BACKENDS}",
    ),
    (
        "all_gather: integer wire dtype",
        AG,
        {"wire_dtype": jnp.int16},
        F32,
        TypeError,
        f"wire_dtype=int16 is not supported; {WIRE_DTYPES}",
    ),
    (
        "all_gather: unbound axis",
        AG,
        {"axis_name": "nope"},
        F32,
        ValueError,
        rf"axis_name='nope' is {BOUND_I}",
    ),
]


@pytest.mark.parametrize("case", COLLECTIVES, ids=[c[0] for c in COLLECTIVES])
def test_collective_bad_input(case):
    _, collective, kwargs, dtype, error, pattern = case
    kwargs = dict(kwargs)
    axis = kwargs.pop("axis_name", "i")
    xs = np.ones((2, 8), dtype)
    with pytest.raises(error, match=pattern):
        run_sharded(lambda x: collective(x, axis, **kwargs), mesh_of((2,), ("i",)), xs)


# (description, kwargs for allreduce_gradients (axis_name defaults to "data"),
#  expected exception, message pattern): raised by the constructor.
ALLREDUCE_GRADIENTS_OPTIONS = [
    (
        "bucket_bytes < 0",
        {"bucket_bytes": -1},
        ValueError,
        r"bucket_bytes=-1 must be >= 0 \(0: one collective per leaf\)",
    ),
    (
        "bucket_bytes nan",
        {"bucket_bytes": float("nan")},
        ValueError,
        "bucket_bytes=nan must be >= 0",
    ),
    (
        "bucket_bytes not a number",
        {"bucket_bytes": "big"},
        TypeError,
        "bucket_bytes='big' must be a number of bytes or math.inf",
    ),
    (
        "integer wire dtype",
        {"wire_dtype": jnp.int16},
        TypeError,
        f"wire_dtype=int16 is not supported; {WIRE_DTYPES}",
    ),
    (
        "complex wire dtype",
        {"wire_dtype": jnp.complex64},
        TypeError,
        f"wire_dtype=complex64 is not supported; {WIRE_DTYPES}",
    ),
    (
        "wire dtype not a dtype",
        {"wire_dtype": "nope"},
        TypeError,
        "wire_dtype='nope' is not a dtype",
    ),
    ("unknown op", {"op": "max"}, ValueError, f"op='max' .*{OPS}"),
    ("unknown algorithm", {"algorithm": "tree"}, ValueError, f"algorithm='tree' .*{ALGORITHMS}"),
    ("unknown backend", {"backend": "mpi"}, ValueError, f"backend='mpi' .*{BACKENDS}"),
    (
        "hierarchical on one axis",
        {"algorithm": "hierarchical"},
        ValueError,
        f"{HIERARCHICAL}, got \\('data',\\)",
    ),
    (
        "hierarchical on three axes",
        {"algorithm": "hierarchical", "axis_name": ("a", "b", "c")},
        ValueError,
        HIERARCHICAL,
    ),
    ("direct on xla", {"algorithm": "direct", "backend": "xla"}, ValueError, DIRECT),
    # backend="auto" is xla for a dense allreduce, whatever the platform.
    ("direct on auto", {"algorithm": "direct"}, ValueError, DIRECT),
    (
        "error feedback without a wire dtype",
        {"error_feedback": True},
        ValueError,
        "error_feedback=True .* needs a narrow wire_dtype .*got None",
    ),
    (
        "error feedback with a float32 wire",
        {"error_feedback": True, "wire_dtype": jnp.float32},
        ValueError,
        "error_feedback=True .* needs a narrow wire_dtype .*got float32$",
    ),
    ("no axis", {"axis_name": ()}, ValueError, "axis_name must name at least one axis"),
]


@pytest.mark.parametrize(
    "case", ALLREDUCE_GRADIENTS_OPTIONS, ids=[c[0] for c in ALLREDUCE_GRADIENTS_OPTIONS]
)
def test_allreduce_gradients_bad_option_at_construction(case):
    _, kwargs, error, pattern = case
    kwargs = dict(kwargs)
    axis = kwargs.pop("axis_name", "data")
    with pytest.raises(error, match=pattern):
        jaxcomm.allreduce_gradients(axis, **kwargs)


# (description, kwargs for chunk_sparse (density defaults to 0.1, inner to
#  optax.sgd(0.1)), expected exception, message pattern): raised by the constructor.
CHUNK_SPARSE_OPTIONS = [
    *[
        (f"density={d!r}", {"density": d}, ValueError, f"density={d!r} must be in \\(0, 1\\]")
        for d in (0, -0.1, 1.5, float("nan"), True, "0.5")
    ],
    *[
        (
            f"chunk_size={c!r}",
            {"chunk_size": c},
            ValueError,
            f"chunk_size={c!r} must be a positive integer",
        )
        for c in (0, -1, 2.5)
    ],
    *[
        (
            f"warmup_steps={w!r}",
            {"warmup_steps": w},
            ValueError,
            f"warmup_steps={w!r} must be an integer >= 0",
        )
        for w in (-1, 1.5)
    ],
    *[
        (
            f"residual_decay={r!r}",
            {"residual_decay": r},
            ValueError,
            f"residual_decay={r!r} must be in \\[0, 1\\]",
        )
        for r in (-0.1, 1.5, float("nan"), True)
    ],
    (
        "integer wire dtype",
        {"wire_dtype": jnp.int32},
        TypeError,
        f"wire_dtype=int32 is not supported; {WIRE_DTYPES}",
    ),
    ("unknown algorithm", {"algorithm": "tree"}, ValueError, f"algorithm='tree' .*{ALGORITHMS}"),
    ("unknown backend", {"backend": "nccl"}, ValueError, f"backend='nccl' .*{BACKENDS}"),
    (
        "hierarchical on one axis",
        {"algorithm": "hierarchical"},
        ValueError,
        f"{HIERARCHICAL}, got \\('data',\\)",
    ),
    ("direct on xla", {"algorithm": "direct", "backend": "xla"}, ValueError, DIRECT),
    (
        "inner is not a transformation",
        {"inner": optax.sgd},
        TypeError,
        "inner=<function sgd .*> must be an optax.GradientTransformation",
    ),
]


@pytest.mark.parametrize("case", CHUNK_SPARSE_OPTIONS, ids=[c[0] for c in CHUNK_SPARSE_OPTIONS])
def test_chunk_sparse_bad_option_at_construction(case):
    _, kwargs, error, pattern = case
    kwargs = {"inner": optax.sgd(0.1), "density": 0.1, **kwargs}
    inner = kwargs.pop("inner")
    with pytest.raises(error, match=pattern):
        jaxcomm.chunk_sparse(inner, "data", **kwargs)


def test_numpy_scalars_are_valid_options():
    """NumPy scalars pass the checks that reject bools and strings."""
    tx = jaxcomm.chunk_sparse(
        optax.sgd(0.1),
        "data",
        density=np.float32(0.5),
        chunk_size=np.int64(4),
        warmup_steps=np.int32(2),
        residual_decay=np.float64(0.9),
    )
    assert isinstance(tx, optax.GradientTransformation)


def _ar_grads(axis="data", **kwargs):
    return jaxcomm.allreduce_gradients(axis, **kwargs)


def _sparse(axis="data", **kwargs):
    return jaxcomm.chunk_sparse(optax.sgd(0.1), axis, density=0.5, chunk_size=2, **kwargs)


# (description, transform factory, gradient dtype, expected exception, message pattern):
# raised when the first step is traced on the 8-device mesh ("data",).
TRANSFORM_STEPS = [
    (
        "allreduce_gradients: integer gradient, float16 wire",
        lambda: _ar_grads(wire_dtype=F16),
        np.int32,
        TypeError,
        rf"gradient\['w'\] has dtype int32; {INPUT_DTYPES}",
    ),
    (
        "allreduce_gradients: complex gradient",
        lambda: _ar_grads(),
        np.complex64,
        TypeError,
        rf"gradient\['w'\] has dtype complex64; {INPUT_DTYPES}",
    ),
    (
        "allreduce_gradients: unbound axis",
        lambda: _ar_grads("nope"),
        F32,
        ValueError,
        r"axis_name='nope' is not bound here; the axes bound here are \('data',\)",
    ),
    (
        "allreduce_gradients: hierarchical, inner axis not bound",
        lambda: _ar_grads(("data", "node"), algorithm="hierarchical"),
        F32,
        ValueError,
        r"axis_name=\('data', 'node'\): 'node' is not bound here; the axes bound here are "
        r"\('data',\)",
    ),
    (
        "chunk_sparse: integer gradient",
        lambda: _sparse(wire_dtype=F16),
        np.int32,
        TypeError,
        rf"gradient\['w'\] has dtype int32; {INPUT_DTYPES}",
    ),
    (
        "chunk_sparse: complex gradient",
        lambda: _sparse(),
        np.complex64,
        TypeError,
        rf"gradient\['w'\] has dtype complex64; {INPUT_DTYPES}",
    ),
    (
        "chunk_sparse: unbound axis (init sizes the residual)",
        lambda: _sparse("nope"),
        F32,
        ValueError,
        r"axis_name='nope' is not bound here; the axes bound here are \('data',\) \(bound by "
        r"shard_map's mesh",
    ),
]


@pytest.mark.parametrize("case", TRANSFORM_STEPS, ids=[c[0] for c in TRANSFORM_STEPS])
def test_transform_bad_input_at_trace(case):
    _, make_tx, dtype, error, pattern = case
    tx = make_tx()
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(error, match=pattern):
        run_steps(tx, {"w": np.zeros(4, dtype)}, [{"w": np.ones((8, 4), dtype)}], mesh)


# backend="ffi" where it cannot run: (description, what _extension reports, message).
# _extension.require() asks cpu_module() for the compiled module and _register()
# for the platforms with handlers; patching them is what a build without the
# extension, or without this platform's handlers, looks like.
FFI_MISSING = [
    (
        "no extension",
        ("cpu_module", lambda: None),
        r"backend='ffi' needs jaxcomm's compiled extension \(jaxcomm._ffi\), which is not "
        r"installed; .*use backend='xla'",
    ),
    (
        "no handler for the platform",
        ("_register", frozenset),
        r"backend='ffi' has no handler for platform 'cpu' in this build \(available: \[\]\); "
        r"use backend='xla'",
    ),
]


def _collective_on_2(collective):
    def call():
        xs = np.ones((2, 8), np.float32)
        run_sharded(lambda x: collective(x, "i", backend="ffi"), mesh_of((2,), ("i",)), xs)

    return call


def _first_step(make_tx):
    def call():
        tx = make_tx()
        grads = [{"w": np.ones((8, 4), np.float32)}]
        run_steps(tx, {"w": np.zeros(4, np.float32)}, grads, mesh_of((8,), ("data",)))

    return call


# (entry point, call that should fail): the transforms at their first step
# (looking for the handler starts JAX's backends, which building a transform
# must not: jax.distributed.initialize may come after it), the collectives
# when traced.
FFI_CALLS = [
    ("allreduce", _collective_on_2(AR)),
    ("reduce_scatter", _collective_on_2(RS)),
    ("all_gather", _collective_on_2(AG)),
    ("allreduce_gradients", _first_step(lambda: _ar_grads(backend="ffi"))),
    ("chunk_sparse", _first_step(lambda: _sparse(backend="ffi"))),
]


@pytest.mark.parametrize("missing", FFI_MISSING, ids=[m[0] for m in FFI_MISSING])
@pytest.mark.parametrize("call", FFI_CALLS, ids=[c[0] for c in FFI_CALLS])
def test_ffi_backend_missing(monkeypatch, missing, call):
    _, (attribute, replacement), pattern = missing
    monkeypatch.setattr(_extension, attribute, replacement)
    with pytest.raises(RuntimeError, match=pattern):
        call[1]()


@pytest.mark.parametrize("missing", FFI_MISSING, ids=[m[0] for m in FFI_MISSING])
def test_transforms_with_ffi_missing_still_build(monkeypatch, missing):
    """What the first step reports is not raised when they are built."""
    _, (attribute, replacement), _ = missing
    monkeypatch.setattr(_extension, attribute, replacement)
    assert isinstance(_ar_grads(backend="ffi"), optax.GradientTransformation)
    assert isinstance(_sparse(backend="ffi"), optax.GradientTransformation)


def test_ffi_missing_leaves_auto_on_xla(monkeypatch):
    """Without the extension, backend='auto' (even with a chunk mask, where
    it prefers ffi) falls back to xla instead of failing."""
    monkeypatch.setattr(_extension, "cpu_module", lambda: None)
    monkeypatch.setattr(_extension, "_register", frozenset)
    xs = np.arange(16, dtype=np.float32).reshape(2, 8)
    out = run_sharded(
        lambda x: AR(x, "i", chunk_mask=MASK2, chunk_size=4, unselected="zero"),
        mesh_of((2,), ("i",)),
        xs,
    )
    np.testing.assert_array_equal(out, np.broadcast_to(xs.sum(0), (2, 8)))


def test_bad_timeout():
    with pytest.raises(ValueError, match="must be positive"):
        jaxcomm.set_ffi_timeout(0)


def _without_params(tx):
    """`tx` called as optax allows: update(updates, state) with no params."""
    return optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s))


PARAMS = {"a": np.zeros(64, np.float32), "b": np.zeros(4, np.float32)}
MISSING_B = {"a": np.ones((8, 64), np.float32)}
SHORT_A = {"a": np.ones((8, 60), np.float32), "b": np.ones((8, 4), np.float32)}
EXTRA_C = {
    **{k: np.ones((8, *v.shape), np.float32) for k, v in PARAMS.items()},
    "c": MISSING_B["a"],
}
SPARSE = lambda: jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.5, chunk_size=8)  # noqa: E731
EF = lambda: _ar_grads(wire_dtype=jnp.bfloat16, error_feedback=True)  # noqa: E731
DB = lambda: optax.chain(_ar_grads(double_buffering=True), optax.sgd(0.1))  # noqa: E731
TREE = "the gradient's tree must be that of the params the optimizer state was built for"

# A gradient whose tree is not the params' (description, transform, gradient,
# message): the error names the path that differs.
MISMATCHED_TREES = [
    ("chunk_sparse: missing leaf", SPARSE, MISSING_B, rf"gradient\['b'\] is missing: {TREE}"),
    (
        "chunk_sparse: wrong shape",
        SPARSE,
        SHORT_A,
        rf"gradient\['a'\] has shape \(60,\) but the params holds \(64,\) there: {TREE}",
    ),
    ("chunk_sparse: extra leaf", SPARSE, EXTRA_C, rf"gradient\['c'\] is not in the params: {TREE}"),
    (
        "chunk_sparse: missing leaf, no params given",
        lambda: _without_params(SPARSE()),
        MISSING_B,
        "the gradient has 64 elements, the optimizer state was built for params with 68",
    ),
    ("allreduce_gradients: error feedback", EF, MISSING_B, rf"gradient\['b'\] is missing: {TREE}"),
    (
        "allreduce_gradients: error feedback, wrong shape",
        EF,
        SHORT_A,
        r"gradient\['a'\] has shape \(60,\) but the error-feedback residual holds \(64,\) there",
    ),
    ("allreduce_gradients: double buffering", DB, EXTRA_C, r"gradient\['c'\] is not in the double"),
]


@pytest.mark.parametrize("case", MISMATCHED_TREES, ids=[c[0] for c in MISMATCHED_TREES])
def test_mismatched_gradient_tree_names_the_path(case):
    _, make_tx, grads, pattern = case
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(ValueError, match=pattern):
        run_steps(make_tx(), PARAMS, [grads], mesh)


@pytest.mark.parametrize("make_tx", [_sparse, lambda axis: _ef(axis)], ids=["sparse", "ef"])
def test_init_under_a_mesh_without_the_axis_names_both(make_tx):
    mesh = mesh_of((8,), ("data",))
    with jax.set_mesh(mesh), pytest.raises(ValueError) as info:
        make_tx("batch").init(PARAMS)
    assert str(info.value) == (
        "axis_name='batch' is not bound here; the axes bound here are ('data',) "
        "(the axes of the mesh set with jax.set_mesh)"
    )


def _ef(axis):
    return _ar_grads(axis, wire_dtype=jnp.bfloat16, error_feedback=True)


def test_chunk_sparse_warns_when_the_model_is_too_small_to_be_sparse():
    """10k parameters are one chunk of the default 32768: every step sends the
    whole gradient. init says so, and the stats show it."""
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.1)
    params = {"w": np.zeros((100, 100), np.float32)}
    grads = random_grads(np.random.default_rng(0), {"w": (100, 100)}, 8, 3)
    message = (
        "chunk_sparse: 10000 gradient elements make 1 chunk(s) of chunk_size=32768, and at "
        "least one whole chunk travels each step, so density=0.1 is not reachable: each step "
        "exchanges 1 of the gradient. A chunk_size of at most 1000 gives 1/density chunks or more."
    )
    with pytest.warns(UserWarning) as record:
        _, _, state = run_steps(tx, params, grads, mesh_of((8,), ("data",)))
    assert [str(w.message) for w in record] == [message]
    assert state.stats.density[0] == 1.0


def test_chunk_sparse_reachable_density_does_not_warn_and_stats_count_elements():
    """100 elements in chunks of 64: two chunks, 64 and 36 elements. Density
    0.5 is one chunk, reachable; when the short chunk is the one sent, 36% of
    the gradient travels, and stats.density says 0.36, not half the chunks."""
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.5, chunk_size=64)
    g = np.ones((8, 100), np.float32)
    g[:, 64:] = 10.0  # the short chunk has the larger L1 norm: step 1 sends it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, state = run_steps(
            tx, {"w": np.zeros(100, np.float32)}, [{"w": g}] * 2, mesh_of((8,), ("data",))
        )
    assert state.stats.density[0] == pytest.approx(0.36, rel=1e-6)


@pytest.mark.parametrize(
    "size,chunk_size,density,fix",
    [
        (3, 4, 0.3, "The gradient has fewer than 1/density elements: no chunk_size reaches it."),
        (100, 64, 0.1, "A chunk_size of at most 10 gives 1/density chunks or more."),
    ],
)
def test_chunk_sparse_warning_suggests_a_chunk_size_only_where_one_exists(
    size, chunk_size, density, fix
):
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=density, chunk_size=chunk_size)
    with jax.set_mesh(mesh_of((8,), ("data",))), pytest.warns(UserWarning) as record:
        tx.init({"w": np.zeros(size, np.float32)})
    assert str(record[0].message).endswith(fix)


def test_chunk_sparse_on_an_empty_gradient_does_not_warn():
    tx = jaxcomm.chunk_sparse(optax.sgd(0.1), "data", density=0.5, chunk_size=4)
    with jax.set_mesh(mesh_of((8,), ("data",))), warnings.catch_warnings():
        warnings.simplefilter("error")
        tx.init({"w": np.zeros(0, np.float32)})


# Every entry point that takes axis_name, as one step on 8 devices: a wrong
# name reads the same everywhere (one check, jaxcomm.collectives._axes).
AXIS_ENTRY_POINTS = {
    "allreduce": lambda axis: lambda x: AR(x, axis),
    "reduce_scatter": lambda axis: lambda x: RS(x, axis),
    "all_gather": lambda axis: lambda x: AG(x, axis),
    "allreduce_gradients": lambda axis: _one_step(_ar_grads(axis)),
    "chunk_sparse": lambda axis: _one_step(_sparse(axis)),
    "powersgd": lambda axis: _one_step(jaxcomm.powersgd(axis, rank=1)),
    "diloco": lambda axis: _one_step(
        jaxcomm.diloco(optax.sgd(0.1), optax.sgd(0.7), axis, sync_every=1)
    ),
}


def _one_step(tx):
    def step(w):
        params = {"w": w}
        updates, _ = tx.update(params, tx.init(params), params)
        return updates["w"]

    return step


def _mesh_params():
    return np.ones((8, 8, 8), np.float32)  # one 8x8 matrix per device


@pytest.mark.parametrize("entry", list(AXIS_ENTRY_POINTS))
def test_wrong_axis_name_under_shard_map_names_the_mesh_axes(entry):
    """The user's mistake: axis_name="batch" inside shard_map over a mesh whose
    axis is "data"."""
    message = (
        "axis_name='batch' is not bound here; the axes bound here are ('data',) "
        "(bound by shard_map's mesh or pmap's axis_name)"
    )
    with pytest.raises(ValueError) as info:
        run_sharded(AXIS_ENTRY_POINTS[entry]("batch"), mesh_of((8,), ("data",)), _mesh_params())
    assert str(info.value) == message


@pytest.mark.parametrize("entry", list(AXIS_ENTRY_POINTS))
def test_wrong_axis_name_under_pmap_names_the_pmap_axis(entry):
    message = (
        "axis_name='batch' is not bound here; the axes bound here are ('i',) "
        "(bound by shard_map's mesh or pmap's axis_name)"
    )
    with pytest.raises(ValueError) as info:
        jax.pmap(AXIS_ENTRY_POINTS[entry]("batch"), axis_name="i")(_mesh_params())
    assert str(info.value) == message


@pytest.mark.parametrize("entry", ["allreduce", "reduce_scatter", "all_gather"])
def test_collective_outside_shard_map_says_where_to_call_it(entry):
    with pytest.raises(ValueError) as info:
        jax.jit(AXIS_ENTRY_POINTS[entry]("data"))(np.ones(8, np.float32))
    assert str(info.value) == (
        "axis_name='data' is not bound here, and no axis is: call jaxcomm collectives inside "
        "jax.shard_map or jax.pmap over the axes axis_name names"
    )
