#!/usr/bin/env bash
# Packs a build's executables (with the CUDA engine's two GPU tests) and the shared libraries they
# need (those outside glibc) into one folder, stripped, so they can run on a machine that has none
# of Debian's packages: the lent GPU machines (docs/benchmarks.md), where nothing can be installed.
# Usage: scripts/device-bundle.sh [--tests] BUILD_DIR OUT_DIR
# Then, there: LD_LIBRARY_PATH=OUT_DIR/lib OUT_DIR/bin/gpulazy-bench ...
# --tests also packs every test executable, the plugin and the CTest files under OUT_DIR/build,
# laid out as in BUILD_DIR. The tests name their executables and sources by the absolute paths
# of this checkout, so there the checkout must be reachable at the same path and OUT_DIR/build
# unpacked as BUILD_DIR; then `ctest` runs the suite (docs/benchmarks.md, "The whole suite on
# the lent host").
set -euo pipefail
tests=false
if [ "${1:-}" = "--tests" ]; then
  tests=true
  shift
fi
build=${1:?usage: device-bundle.sh [--tests] BUILD_DIR OUT_DIR}
out=${2:?usage: device-bundle.sh [--tests] BUILD_DIR OUT_DIR}
mkdir -p "$out/bin" "$out/lib"
binaries=()
for f in "$build"/bin/gpulazy-* "$build"/tests/cuda_engine_test "$build"/tests/cuda_session_test \
  "$build"/tests/device_placer_test "$build"/tests/cuda_placement_test; do
  [ -x "$f" ] && binaries+=("$f")
done
[ ${#binaries[@]} -gt 0 ] || { echo "device-bundle: no executables in $build/bin" >&2; exit 1; }
for f in "${binaries[@]}"; do
  strip -o "$out/bin/$(basename "$f")" "$f"
done
if $tests; then
  # Symbols stay (--strip-debug): a sanitizer's or gtest's report still names functions.
  while read -r f; do
    mkdir -p "$out/build/$(dirname "$f")"
    case "$f" in
      *.cmake) cp "$build/$f" "$out/build/$f" ;;
      *) strip --strip-debug -o "$out/build/$f" "$build/$f" && binaries+=("$build/$f") ;;
    esac
  done < <(cd "$build" && find bin tests lib fuzz -maxdepth 2 -type f \
    \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o -name '*_tests.cmake' \
    -o -name '*.so' -o \( -perm -u+x ! -name '*.sh' \) \) ! -path '*/CMakeFiles/*' 2>/dev/null)
  cp "$build/CTestTestfile.cmake" "$out/build/"
fi
# glibc's own libraries come from the machine (they must match its loader); everything else
# travels, libstdc++ included, so the C++ runtime is the one the build was made against.
ldd "${binaries[@]}" 2>/dev/null | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
