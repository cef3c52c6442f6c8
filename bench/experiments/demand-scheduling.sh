#!/bin/bash
# Issue 3's demand p99 over TCP, prepared in session 59 and never run (no GPU host was lent):
# see README.md here. Variants alternate within each round: base (defaults), slice:100 / fifo:10
# (GPULAZY_DEMAND_SCHED on the threads a demand request passes through), nomark
# (--no-batch-wakeups), early (GPULAZY_EARLY_DEMAND: the demand connection joins before the
# lanes). Needs a build with demand-scheduling.patch applied, bundled as out/s59/bundle
# (scripts/device-bundle.sh BUILD out/s59/bundle); results under $OUT. LIMIT: seconds of runs.
set -u
B=$PWD/out/s59/bundle
export LD_LIBRARY_PATH=$B/lib
W=/tmp/w59; mkdir -p $W
R=$OUT/demand.jsonl
{ nproc; uname -r; id -u; cat /proc/sys/net/core/rmem_max; ls /sys/kernel/debug/sched 2>&1 | head -3;
  cat /sys/kernel/debug/sched/features 2>&1; cat /sys/kernel/debug/sched/base_slice_ns 2>&1; } > $OUT/host.txt
run() { # variant transport round
  local v=$1 t=$2 r=$3 mode="" extra="" early=""
  case $v in slice:*|fifo:*) mode=$v;; nomark) extra=--no-batch-wakeups;; early) early=1;; esac
  cp /proc/net/softnet_stat $OUT/softnet-$v-$t-$r-0.txt
  local st0; st0=$(awk '/^cpu /{print $9}' /proc/stat)
  local t0; t0=$(date +%s.%N)
  local out
  out=$(GPULAZY_EARLY_DEMAND=$early GPULAZY_DEMAND_SCHED=$mode GPULAZY_DEMAND_SCHED_LOG=$OUT/sched-$r.log timeout 150 $B/bin/gpulazy-bench --bin-dir $B/bin --work-dir $W --json demand --size 2G --transport $t $extra 2>$OUT/err-$v-$t-$r.txt | tail -1)
  cp /proc/net/softnet_stat $OUT/softnet-$v-$t-$r-1.txt
  local st1; st1=$(awk '/^cpu /{print $9}' /proc/stat)
  echo "{\"variant\":\"$v\",\"transport\":\"$t\",\"round\":$r,\"seconds\":$(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN{print b-a}'),\"steal_ticks\":$((st1-st0)),\"result\":${out:-null}}" >> $R
  echo "$v $t $r $(echo "$out" | grep -o "\"p99_over_lone\":[0-9.]*" 2>&1)"
}
start=$(date +%s)
for r in 1 2 3 4 5 6; do
  for v in ${VARIANTS:-base slice:100 fifo:10 nomark early}; do
    run "$v" tcp $r
    [ $(( $(date +%s) - start )) -gt ${LIMIT:-480} ] && exit 0
  done
  [ $r -eq 1 ] && for v in base fifo:10; do run "$v" unix $r; done
done
