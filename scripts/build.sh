#!/usr/bin/env bash
# Configures and builds gpulazy. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
# Executables land in BUILD_DIR/bin (default build/bin).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # Hash paths relative to the checkout, so a fresh clone elsewhere reuses earlier objects.
  export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=true
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" "$@" >/dev/null
else
  cmake -S "$root" -B "$build" "$@" >/dev/null
fi
cmake --build "$build" --parallel "$(nproc)"
