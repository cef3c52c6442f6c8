#!/usr/bin/env python3
"""What scripts/lint.sh runs on a build's compile database (compile_commands.json).

Usage: lint-units.py COMPILE_COMMANDS tidy|syntax [--compiler=CXX] SOURCE...

SOURCE: the .cc files to check, relative to the repository root (the working directory).

  tidy    prints the translation units for clang-tidy, one path a line: a unity batch that
          holds any of the sources (clang-tidy then parses the headers once per batch, not once
          per file: a third of the time), or the source itself where it is compiled on its own.
  syntax  prints one shell command a line that compiles one source alone, -fsyntax-only, with
          its batch's flags. A unity batch hides a source's missing #include when an earlier
          source of the batch made it; these commands are what still finds it.
          --compiler=clang++: compile with clang instead of the build's compiler (the GCC-only
          warning flags are then ignored, and Boost.Asio is told clang has coroutines, as
          clang-tidy is). It parses the same headers a quarter faster than GCC.

Sources the database does not compile (optional parts left out of the build) are skipped. The
database must come from the build whose sources are listed (paths are matched absolutely).
"""
import json
import os
import re
import shlex
import sys

UNITY_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.MULTILINE)


def batch_sources(path):
    """The sources a CMake unity batch includes, or None if `path` is not a batch."""
    if "/Unity/unity_" not in path:
        return None
    with open(path, encoding="utf-8") as batch:
        return UNITY_INCLUDE.findall(batch.read())


# Boost 1.74 detects coroutine support only under GCC (scripts/lint.sh tells clang-tidy too).
CLANG_EXTRA = ["-Wno-unknown-warning-option", "-DBOOST_ASIO_HAS_CO_AWAIT=1",
               "-DBOOST_ASIO_HAS_STD_COROUTINE=1"]


def alone(entry, source, compiler=None):
    """The entry's command, compiling only `source` and writing nothing."""
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    if compiler is not None:
        args = [compiler] + CLANG_EXTRA + args[1:]
    kept = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("-o", "-c", "-MF", "-MT", "-MQ"):
            skip = True  # the flag's value follows
            continue
        if arg in ("-MD", "-MMD") or arg == entry["file"]:
            continue
        kept.append(arg)
    return "cd {} && {} -fsyntax-only {}".format(
        shlex.quote(entry["directory"]), shlex.join(kept), shlex.quote(source))


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ("tidy", "syntax"):
        sys.exit(__doc__)
    sources = sys.argv[3:]
    compiler = None
    if sources and sources[0].startswith("--compiler="):
        compiler = sources.pop(0).split("=", 1)[1]
    with open(sys.argv[1], encoding="utf-8") as db:
        entries = json.load(db)
    wanted = {os.path.abspath(source) for source in sources}
    candidates = []  # (translation unit, entry, the sources it compiles, in order)
    for entry in entries:
        unit = entry["file"]
        if not os.path.isabs(unit):
            unit = os.path.join(entry["directory"], unit)
        included = batch_sources(unit)
        compiled = [os.path.abspath(s) for s in included] if included is not None else [unit]
        if any(s in wanted for s in compiled):
            candidates.append((unit, entry, compiled))
    # Each source once: batches made only of wanted sources first (a test target's batch that
    # also compiles a library source is then not needed), larger before smaller.
    candidates.sort(key=lambda c: (-sum(s in wanted for s in c[2]) / len(c[2]), -len(c[2])))
    covered = set()
    units = []  # (translation unit, entry, the sources it compiles, those it is chosen for)
    for unit, entry, compiled in candidates:
        new = [s for s in compiled if s in wanted and s not in covered]
        if new:
            covered.update(new)
            units.append((unit, entry, compiled, new))
    if sys.argv[2] == "tidy":
        for unit, _, _, _ in units:
            print(unit)
    else:
        for _, entry, compiled, chosen in units:
            for source in chosen:
                # A batch's first source sees nothing before it: the batch compiled it alone.
                if source != compiled[0]:
                    print(alone(entry, source, compiler))


if __name__ == "__main__":
    main()
