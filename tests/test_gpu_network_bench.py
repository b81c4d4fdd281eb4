"""bench/gpu_network.py's harness, on CPU: the batch fit, the reading of a
scheduled HLO program, the targets and the overlap summary against
hand-worked cases, and the training and overlap tables end to end on two
CPU processes (gloo and jaxcomm's TCP transport standing in for NCCL's
sockets). Its GPU timings are the benchmark's to report, not asserted here."""

from __future__ import annotations

import json

import bench_modules
import pytest

gpu_network = bench_modules.load("gpu_network")
network_worker = bench_modules.load("network_worker")


def test_fitted_batch_is_where_the_line_through_the_probes_meets_the_target():
    # 8 -> 10 ms, 16 -> 14 ms: 0.5 ms an example, 6 ms fixed; 30 ms at 48.
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.014, 0.030, 1024) == 48
    # Rounded to a multiple of 8: 31 ms at 50 -> 48 (49.9 -> 48), 33 ms at 54 -> 56.
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.014, 0.031, 1024) == 48
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.014, 0.033, 1024) == 56
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.014, 0.030, 40) == 40  # the cap
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.014, 0.001, 1024) == 8  # the floor
    # Compute that does not grow with the batch: the larger probe.
    assert gpu_network.fitted_batch(8, 0.010, 16, 0.009, 0.030, 1024) == 16
    assert gpu_network.fitted_batch(8, 0.010, 160, 0.009, 0.030, 64) == 64


# A scheduled program as XLA's GPU backend prints it: an all-reduce started
# before two compute instructions and done after them, one done at once, and
# one inside another computation (a conditional's branch) with a fusion
# after its done.
HLO = """\
HloModule jit_step, is_scheduled=true

%branch (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %ar.2 = f32[8]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
  %ar.3 = f32[8]{0} all-reduce-done(%ar.2)
  ROOT %f.9 = f32[8]{0} fusion(%ar.3), kind=kLoop, calls=%fused
}

ENTRY %main (a: f32[8], w: f32[64,64]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = f32[64,64]{1,0} parameter(1)
  %start = f32[8]{0} all-reduce-start(%a), replica_groups={{0,1}}, to_apply=%add
  %gemm = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%w, %w), custom_call_target="__cublas$gemm"
  %gte = f32[64,64]{1,0} get-tuple-element(%gemm), index=0
  %fusion.1 = f32[64]{0} fusion(%gte), kind=kInput, calls=%fused_reduce
  %done = f32[8]{0} all-reduce-done(%start)
  %cp-start = (f32[8]{0}, f32[8]{0}) collective-permute-start(%done), source_target_pairs={{0,1}}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  ROOT %fusion.2 = f32[8]{0} fusion(%cp-done), kind=kLoop, calls=%fused
}
"""


def test_async_overlap_counts_the_compute_between_each_start_and_its_done():
    # In text order: the branch's all-reduce (nothing under it), the entry's
    # (the GEMM and the reduce fusion; a get-tuple-element is not compute),
    # then the collective-permute (nothing).
    assert network_worker.async_overlap(HLO) == [0, 2, 0]
    # Operands printed with their types, or without "%": the same counts.
    typed = HLO.replace("-done(%", "-done(f32[8]{0} %")
    assert typed != HLO and network_worker.async_overlap(typed) == [0, 2, 0]
    bare = HLO.replace("-done(%", "-done(")
    assert network_worker.async_overlap(bare) == [0, 2, 0]
    # Synchronous collectives (XLA's CPU runtime) have no start.
    sync = "ENTRY %m {\n  %x = f32[8]{0} all-reduce(%a), to_apply=%add\n}\n"
    assert network_worker.async_overlap(sync) == []


def _row(processes, path, relative):
    return {"table": "allreduce", "processes": processes, "path": path,
            "relative_to_psum_f32": relative, "error": None}  # fmt: skip


def test_targets_take_each_process_counts_best_path_against_its_limit():
    rows = [
        _row(2, "lax.psum f32", 1.0),
        _row(2, "lax.psum bf16", 0.4),  # not an ffi path
        _row(2, "ffi ring bf16", 0.9),
        _row(2, "ffi alltoall f16", 0.54),
        _row(2, "ffi direct f32", 1.02),
        _row(2, "ffi alltoall f32", 1.2),
        _row(2, "ffi masked bf16 d=0.15", 0.35),
        _row(4, "ffi alltoall bf16", 0.6),
        _row(4, "ffi alltoall f32", None),  # failed: no value
    ]
    overlaps = [{"processes": 2, "xla": "default", "double_buffering_over_bound": 1.4,
                 "dga_over_bound": 1.1}]  # fmt: skip
    got = {(c["target"], c["processes"]): c for c in gpu_network.targets(rows, overlaps)}
    assert set(got) == {
        ("narrow_wire", 2), ("float32_wire", 2), ("masked", 2), ("narrow_wire", 4),
        ("double_buffered", 2),
    }  # fmt: skip
    assert (got["narrow_wire", 2]["path"], got["narrow_wire", 2]["met"]) == (
        "ffi alltoall f16",
        True,
    )
    assert got["float32_wire", 2]["value"] == 1.02 and got["float32_wire", 2]["met"]
    assert got["masked", 2]["value"] == 0.35 and not got["masked", 2]["met"]
    assert got["narrow_wire", 4]["value"] == 0.6 and not got["narrow_wire", 4]["met"]
    assert got["double_buffered", 2]["path"] == "dga" and got["double_buffered", 2]["met"]


