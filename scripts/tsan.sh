#!/usr/bin/env bash
# ThreadSanitizer over the threaded parts: the restore client (RestoreSession and its stream and
# demand threads, LocalRestore, the engine gate), the server (scheduler, sessions, shutdown,
# limits, thread pools), the userfaultfd pager (fault threads racing the background fill, the
# server killed while faults wait, the pager in another process) and the end-to-end tests that
# run them together (64 concurrent sessions, kill -9 + restart, fetch over unix and tcp, chunks
# read by reference from passed image files on reader threads). CI runs that set, or --all when
# its budget leaves room for it (.ci/run).
# --all adds the server under protocol abuse and reply back-pressure,
# the embedded server, the fetch tool, and the CRIU plugin inside the simulated CRIU host
# (page client threads in CRIU's master, the fault channel, TLS, tasks dying mid-restore), and
# the plugin's fault channel and SDMA engine (its reaper) against the fake device, and the
# security tests (TLS listeners, credentials reloaded on SIGHUP while the server serves).
# The CI set also has placement's destinations opening on disk threads while the stream runs
# (an embedded server), and replays the server fuzz harness's seed scripts
# (tests/fuzz/fuzz_server.cc): the server's network, disk and demand threads under hostile
# clients, in one process, with plain TCP and again with TLS.
# Built RelWithDebInfo (TSan is fast enough optimized; Debug makes the image synthesis crawl)
# into its own build dir; only the targets these tests need are built. Any race report fails
# the run.
# --quick: only the cores of the threaded parts (the restore session's threads, the server's
# scheduler and dispatcher, the userfaultfd pager): four test executables, 145 s from a clean
# build dir on session 61's 2-core VM, where CI's set took 270 s. CI runs it when its budget has
# no room for the set (.ci/run).
# Usage: scripts/tsan.sh [--all|--quick] [BUILD_DIR (default build-tsan)]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
all=false
quick=false
case "${1:-}" in
  --all) all=true; shift ;;
  --quick) quick=true; shift ;;
esac
build=${1:-$root/build-tsan}
"$root/scripts/install-deps.sh"
targets=(client_basics_test client_session_test client_local_restore_test server_unit_test server_integration_test
  server_image_files_test server_placement_open_test server_warm_test e2e_restore_test e2e_load_test uffd_test
  fuzz_server_replay gpulazy-server gpulazy-client)
suites='RestoreSession|RestoreSessionInPlace|RestoreSessionThreads|RestoreSessionLanes|LocalRestore|SchedulerTest'
suites+='|DispatcherTest|DemandLoopsTest'
suites+='|ImageStoreTest|ServerTest|ServerShutdownTest|ServerLimitsTest|ServerSendfileTest|ServerThreads'
suites+='|ImageFilesTest|ImageFilesOff|E2eFetch|E2eRestore|Load|PopulateAhead|HostCopyEngine|ImageTable'
suites+='|EngineGate|Threads|InstallFileChunkTest|UffdPager|UffdProgramChangesItsMemory|Modes/UffdProgramChangesItsMapping|UffdRegistration|UffdKernelFaults|Modes/UffdRestore|Modes/UffdHandover|Handover'
suites+='|Threads/DemandNetworkThreadsTest|ServerFuzzCorpus|ServerTlsFuzzCorpus|PlacementOpenTest|PlacementWithASmallDemandLimit'
suites+='|ServerSawTheBreak/SupersedeTest'
suites+='|Warm|ReadIntoPageCache'
if $quick; then
  targets=(client_basics_test client_session_test server_unit_test uffd_test gpulazy-server)
  suites='RestoreSession|RestoreSessionInPlace|RestoreSessionThreads|RestoreSessionLanes'
  suites+='|SchedulerTest|DispatcherTest|DemandLoopsTest|EngineGate|Threads|Handover'
  suites+='|UffdPager|UffdProgramChangesItsMemory|Modes/UffdProgramChangesItsMapping'
  suites+='|UffdRegistration|UffdKernelFaults|Modes/UffdRestore|Modes/UffdHandover'
fi
if $all; then
  targets+=(server_abuse_test server_backpressure_test server_embedding_test plugin_host_test
    plugin_unit_test client_fetch_cli_test server_security_test)
  suites+='|ProtocolAbuseTest|ReplyBackpressureTest|ServerEmbeddingTest|FetchCli|PluginHostTest'
  suites+='|SecurityTest'
  suites+='|PluginTlsTest|Modes/RenderNodeHostTest|Modes/RealServerTest|Modes/TaskDeathTest'
  suites+='|Modes/ContentsTest|FaultChannel|SdmaEngine'
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=true
fi
start=$(date +%s)
cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGPULAZY_SANITIZE=thread -DGPULAZY_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"
echo "tsan: built in $(($(date +%s) - start)) s"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
cd "$build"
ctest --output-on-failure --parallel "$(nproc)" --timeout 600 -R "^($suites)\."
echo "tsan: done in $(($(date +%s) - start)) s"
