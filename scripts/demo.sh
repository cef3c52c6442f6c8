#!/usr/bin/env bash
# The main job: sets up, builds, synthesizes a checkpoint and shows what the image tool sees,
# converts it to a lazy image and verifies it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build"
bin="$root/build/bin"
work=$(mktemp -d /tmp/gpulazy-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$bin/gpulazy-image" synth --out "$work/ckpt" --gpus 2 --bos 24 --size 512M --seed 1 --processes 2
"$bin/gpulazy-image" info "$work/ckpt"
"$bin/gpulazy-image" convert "$work/ckpt"
"$bin/gpulazy-image" verify "$work/ckpt"
"$bin/gpulazy-image" info "$work/ckpt"