def test_overlap_summary_divides_each_step_by_the_larger_of_compute_and_psum():
    rows = [
        {"config": "compute", "step_s": 0.01, "mean_step_s": 0.010, "probe": True},
        {"path": "auto", "time_s": 0.080},
        {"config": "compute", "step_s": 0.1, "mean_step_s": 0.100, "batch_per_device": 96},
        {"config": "dense", "step_s": 0.17, "mean_step_s": 0.180},
        {"config": "double_buffering", "step_s": 0.11, "mean_step_s": 0.110,
         "compute_under_collectives": [7]},
        {"config": "dga", "error": "ValueError: ..."},
    ]  # fmt: skip
    s = gpu_network.overlap_summary(rows)
    assert s["bound_s"] == 0.100 and s["collective_s"] == 0.080
    assert s["compute_over_collective"] == pytest.approx(1.25)
    assert s["dense_over_bound"] == pytest.approx(1.8)
    assert s["double_buffering_over_bound"] == pytest.approx(1.1)
    assert s["double_buffering_compute_under_collectives"] == [7]
    assert s["batch_per_device"] == 96 and "dga_s" not in s


@pytest.mark.slow
def test_training_and_overlap_tables_run_on_two_cpu_processes(tmp_path, capsys):
    out = tmp_path / "gpu_network.json"
    configs = "dense,bf16_ffi,double_buffering,compute"
    code = gpu_network.main(
        ["--tables", "train,overlap", "--processes", "2", "--models", "mlp",
         "--configs", configs, "--overlap-configs", "compute,dense,double_buffering",
         "--steps", "2", "--features", "16", "--hidden", "32", "--batch-per-device", "8",
         "--max-batch", "64", "--repeats", "2", "--xla-settings", "default",
         "--timeout", "240", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert json.loads(printed.strip().splitlines()[-1]) == result
    train = [r for r in result["rows"] if r["table"] == "train"]
    assert [r["config"] for r in train] == configs.split(",")
    for r in train:
        assert r["processes"] == 2 and r["model"] == "mlp" and r["devices"] == 2
        assert r["speedup_vs_dense"] == pytest.approx(
            next(d["mean_step_s"] for d in train if d["config"] == "dense") / r["mean_step_s"]
        )
    # The same start; the bfloat16 wire over the ffi path trains as the pmean
    # step does (to its rounding), double buffering (a step late) does not.
    loss = {r["config"]: r["loss_last"] for r in train}
    assert len({r["loss_first"] for r in train}) == 1
    assert loss["bf16_ffi"] == pytest.approx(loss["dense"], abs=1e-3)
    assert abs(loss["double_buffering"] - loss["dense"]) > 1e-2

    overlap = [r for r in result["rows"] if r["table"] == "overlap"]
    # Two probes, the psum of the gradient, then the configurations at the fitted batch.
    assert [r.get("config", r.get("path")) for r in overlap] == [
        "compute", "compute", "auto", "compute", "dense", "double_buffering"
    ]  # fmt: skip
    params = overlap[0]["params"]
    assert overlap[2]["bytes"] == params * 4 and overlap[2]["wire"] == "float32"
    assert [r["batch_per_device"] for r in overlap[:2]] == [8, 8 * gpu_network.PROBE_FACTOR]
    assert [r["probe"] for r in overlap] == [True, True, False, False, False, False]
    (summary,) = result["overlap"]
    assert summary["batch_per_device"] == overlap[3]["batch_per_device"]
    assert 8 <= summary["batch_per_device"] <= 64 and summary["batch_per_device"] % 8 == 0
    bound = max(overlap[3]["mean_step_s"], overlap[2]["time_s"])
    assert summary["double_buffering_over_bound"] == pytest.approx(
        overlap[5]["mean_step_s"] / bound
    )
    for r in overlap[3:]:
        assert len(r["compute_under_collectives"]) == r["async_collectives"]
    (check,) = [c for c in result["targets"] if c["target"] == "double_buffered"]
    assert check["value"] == pytest.approx(summary["double_buffering_over_bound"])
