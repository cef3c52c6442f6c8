#!/usr/bin/env bash
# Sets up, builds and runs every test. Usage: scripts/test.sh [--sanitize address,undefined|thread]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=""
if [ "${1:-}" = "--sanitize" ]; then sanitize=${2:?--sanitize needs a value}; fi

"$root/scripts/install-deps.sh"
if [ -n "$sanitize" ]; then
  build="$root/build-${sanitize//,/-}"
  # Benchmarks are not tests: the sanitizer build leaves them out.
  "$root/scripts/build.sh" "$build" -DCMAKE_BUILD_TYPE=Debug -DGPULAZY_SANITIZE="$sanitize" \
    -DGPULAZY_BUILD_BENCH=OFF
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
else
  build="$root/build"
  # The CUDA engine is compiled wherever the CUDA toolkit is installed (its tests skip without
  # a GPU); it needs no GPU to build.
  cuda=()
  [ -x /usr/local/cuda/bin/nvcc ] && cuda=(-DGPULAZY_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  "$root/scripts/build.sh" "$build" "${cuda[@]}"
fi
cd "$build"
# As many tests as cores. Two more took the 2-core VM's ASan + UBSan suite from 215 to 180 s, but
# the load exposed timing-sensitive tests (docs/benchmarks.md, "Build and CI time", session 32):
# not the default until the suite has run that way many times.
ctest --output-on-failure --parallel "$(nproc)" --timeout 300
