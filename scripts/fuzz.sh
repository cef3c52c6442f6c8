#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + coverage) in a separate build dir and
# runs each for a bounded time from its committed seed corpus (tests/fuzz/corpus/<target>/).
# New inputs go to BUILD_DIR/corpus/<target>/ (never into the repository); a crash leaves its
# input in BUILD_DIR/artifacts/ and fails the script. Prints a table of executions per target.
# server_tls is the server harness again with its TCP listener speaking TLS (GPULAZY_FUZZ_TLS=1):
# the same executable and seed corpus, new inputs kept apart.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (default 30)] [BUILD_DIR (default build-fuzz)]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-30}
build=${2:-$root/build-fuzz}
targets=(frame manifest criu chunk_codec server server_tls)
executables=(frame manifest criu chunk_codec server)

command -v clang++ >/dev/null || { echo "fuzz: clang++ missing (scripts/install-deps.sh)"; exit 1; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=true
fi
start=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGPULAZY_BUILD_FUZZERS=ON -DGPULAZY_BUILD_TESTS=OFF \
    -DGPULAZY_BUILD_BENCH=OFF >/dev/null
fi
cmake --build "$build" --parallel "$(nproc)" --target "${executables[@]/#/fuzz_}"
built=$(date +%s)
echo "fuzz: built in $((built - start)) s"

mkdir -p "$build/artifacts"
summary=()
status=0
for target in "${targets[@]}"; do
  work="$build/corpus/$target"
  mkdir -p "$work"
  log="$build/fuzz_$target.log"
  executable=$target seeds=$target tls=0
  if [ "$target" = server_tls ]; then executable=server seeds=server tls=1; fi
  echo "fuzz: $target for $seconds s"
  # -max_len: room for a whole seed chunk frame (the server's scripts: a few hundred actions, each
  # a round trip or a short wait at most); -timeout: one input may not take ten seconds;
  # -rss_limit_mb: the harnesses stay far below it unless something leaks or balloons.
  max_len=65536
  [ "$executable" = server ] && max_len=4096
  if ! GPULAZY_FUZZ_TLS=$tls "$build/fuzz/fuzz_$executable" -max_total_time="$seconds" \
      -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$target-" "$work" "$root/tests/fuzz/corpus/$seeds" \
      >"$log" 2>&1; then
    status=1
    echo "fuzz: $target FAILED; input in $build/artifacts/, log $log"
    tail -n 40 "$log"
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  files=$(find "$work" "$root/tests/fuzz/corpus/$seeds" -type f | wc -l)
  summary+=("$(printf '%-12s %10s execs %8s/s  cov %6s  corpus %5s' "$target" "${execs:-?}" \
    "${speed:-?}" "${cov:-?}" "$files")")
done
echo "fuzz: ${seconds} s per target, $(( $(date +%s) - start )) s in all (build $((built - start)) s)"
printf '  %s\n' "${summary[@]}"
exit $status
