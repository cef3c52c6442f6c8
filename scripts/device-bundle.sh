#!/usr/bin/env bash
# Packs a build's executables and the shared libraries they need (those outside glibc) into one
# folder, stripped, so they can run on a machine that has none of Debian's packages: the lent
# GPU machines (docs/benchmarks.md), where nothing can be installed.
# Usage: scripts/device-bundle.sh BUILD_DIR OUT_DIR
# Then, there: LD_LIBRARY_PATH=OUT_DIR/lib OUT_DIR/bin/gpulazy-bench ...
set -euo pipefail
build=${1:?usage: device-bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: device-bundle.sh BUILD_DIR OUT_DIR}
mkdir -p "$out/bin" "$out/lib"
binaries=()
for f in "$build"/bin/gpulazy-* "$build"/tests/cuda_engine_test; do
  [ -x "$f" ] && binaries+=("$f")
done
[ ${#binaries[@]} -gt 0 ] || { echo "device-bundle: no executables in $build/bin" >&2; exit 1; }
for f in "${binaries[@]}"; do
  strip -o "$out/bin/$(basename "$f")" "$f"
done
# glibc's own libraries come from the machine (they must match its loader); everything else
# travels, libstdc++ included, so the C++ runtime is the one the build was made against.
ldd "${binaries[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
