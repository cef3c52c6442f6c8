#!/usr/bin/env bash
# Style and static checks: clang-format (no diffs allowed), the docs' relative links, clang-tidy
# (bug-finding checks from .clang-tidy) over gpulazy's own sources, and every source compiled on
# its own (-fsyntax-only: a unity batch hides a missing #include). Runs on a configured build
# dir's compile database: its options pick which optional parts are analysed
# (scripts/lint-units.py).
# Usage: scripts/lint.sh [--analyze] [--no-bench-tidy] [BUILD_DIR]
# --analyze: the clang static analyzer's checks too (slow; by hand).
# --no-bench-tidy: clang-tidy leaves out bench/ (clang-format still covers it): a quicker check
# of what gets deployed. CI analyses bench/ too (on unity batches it adds a few seconds).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
analyze=""
tidy_bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --analyze) analyze="clang-analyzer-*,-clang-analyzer-optin.*"; shift ;;
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

# Relative links between the Markdown files, headings included: a renamed heading breaks links.
python3 "$root/scripts/check-doc-links.py"

# clang-tidy on the non-test translation units; tests are mostly gtest macros. Boost 1.74 only
# detects coroutine support under GCC, so clang-tidy is told it is there.
mapfile -t units < <(printf '%s\n' "${sources[@]}" | grep -E '\.cc$' | grep -v '^tests/')
if [ "$tidy_bench" = 0 ]; then
  mapfile -t units < <(printf '%s\n' "${units[@]}" | grep -v '^bench/')
fi
[ -f "$build/compile_commands.json" ] || { echo "lint: $build has no compile_commands.json (configure and build it first)"; exit 1; }
# The protobuf headers the sources include (built already after a build; cheap then).
cmake --build "$build" --target gpulazy_proto_headers >/dev/null
# clang-tidy runs on the build's own units: with unity batches (the default) once per batch, so
# the headers are parsed once per batch, not once per source (the lint takes two thirds of the
# time it took per source: docs/benchmarks.md, "Build and CI time: lint on unity batches"). A
# batch can hide a source's missing #include (an earlier source of the batch made it), so each
# source but a batch's first is also compiled alone, -fsyntax-only. Sources the build leaves out
# (the CUDA engine without the toolkit) are skipped.
mapfile -t tidy_units < <(python3 "$root/scripts/lint-units.py" "$build/compile_commands.json" tidy "${units[@]}")
# Compiled alone by clang when it is there (clang-tidy needs it anyway): it parses these headers
# in three quarters of GCC's time (docs/benchmarks.md, "Build and CI time", session 31).
syntax_compiler=()
command -v clang++ >/dev/null && syntax_compiler=(--compiler=clang++)
mapfile -t alone < <(python3 "$root/scripts/lint-units.py" "$build/compile_commands.json" syntax \
  "${syntax_compiler[@]}" "${units[@]}")
echo "lint: compiling ${#alone[@]} sources alone (the others open their batch)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
printf '%s\n' "${alone[@]}" | xargs -d '\n' -P "$(nproc)" -I{} sh -c {} >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
  grep -E 'error' "$log" || cat "$log"
  echo "lint: a source does not compile on its own (see above)"
  exit 1
fi
# Unity batches include sources, so clang-tidy's bugprone-suspicious-include is off for them;
# outside a batch no source may include a .cc file.
if git grep -nE '^#include "[^"]+\.(cc|cpp)"' -- "${sources[@]}"; then
  echo "lint: a source includes a .cc file"
  exit 1
fi
checks="${analyze:+$analyze,}-bugprone-suspicious-include"
echo "lint: clang-tidy on ${#units[@]} sources in ${#tidy_units[@]} translation units"
[ ${#tidy_units[@]} -gt 0 ] || { echo "lint: the build compiles none of them"; exit 1; }
printf '%s\n' "${tidy_units[@]}" | xargs -P "$(nproc)" -n 1 \
  clang-tidy -p "$build" --quiet --warnings-as-errors='*' --checks="$checks" \
  --extra-arg=-DBOOST_ASIO_HAS_CO_AWAIT=1 --extra-arg=-DBOOST_ASIO_HAS_STD_COROUTINE=1 \
  >"$log" 2>&1 || status=$?
grep -v -E '^[0-9]+ warnings? (and [0-9]+ errors? )?generated|^Suppressed|^Use -header-filter' "$log" || true
[ "$status" -eq 0 ] && echo "lint: ok" || { echo "lint: clang-tidy found problems (see above)"; exit 1; }
