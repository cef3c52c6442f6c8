#!/usr/bin/env bash
# Style and static checks: clang-format (no diffs allowed) and clang-tidy (bug-finding checks
# from .clang-tidy) over gpulazy's own sources. Needs a configured build dir (its options pick
# which optional parts are analysed).
# Usage: scripts/lint.sh [--analyze] [--no-bench-tidy] [BUILD_DIR]
# --no-bench-tidy: clang-tidy leaves out bench/ (clang-format still covers it). CI uses it to fit
# its 30 minutes: the benchmarks' units are the slowest to analyse (about 90 s of the lint on two
# cores) and are not part of what gets deployed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
analyze=""
tidy_bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --analyze) analyze="--checks=clang-analyzer-*,-clang-analyzer-optin.*"; shift ;;
    --no-bench-tidy) tidy_bench=0; shift ;;
    *) break ;;
  esac
done
build=${1:-$root/build}
cd "$root"

mapfile -t sources < <(git ls-files 'proto/*.cc' 'proto/*.h' 'lazy-server/*.cc' 'lazy-server/*.h' \
  'page-client/*.cc' 'page-client/*.h' 'plugin/*.cc' 'plugin/*.h' 'bench/*.cc' 'bench/*.h' \
  'tests/*.cc' 'tests/*.h')
[ ${#sources[@]} -gt 0 ] || { echo "lint: no sources"; exit 0; }

echo "lint: clang-format on ${#sources[@]} files"
clang-format --dry-run -Werror "${sources[@]}"

# clang-tidy on the non-test translation units; tests are mostly gtest macros. Boost 1.74 only
# detects coroutine support under GCC, so clang-tidy is told it is there.
mapfile -t units < <(printf '%s\n' "${sources[@]}" | grep -E '\.cc$' | grep -v '^tests/')
if [ "$tidy_bench" = 0 ]; then
  mapfile -t units < <(printf '%s\n' "${units[@]}" | grep -v '^bench/')
fi
echo "lint: clang-tidy on ${#units[@]} translation units"
[ -f "$build/CMakeCache.txt" ] || { echo "lint: $build is not a configured build dir (build first)"; exit 1; }
# clang-tidy needs a command per source file; a unity build's database lists only the batches. So
# the lint configures a database of its own beside the build, unity off, with the build's options
# (CUDA, bench, build type), and generates the protobuf headers the sources include.
compdb="$build/lint-compdb"
cached() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
options=(-DGPULAZY_UNITY_BUILD=OFF -DCMAKE_BUILD_TYPE="$(cached CMAKE_BUILD_TYPE)")
for key in GPULAZY_WITH_CUDA GPULAZY_BUILD_BENCH GPULAZY_BUILD_TESTS CMAKE_CUDA_COMPILER CUDAToolkit_ROOT; do
  value=$(cached "$key")
  [ -n "$value" ] && options+=("-D$key=$value")
done
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$compdb" "${generator[@]}" "${options[@]}" >/dev/null
cmake --build "$compdb" --target gpulazy_proto_headers >/dev/null
build=$compdb
# Optional parts (the CUDA engine without the toolkit) are not in this build: skip them.
mapfile -t units < <(for u in "${units[@]}"; do grep -qF "/$u\"" "$build/compile_commands.json" && echo "$u"; done)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
printf '%s\n' "${units[@]}" | xargs -P "$(nproc)" -n 4 \
  clang-tidy -p "$build" --quiet --warnings-as-errors='*' $analyze \
  --extra-arg=-DBOOST_ASIO_HAS_CO_AWAIT=1 --extra-arg=-DBOOST_ASIO_HAS_STD_COROUTINE=1 \
  >"$log" 2>&1 || status=$?
grep -v -E '^[0-9]+ warnings? (and [0-9]+ errors? )?generated|^Suppressed|^Use -header-filter' "$log" || true
[ "$status" -eq 0 ] && echo "lint: ok" || { echo "lint: clang-tidy found problems (see above)"; exit 1; }
