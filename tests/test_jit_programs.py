"""Programs written as Flax's and JAX's sharding guides and MaxText write
them (tests/jit_programs/), converted by the README's three changes and
nothing else, with every jaxcomm transform.

References: the same program's ``jit`` form (dense: step by step to 1e-4,
every param's and optimizer leaf's placement unchanged; 16-bit wires: within
1% of its loss each step); the converted program on a replicated model (the
same mesh's data axis, a model axis of 1) where the transform's result does
not depend on how the model is split; else the loss goes down. The compiled
step's traffic over the data axis is each device's shards (HLO).
"""

import collections
import functools

import jax
import numpy as np
import optax
import pytest

import jaxcomm
from tests import hlo
from tests.jit_programs import linen_scan, nnx_mlp, nnx_scanned

PROGRAMS = {"nnx_mlp": nnx_mlp, "nnx_scanned": nnx_scanned, "linen_scan": linen_scan}
STEPS = 3


def _adam():
    return optax.adam(1e-2)


def _outer():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def _wire(**kw):
    return lambda: optax.chain(jaxcomm.allreduce_gradients("data", **kw), _adam())


# (id, optimizer, reference, rtol): reference "jit" (the jit form),
# "replicated" (the converted program, model unsplit), "learns". Dense is the
# fast tier's test below; float16 takes bfloat16's path with another dtype.
CONFIGS = [
    ("bf16", _wire(wire_dtype="bfloat16"), "jit", 1e-2),
    ("bf16_error_feedback", _wire(wire_dtype="bfloat16", error_feedback=True), "jit", 1e-2),
    ("bf16_buckets", _wire(wire_dtype="bfloat16", bucket_bytes=1024), "jit", 1e-2),
    ("fp8_error_feedback", _wire(wire_dtype="float8_e4m3fn", error_feedback=True), "learns", 0),
    ("int8_error_feedback", _wire(wire_dtype="int8", error_feedback=True), "learns", 0),
    (
        "powersgd",
        lambda: optax.chain(jaxcomm.powersgd("data", rank=2, start_step=0), _adam()),
        "replicated",
        1e-3,
    ),
    (
        "chunk_sparse",
        lambda: jaxcomm.chunk_sparse(_adam(), "data", density=0.25, chunk_size=128),
        "learns",
        0,
    ),
    (
        "diloco",
        lambda: jaxcomm.diloco(_adam(), _outer(), "data", sync_every=2),
        "replicated",
        1e-3,
    ),
    (
        "diloco_fragments_delay",
        lambda: jaxcomm.diloco(_adam(), _outer(), "data", sync_every=2, fragments=2, delay=1),
        "learns",
        0,
    ),
    ("sparseloco", lambda: jaxcomm.sparseloco(_adam(), "data", sync_every=2), "learns", 0),
    ("double_buffered", lambda: jaxcomm.double_buffered(_adam(), "data"), "replicated", 1e-3),
    (
        "accumulate",
        lambda: jaxcomm.accumulate(_wire()(), "data", every_k=2),
        "replicated",
        1e-3,
    ),
]


def _losses(program, tx, form, model_axis=4, steps=STEPS, dropout=0.0, params_only=False):
    """The losses of `steps` steps, and the placements before and after."""
    on = program.mesh(model_axis)
    objects = program.build(tx, on, dropout)
    before = program.placements(objects, params_only)
    losses = program.run(form, objects, program.batches(on, steps), on)
    return losses, before, program.placements(objects, params_only)


@functools.cache
def _jit_losses(name):
    """The jit program's losses over STEPS steps (one run per program)."""
    return _losses(PROGRAMS[name], _adam(), "jit")[0]


@pytest.mark.parametrize("name", PROGRAMS)
def test_dense_equals_the_jit_program_and_keeps_every_placement(name):
    """The converted program with a dense jaxcomm reduction is the jit
    program step by step; params and optimizer moments stay as placed."""
    program = PROGRAMS[name]
    _, jit_before, _ = _losses(program, _adam(), "jit", steps=0)
    want = _jit_losses(name)
    got, before, after = _losses(program, _wire()(), "jaxcomm")
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert after == before
    # The params' and Adam's moments' placements are the jit program's
    # (jaxcomm's own state adds leaves of its own).
    assert not collections.Counter(jit_before) - collections.Counter(before)
    assert any(spec != jax.sharding.PartitionSpec() for _, spec in before)


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize(
    ("config", "tx", "reference", "rtol"), CONFIGS, ids=[c[0] for c in CONFIGS]
)
def test_every_transform_runs_the_program_unchanged(name, config, tx, reference, rtol):
    program = PROGRAMS[name]
    got, before, after = _losses(program, tx(), "jaxcomm", steps=STEPS, params_only=True)
    assert np.isfinite(got).all(), got
    assert after == before  # the params stay placed as they were
    if reference == "jit":
        np.testing.assert_allclose(got, _jit_losses(name), rtol=rtol)
    elif reference == "replicated":
        want = _losses(program, tx(), "jaxcomm", model_axis=1, steps=STEPS)[0]
        np.testing.assert_allclose(got, want, rtol=rtol)
    else:
        assert got[-1] < got[0], got


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnx_scanned", "linen_scan"])
def test_dropout_in_stacked_layers_gets_each_devices_stream(name):
    """Dropout in layers stacked by nnx.vmap / nn.scan (one RNG key per
    layer): each device folds its index into every layer's key, and the
    program trains."""
    program = PROGRAMS[name]
    losses, _, _ = _losses(
        program, _wire(wire_dtype="bfloat16")(), "jaxcomm", steps=STEPS, dropout=0.1
    )
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


DATA_GROUPS = "{{0,4},{1,5},{2,6},{3,7}}"  # the data axis of a (2, 4) mesh


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_the_traffic_over_the_data_axis_is_each_devices_shards(backend):
    """nnx_mlp's w1 (16, 64) and w2 (64, 4) are split over "model" (4): the
    compiled step sends their shards (256 and 64 elements) and the whole
    replicated bias (64), never a whole matrix."""
    on = nnx_mlp.mesh(4)
    tx = optax.chain(
        jaxcomm.allreduce_gradients("data", wire_dtype="bfloat16", backend=backend), _adam()
    )
    objects = nnx_mlp.build(tx, on)
    with jax.set_mesh(on):
        program = hlo.program(
            nnx_mlp.jaxcomm_step.lower(*objects, *nnx_mlp.batches(on, 1)[0]).compile()
        )
    sent = [
        i
        for i in hlo.collectives(program)
        if hlo.replica_groups(i) == DATA_GROUPS
        or (i.opcode == "custom-call" and i.target in hlo.COMMUNICATING_TARGETS)
    ]
    elements = sum(i.elements for i in sent)
    assert sent and max(a.elements for i in sent for a in i.arrays) <= 256, sent
    assert 256 + 64 + 64 <= elements <= 256 + 64 + 64 + 16, elements
