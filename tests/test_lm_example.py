"""Smoke test of the byte-level language model example (examples/lm) on a small corpus."""

import json
import pathlib

import numpy as np
import pytest

from tests import example_modules

data, main = example_modules.load("lm", "data", "main")

SMALL = dict(train_bytes=64 * 2**10, val_bytes=16 * 2**10)
STEPS = 20


def test_corpus_is_deterministic_and_split_by_file():
    corpus, again = data.load_corpus(**SMALL), data.load_corpus(**SMALL)
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.val, again.val)
    assert (len(corpus.train), len(corpus.val)) == (SMALL["train_bytes"], SMALL["val_bytes"])
    assert corpus.val_files and not set(corpus.train_files) & set(corpus.val_files)
    assert all(data.is_validation(name) for name in corpus.val_files)
    # The validation bytes are the first held-out file's own source.
    first = pathlib.Path(data.stdlib_files()[0].parent, corpus.val_files[0]).read_bytes()
    assert corpus.val[:100].tobytes() == first[:100]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    argv = ["--configs", "dense,bf16,db", "--seeds", "0", "--steps", str(STEPS)]
    argv += ["--batch-per-device", "4", "--eval-every", "10", "--no-progress", "--out", str(out)]
    argv += ["--train-bytes", str(SMALL["train_bytes"]), "--val-bytes", str(SMALL["val_bytes"])]
    assert main.main(argv) == 0
    result = json.loads((out / "lm.json").read_text())
    result["rows"] = {r["config"]: r for r in result["rows"]}
    result["png"] = out / "lm.png"
    return result


@pytest.mark.slow
def test_training_lowers_validation_loss(results):
    untrained, *_, trained = results["val_losses"]["dense"][0]
    assert results["val_steps"]["dense"] == [0, 10, STEPS]
    assert untrained > 5.0  # near ln(256) = 5.55: an untrained model knows nothing of bytes
    assert trained < untrained - 1.5, results["val_losses"]["dense"]


@pytest.mark.slow
def test_bf16_wire_matches_dense_at_half_the_bytes(results):
    dense, bf16 = results["val_losses"]["dense"][0], results["val_losses"]["bf16"][0]
    assert bf16[0] == dense[0]  # same seed, same model
    assert abs(bf16[-1] - dense[-1]) < 0.03, (bf16, dense)
    assert results["rows"]["bf16"]["bytes_ratio"] == 0.5


@pytest.mark.slow
def test_double_buffering_applies_the_first_gradient_a_step_late(results):
    dense, db = results["losses"]["dense"][0], results["losses"]["db"][0]
    assert db[0] == dense[0]  # the same first batch at the same parameters
    # Step 1 applies db's zero buffer, so its second loss is still untrained.
    assert db[1] > dense[1] + 0.1, (db[:3], dense[:3])


@pytest.mark.slow
def test_table_and_curves_are_written(results):
    assert results["png"].stat().st_size > 0
    assert set(results["rows"]) == {"dense", "bf16", "db"}


@pytest.mark.slow
def test_sharded_model_trains_as_the_replicated_one():
    """--fsdp 4: the model sharded over 4 devices, jaxcomm over the other 2.
    Dense, it follows the replicated run step for step (the same global
    batches, sums in another order); with a wire and chunk-sparse it trains,
    each device sending its shards' bytes."""
    (train,) = example_modules.load("lm", "train")
    corpus = data.load_corpus(**SMALL)
    common = dict(steps=8, batch_per_device=4, eval_every=8, eval_windows=64, **SMALL)
    replicated = train.train(train.Run(**common), corpus=corpus)
    sharded = train.train(train.Run(fsdp=4, **common), corpus=corpus)
    np.testing.assert_allclose(sharded["losses"], replicated["losses"], rtol=2e-4)
    np.testing.assert_allclose(sharded["val_losses"], replicated["val_losses"], rtol=2e-4)
    # Over "data" each device sends its shards: a quarter of the matrices'
    # bytes (the vectors, whole, and 2 data devices for 8 move the rest).
    assert sharded["bytes_per_step"] < 0.3 * replicated["bytes_per_step"]
    for name in ("fp16+ef", "csc"):
        run = train.Run(comm=train.CONFIGURATIONS[name], fsdp=4, **common)
        result = train.train(run, corpus=corpus)
        assert result["val_losses"][-1] < result["val_losses"][0] - 0.5, (name, result)


@pytest.mark.slow
def test_powersgd_and_diloco_configurations_train():
    """PowerSGD with its defaults and DiLoCo (outer Nesterov SGD 0.7, momentum
    0.9) are configurations like the others. On 10 steps DiLoCo syncs every 5
    (50 in the table): 2 syncs of the whole model in float32 each, so it
    sends 2/10 of what dense sends; PowerSGD is in its 50 dense steps, so it
    sends what dense sends (tests/test_powersgd.py checks what follows)."""
    (train,) = example_modules.load("lm", "train")
    assert train.CONFIGURATIONS["powersgd"].powersgd  # with the transform's defaults
    assert train.CONFIGURATIONS["diloco"].sync_every == 50
    assert train.OUTER_SGD == dict(learning_rate=0.7, momentum=0.9, nesterov=True)
    corpus = data.load_corpus(**SMALL)
    common = dict(steps=10, batch_per_device=4, eval_every=10, eval_windows=64, **SMALL)
    dense = train.train(train.Run(**common), corpus=corpus)
    diloco = train.Comm(sync_every=5)
    for comm in (train.CONFIGURATIONS["powersgd"], diloco):
        result = train.train(train.Run(comm=comm, **common), corpus=corpus)
        assert result["val_losses"][-1] < result["val_losses"][0] - 0.5, (comm, result)
        if comm is diloco:
            assert result["bytes_per_step"] == pytest.approx(0.2 * dense["bytes_per_step"])
        else:
            assert result["bytes_per_step"] == pytest.approx(dense["bytes_per_step"])


def test_outer_step_options_reach_diloco_only():
    """--outer-lr / --outer-momentum set DiLoCo's outer SGD (plain averaging
    with 1 and 0), not SparseLoCo's. Hand-worked first steps on g = 1:
    Nesterov 0.7 / 0.9 gives -0.7 (1 + 0.9) = -1.33; averaging -1."""
    (train,) = example_modules.load("lm", "train")
    argv = ["--configs", "diloco,sparseloco", "--outer-lr", "1", "--outer-momentum", "0"]
    args = main.parse_args(argv)
    averaging, sparse = main.comm_for("diloco", args), main.comm_for("sparseloco", args)
    assert (averaging.outer_lr, averaging.outer_momentum) == (1.0, 0.0)
    assert (sparse.outer_lr, sparse.outer_momentum) == (None, None)
    g = {"w": np.ones(3, np.float32)}
    for comm, first in ((train.CONFIGURATIONS["diloco"], -1.33), (averaging, -1.0)):
        outer = train.outer_sgd(comm)
        u, _ = outer.update(g, outer.init(g))
        np.testing.assert_allclose(u["w"], first, rtol=1e-6)


def test_plot_shows_the_first_point():
    """The y-limits reach the untrained loss (every curve's first point) and
    the lowest point; a diverging run goes off the top."""
    curves = {"dense": [5.6, 3.0, 2.5], "db": [5.6, 9.0, 8.0], "csc": [5.6, 3.2, 2.4]}
    lo, hi = main.y_limits(curves)
    assert lo < 2.4 and 5.6 < hi < 9.0
