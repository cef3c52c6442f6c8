#!/usr/bin/env python3
"""Where threads left the CPU: a summary of `perf script` output of sched:sched_switch events.

Usage: offcpu-summary.py PERF_SCRIPT_OUTPUT[.gz] COMM [COMM ...] [--frames N] [--top N]

Record on the machine to look at (docs/benchmarks.md, "Session 22"), for example:

  perf record -o p.data -e sched:sched_switch -a --call-graph dwarf,16384 \\
      --filter 'prev_comm == "gl-file-reader"' -- COMMAND
  perf script -i p.data -F comm,tid,time,trace,ip,sym,dso | gzip > script.txt.gz

For each COMM (the threads' name as the kernel knows it), counts the switch-outs by the thread's
state (S: went to sleep, D: uninterruptible, R: preempted) and its first N user-space frames in
the program itself (libc, the kernel and other libraries are skipped; with --call-graph dwarf the
program must not be stripped). Counts, not times: the filter keeps switch-outs only.
"""
import argparse
import collections
import gzip
import re

HEADER = re.compile(r"^(\S+)\s+\d+\s+[\d.]+:\s+(?:sched:sched_switch:\s+)?prev_comm=.*?"
                    r"prev_state=(\S+)")
FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)$")


def events(path):
    """(comm, state, [(symbol, dso)]) per event of the perf script text."""
    opener = gzip.open if path.endswith(".gz") else open
    comm = state = None
    frames = []
    with opener(path, "rt", errors="replace") as text:
        for line in text:
            if not line.strip():
                if comm is not None:
                    yield comm, state, frames
                comm, frames = None, []
                continue
            header = HEADER.match(line)
            if header:
                comm, state, frames = header.group(1), header.group(2).rstrip("+"), []
                continue
            frame = FRAME.match(line)
            if frame and comm is not None:
                frames.append((frame.group(1), frame.group(2)))
    if comm is not None:
        yield comm, state, frames


def own(dso):
    """A frame of the program itself: not the kernel, libc or another shared library."""
    return "kernel" not in dso and ".so" not in dso


def short(symbol):
    symbol = re.sub(r"\(.*", "", symbol)  # argument lists
    return symbol if len(symbol) <= 80 else "..." + symbol[-77:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("script")
    parser.add_argument("comms", nargs="+")
    parser.add_argument("--frames", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    counts = {comm: collections.Counter() for comm in args.comms}
    for comm, state, frames in events(args.script):
        if comm not in counts:
            continue
        mine = [short(symbol) for symbol, dso in frames if own(dso)][: args.frames]
        counts[comm][(state, " < ".join(mine) or "(no frame of the program)")] += 1
    for comm, counter in counts.items():
        print(f"{comm}: {sum(counter.values())} switch-outs")
        for (state, where), n in counter.most_common(args.top):
            print(f"  {n:6d}  {state}  {where}")


if __name__ == "__main__":
    main()
