#!/usr/bin/env bash
# Everything a GPU machine can check, in one command and without the network,
# in this order: builds jaxcomm with its CUDA module against the jax installed
# there (once); runs every GPU test (kernels against NumPy, NCCL collectives,
# a plain JAX and a Flax/optax training step with backend="ffi" against
# backend="xla") and the host-side CUDA tests; the collectives across 2 and 4
# processes sharing the GPU over NCCL's sockets (tests/test_cuda_processes.py:
# every algorithm and wire, masked, hierarchical, a training step, against
# NumPy); bench/kernels.py (each kernel against XLA's fusion of the same
# work); the tables on that network (bench/gpu_network.py: the 64 MiB
# allreduce against lax.psum float32, double buffering's overlap, the
# training step of every configuration), each against its target; a smoke
# subset of the CPU suite (which a GPU machine runs on its 8 forced host
# devices, -m "not gpu"); tools/nccl_group_probe.cc (the host's cost of an
# NCCL group). With OWN_COMMS=1, where this jaxlib lends handlers XLA's NCCL
# communicators, the GPU tests once more on a build forced onto jaxcomm's own
# (the path jaxlib 0.10 takes): two more builds, so raise BUDGET_S (to 900)
# with it.
#
#   tools/gpu_check.sh [OUTDIR]        # default: build/gpu_check (git ignores build/)
#
# Writes OUTDIR/gpu_check.log (everything printed) and OUTDIR/summary.json
# (machine, each step's exit code and seconds, test counts with every failure
# and skip reason, the benchmarks' numbers). A failing step does not stop
# the next; the exit code is non-zero if any step failed. Each step has a
# time limit, cut to what is left of BUDGET_S (default 470 s), so the whole
# run ends within 8 minutes; a step with no time left is skipped (exit 125).
#
# Needs, already installed: nvidia-smi, nvcc (on PATH or in CUDACXX), a jax
# with its CUDA plugin, nvidia-nccl-cu13, and jaxcomm's build and test
# requirements (scikit-build-core, pybind11, cmake, ninja, pytest; flax for
# the Flax step, which is skipped and reported without it).
# CUDA_ARCH (default 90), KERNEL_SIZE (default 256M), BUDGET_S, RESERVE_S (seconds
# kept from the network tables for the steps after them, default 60), PYTHON: overrides.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/gpu_check}
mkdir -p "$out/steps"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: >"$log"
: >"$out/steps.jsonl"
rm -f "$out"/steps/*.out "$out"/test_*.xml
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
py=${PYTHON:-python3}
status=0
t0=$SECONDS

budget=${BUDGET_S:-470}

# step NAME LIMIT_S COMMAND...: runs it under a time limit (at most what is
# left of the budget), its output into the log and steps/NAME.out; records
# exit code and seconds; goes on.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - t0)))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: skipped, ${left} s of the ${budget} s budget left" | tee -a "$log"
    printf '{"step": "%s", "exit": 125, "seconds": 0, "timed_out": false}\n' "$name" >>"$out/steps.jsonl"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "=== $name: $*" | tee -a "$log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" "$out/steps/$name.out"
  local rc=${PIPESTATUS[0]}
  local timed_out=false
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
  echo "=== $name: exit $rc in $((SECONDS - start)) s$([ "$timed_out" = true ] && echo " (time limit $limit s)")" |
    tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
  printf '{"step": "%s", "exit": %d, "seconds": %d, "timed_out": %s}\n' \
    "$name" "$rc" "$((SECONDS - start))" "$timed_out" >>"$out/steps.jsonl"
}

step machine 30 sh -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || exit 1; \
  (command -v nvcc >/dev/null && nvcc --version | tail -1) || echo \"nvcc: \${CUDACXX:-not on PATH}\"; \
  $py -c 'import sys, jax, jaxlib; print(\"python\", sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, jax.devices())'"

# The editable install builds into build/<wheel tag>; no index is consulted.
step build 150 env JAXCOMM_CUDA=1 CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
  "$py" -m pip install -q --no-index --no-build-isolation --no-deps -e .

# The module must be the one just built from this checkout.
step module 30 "$py" - "$PWD" <<'EOF'
import os, sys
import jaxcomm
from jaxcomm import _ffi_cuda
root = os.path.realpath(sys.argv[1])
print("jaxcomm from", os.path.dirname(jaxcomm.__file__))
print("CUDA module", _ffi_cuda.__file__, "NCCL", _ffi_cuda.nccl_version())
print("ffi gpu:", jaxcomm.ffi_available("gpu"))
print("on XLA's NCCL communicators:", _ffi_cuda.uses_xla_communicators)
# jaxcomm registers the collectives; the kernels alone are for tests and bench/kernels.py.
print("handlers:", sorted(_ffi_cuda.registrations()), "tests' kernels:", sorted(_ffi_cuda.testing_registrations()))
assert os.path.realpath(jaxcomm.__file__).startswith(root + os.sep), "jaxcomm is not this checkout"
assert jaxcomm.ffi_available("gpu"), "the CUDA handlers are not registered"
EOF

# The processes' test is a step of its own, below.
gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v test_cuda_processes.py | tr '\n' ' ')
# The host-side CUDA tests too: there they compile against this jaxlib's headers.
gpu_tests="${gpu_tests:-tests/test_cuda.py} tests/test_cuda_host.py"
# shellcheck disable=SC2086  # one word per file
step tests 150 "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra $gpu_tests \
  --junitxml="$out/test_gpu.xml"

# 2 and 4 processes on the one GPU, NCCL over loopback sockets: before the
# smaller steps below, which the budget cuts first.
step processes 180 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra \
  tests/test_cuda_processes.py --junitxml="$out/test_processes.xml"
# Each kernel against XLA's fusion of the same work (target: 0.95 of it).
step kernels 60 "$py" bench/kernels.py --size "${KERNEL_SIZE:-256M}" --json

# The network tables (allreduce, then overlap, then training) take what is
# left but a reserve for the two short steps after them; --budget cuts their
# last jobs, and the JSON is written after every job, so what was measured
# stays.
left=$((budget - (SECONDS - t0) - ${RESERVE_S:-60}))
step gpu_network $((left + 20)) "$py" bench/gpu_network.py --budget "$left" --timeout 150 \
  --json "$out/gpu_network.json" --plot "$out/gpu_network.png"

# The CPU handlers and chunk_sparse on the CPU platform, next to the CUDA
# plugin: "not gpu" pins the session to the CPU (tests/conftest.py).
step cpu_tests 45 "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra -m "not gpu" \
  tests/test_ffi_cpu.py tests/test_chunk_sparse.py --junitxml="$out/test_cpu.xml"

# What a send/recv group costs the host on a non-blocking NCCL communicator
# (jaxcomm's own are) against a blocking one: tools/nccl_group_probe.cc.
step nccl_groups 40 sh -c "nccl=\$($py -c 'import importlib.util as u; print(list(u.find_spec(\"nvidia.nccl\").submodule_search_locations)[0])') && \
  \${CUDACXX:-nvcc} -x c++ -std=c++17 -O2 -I\$nccl/include tools/nccl_group_probe.cc -o '$out/nccl_group_probe' \
    -L\$nccl/lib -l:libnccl.so.2 -Xlinker -rpath=\$nccl/lib && '$out/nccl_group_probe'"

# The GPU tests again on jaxcomm's own NCCL communicators, the path a jaxlib
# without XLA's collectives extension (0.10) takes; then the default build
# back. Only with OWN_COMMS=1 (three builds do not fit the budget), and only
# where this jaxlib has the extension (elsewhere the tests above ran it).
if [ "${OWN_COMMS:-0}" = 1 ] && [ -f "$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())')/xla/ffi/api/collectives_api.h" ]; then
  step build_own_comms 240 env JAXCOMM_CUDA=1 \
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DCMAKE_CXX_FLAGS=-DJAXCOMM_XLA_COMMS=0" \
    "$py" -m pip install -q --no-index --no-build-isolation --no-deps -e .
  # shellcheck disable=SC2086  # one word per file
  step tests_own_comms 300 env JAXCOMM_TEST_OWN_COMMS=1 "$py" -m pytest -q -p no:cacheprovider -o addopts=-ra $gpu_tests \
    --junitxml="$out/test_gpu_own_comms.xml"
  step build_default 240 env JAXCOMM_CUDA=1 CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
    "$py" -m pip install -q --no-index --no-build-isolation --no-deps -e .
fi

# The summary needs nothing but the standard library, so it is written
# whatever broke above.
"$py" - "$out" "$((SECONDS - t0))" "$status" <<'EOF' | tee -a "$log"
import json, os, sys
import xml.etree.ElementTree as ET

out, seconds, status = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def read(name):
    path = os.path.join(out, "steps", name + ".out")
    return open(path).read() if os.path.exists(path) else ""


def tests(xml):
    path = os.path.join(out, xml)
    if not os.path.exists(path):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skipped = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                first = (child.get("message") or child.text or "").strip().splitlines()
                failures.append({"test": name, "message": first[0][:500] if first else ""})
            elif child.tag == "skipped":
                outcome = "skipped"
                reason = child.get("message") or ""
                skipped[reason] = skipped.get(reason, 0) + 1
        counts[outcome] += 1
    return {**counts, "failures": failures, "skip_reasons": skipped}


def gpu_network():
    path = os.path.join(out, "gpu_network.json")
    try:
        return json.load(open(path)) if os.path.exists(path) else None
    except ValueError:
        return None


def kernels():
    text = read("kernels")
    start = text.find("{")
    try:
        return json.loads(text[start : text.rindex("}") + 1]) if start >= 0 else None
    except ValueError:
        return None


steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
summary = {
    "ok": status == 0,
    "seconds": seconds,
    "machine": read("machine").strip().splitlines(),
    "steps": steps,
    "tests": tests("test_gpu.xml"),
    "tests_own_comms": tests("test_gpu_own_comms.xml"),
    "cpu_tests": tests("test_cpu.xml"),
    "processes": tests("test_processes.xml"),
    "gpu_network": gpu_network(),
    "kernels": kernels(),
    "nccl_groups": read("nccl_groups").strip().splitlines()[-1:],
}
# The targets in one place: the network tables' (narrow wire, float32 wire,
# masked exchange, double-buffered step) and the kernels under XLA's fusion.
summary["targets"] = (summary["gpu_network"] or {}).get("targets")
summary["kernels_below_xla_target"] = (summary["kernels"] or {}).get("kernels_below_xla_target")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
failed = [s["step"] for s in steps if s["exit"] != 0]


def counts(t):
    t = t or {}
    return (
        f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
        f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped"
    )


print(
    f"=== summary: {'OK' if not failed else 'FAILED: ' + ', '.join(failed)}; "
    f"tests {counts(summary['tests'])}; on own communicators "
    f"{counts(summary['tests_own_comms'])}; CPU smoke {counts(summary['cpu_tests'])}; "
    f"processes {counts(summary['processes'])}; "
    f"{seconds} s; {os.path.join(out, 'summary.json')}"
)
for t in summary["targets"] or []:
    where = f"{t['processes']} processes" + (f", XLA {t['xla']}" if "xla" in t else "")
    print(
        f"=== target {t['target']} ({where}): {t['value']:.2f} against {t['limit']} "
        f"({t['path']}): {'met' if t['met'] else 'MISSED'}"
    )
if summary["kernels"] is not None:
    print(f"=== kernels under 0.95 of XLA's fusion: {summary['kernels_below_xla_target']}")
EOF
exit $status
