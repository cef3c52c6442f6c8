#!/usr/bin/env bash
# Runs a build's test suite on a lent GPU host (docs/benchmarks.md, "The whole suite on the lent
# host"), where nothing can be installed and a carried path may hold at most 64 MiB.
#
#   here:  scripts/device-suite.sh pack BUILD_DIR out/suite/NAME.tar.xz
#   there: scripts/device-suite.sh run out/suite/NAME.tar.xz BUILD_DIR [ctest options...]
#
# `pack` bundles the test executables, the CTest files and the libraries they need
# (scripts/device-bundle.sh --tests), compresses them and cuts the archive into parts of at
# most 60 MiB (NAME.tar.xz.part00, part01, ...). A sanitizer build (every test executable links
# its libraries statically) takes several: session 19's ASan build took two, one per call,
# each left in a folder outside the checkout, e.g. /tmp, that the machine keeps while warm. `run` joins the parts and unpacks them as BUILD_DIR (the
# tests name their executables and sources by this checkout's absolute paths, so the checkout
# must sit at the same path there, as the device tool's does), puts the libraries into ld.so's
# path (tests start servers and clients whose environment some of them clear, so
# LD_LIBRARY_PATH is not enough), then runs ctest in BUILD_DIR with the options given, e.g.
# `--parallel 16 --repeat until-fail:5 --timeout 300`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage() {
  echo "usage: device-suite.sh pack BUILD_DIR ARCHIVE | run ARCHIVE BUILD_DIR [ctest options...]" >&2
  exit 2
}
[ $# -ge 3 ] || usage
case "$1" in
  pack)
    build=$2 archive=$3
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    "$root/scripts/device-bundle.sh" --tests "$build" "$staging" >/dev/null
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive".part*
    tar -C "$staging" -cf - build lib | xz -T0 -6 | split -b 60M -d -a 2 - "$archive.part"
    for part in "$archive".part*; do echo "device-suite: $(du -h "$part" | cut -f1) in $part"; done
    ;;
  run)
    archive=$2 build=$3
    shift 3
    parts=("$archive".part*)
    [ -f "${parts[0]}" ] || { echo "device-suite: no parts $archive.part*" >&2; exit 1; }
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    # A part missing from the middle or the end fails here, in xz or tar, before anything runs.
    cat "${parts[@]}" | xz -d | tar -C "$staging" -xf -
    rm -rf "$build"
    mkdir -p "$(dirname "$build")"
    mv "$staging/build" "$build"
    # The host's own C++ runtime stays: its programs (ldconfig's users) may need a newer one,
    # and ours runs fine on a newer runtime.
    libs=/usr/local/lib/gpulazy
    mkdir -p "$libs"
    find "$staging/lib" -maxdepth 1 -type f ! -name 'libstdc++*' ! -name 'libgcc_s*' \
      -exec cp {} "$libs/" \;
    echo "$libs" >/etc/ld.so.conf.d/gpulazy.conf
    ldconfig
    cd "$build"
    ctest "$@"
    ;;
  *) usage ;;
esac
