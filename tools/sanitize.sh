#!/usr/bin/env bash
# Builds jaxcomm's CPU FFI extension under AddressSanitizer and ThreadSanitizer
# (CMake option JAXCOMM_SANITIZE) and runs the ffi tests against each build.
#
#   tools/sanitize.sh [address|thread ...] [-- pytest args]
#
# Each sanitizer gets its own build dir (build/sanitize-<name>); the normal
# editable install is left alone: tools/sanitize_run.py loads the sanitized
# _ffi module as jaxcomm._ffi before anything imports jaxcomm. The runtime is
# LD_PRELOADed, since python itself is not instrumented. Reports go to
# build/sanitize-<name>/report.*; the script fails if any report names a
# jaxcomm frame. TSan ignores memory accesses made by uninstrumented modules
# (ignore_noninstrumented_modules=1: numpy copying a result out, XLA reading
# it), whose ordering goes through XLA's futures, invisible to TSan; further
# suppressions (hand-offs through uninstrumented
# XLA/numpy/CPython code, each explained) live in tools/tsan.supp; ASan needs
# none (leak checking is off: CPython and jaxlib keep memory alive at exit).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

sanitizers=()
while [[ $# -gt 0 && $1 != -- ]]; do sanitizers+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
[[ ${#sanitizers[@]} -eq 0 ]] && sanitizers=(address thread)
tests=("$@")
[[ ${#tests[@]} -eq 0 ]] && tests=(tests/test_ffi_cpu.py tests/test_ffi_concurrency.py)

python=${PYTHON:-python}
pybind11_dir=$("$python" -m pybind11 --cmakedir)
status=0
for san in "${sanitizers[@]}"; do
  case $san in
    address) lib=libasan.so ;;
    thread) lib=libtsan.so ;;
    *) echo "unknown sanitizer: $san (address or thread)" >&2; exit 2 ;;
  esac
  build=$root/build/sanitize-$san
  echo "== $san: building in $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DJAXCOMM_SANITIZE="$san" -DJAXCOMM_CUDA=OFF \
    -DPython_EXECUTABLE="$(command -v "$python")" -Dpybind11_DIR="$pybind11_dir" >/dev/null
  cmake --build "$build" --target _ffi _ffi_testing >/dev/null
  module=$(ls "$build"/_ffi.*.so)
  testing_module=$(ls "$build"/_ffi_testing.*.so)
  # The C++ runtime too: python does not link it, and ASan's __cxa_throw
  # interceptor must find the real one when it starts (jaxlib throws).
  runtime="$(${CXX:-g++} -print-file-name=$lib) $(${CXX:-g++} -print-file-name=libstdc++.so.6)"
  rm -f "$build"/report.*
  echo "== $san: running ${tests[*]} (preloading $runtime)"
  # detect_leaks=0: CPython and jaxlib keep allocations alive at exit by design;
  # leaks in jaxcomm would show in the run_threads stress test as growth, not here.
  env LD_PRELOAD="$runtime" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=0:log_path=$build/report:symbolize=1" \
    TSAN_OPTIONS="suppressions=$root/tools/tsan.supp:ignore_noninstrumented_modules=1:halt_on_error=0:log_path=$build/report:report_signal_unsafe=0:history_size=4:second_deadlock_stack=1" \
    JAXCOMM_FFI_MODULE="$module" JAXCOMM_FFI_TESTING_MODULE="$testing_module" \
    "$python" tools/sanitize_run.py -q -p no:cacheprovider -n 0 "${tests[@]}" || status=1
  reports=("$build"/report.*)
  if [[ -e ${reports[0]} ]]; then
    n_ours=$(grep -l -E 'jaxcomm|xla_ffi' "${reports[@]}" | wc -l || true)
    echo "== $san: ${#reports[@]} report file(s), $n_ours naming jaxcomm code: ${reports[*]}"
    grep -h -E '^(WARNING|ERROR|SUMMARY): (Address|Thread)Sanitizer|Sanitizer: CHECK failed' "${reports[@]}" | sort | uniq -c || true
    [[ $n_ours -gt 0 ]] && status=1
  else
    echo "== $san: clean (no reports)"
  fi
done
exit $status
