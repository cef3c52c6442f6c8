#!/usr/bin/env bash
# The main job: sets up, builds, synthesizes a checkpoint, shows what the image tool sees,
# converts it to a lazy image and verifies it, then serves it with gpulazy-server and restores
# its BO contents with gpulazy-client, checking the result byte for byte against the source.
# Last, restores a small inference workload in four modes (eager, parallel, lazy with the
# userfaultfd pager, lazy with a recorded access profile) and prints their table (docs/uffd.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" "$root/build"
bin="$root/build/bin"
work=$(mktemp -d /tmp/gpulazy-demo.XXXXXX)
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }
step "synthesize a 2-process, 2-GPU CRIU amdgpu checkpoint"
"$bin/gpulazy-image" synth --out "$work/images/ckpt" --gpus 2 --bos 24 --size 512M --seed 1 --processes 2
step "inspect it"
"$bin/gpulazy-image" info "$work/images/ckpt"
step "convert to a lazy image and verify every chunk against the CRIU files"
"$bin/gpulazy-image" convert "$work/images/ckpt"
"$bin/gpulazy-image" verify "$work/images/ckpt"
"$bin/gpulazy-image" info "$work/images/ckpt"

step "serve it and restore its BO contents through the page client"
"$bin/gpulazy-server" --images "$work/images" --listen "unix:$work/server.sock" \
  --ready-file "$work/server.ready" --log-level warn &
server=$!
for _ in $(seq 100); do [ -s "$work/server.ready" ] && break; sleep 0.1; done
[ -s "$work/server.ready" ] || { echo "gpulazy-server did not start" >&2; exit 1; }
"$bin/gpulazy-client" fetch --server "unix:$work/server.sock" --image ckpt --out "$work/restored" --json
for f in "$work"/images/ckpt/amdgpu-pages-*.img; do
  cmp "$f" "$work/restored/$(basename "$f")"
done
echo "restored pages files are byte-identical to the checkpoint's"

step "restore a workload in four modes: eager, parallel, lazy (userfaultfd), lazy-profiled"
"$bin/gpulazy-bench" --work-dir "$work" restore --size 512M \
  --modes eager,parallel,lazy,lazy-profiled --svg "$work/restore-timeline.svg"
