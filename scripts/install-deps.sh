#!/usr/bin/env bash
# Installs the Debian 12 packages gpulazy builds and tests with. Idempotent: does nothing
# when everything is present. Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  protobuf-compiler libprotobuf-dev
  libboost-dev libboost-system-dev
  liblz4-dev libxxhash-dev
  libdrm-dev
  libfmt-dev libspdlog-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  liburing-dev libssl-dev openssl
  # scripts/lint.sh
  clang-format clang-tidy
  # scripts/fuzz.sh: clang 14 and its runtimes (libFuzzer, ASan, UBSan: libclang-rt-14-dev)
  clang libclang-rt-14-dev
  # the linker every build uses where it is there (CMakeLists.txt, GPULAZY_USE_LLD)
  lld
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
