#!/usr/bin/env python3
"""Checks the relative links of the repository's Markdown files: each names a file that
exists and, when it names a heading (FILE.md#anchor or #anchor), a heading of that file, with
GitHub's anchor rules. A renamed heading otherwise breaks every link to it without a sound.

Usage: scripts/check-doc-links.py [FILE.md ...]   (default: every tracked *.md)
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    # GitHub: drop inline markup, lowercase, keep letters, digits, spaces, hyphens and
    # underscores, then spaces become hyphens.
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def strip_code(lines):
    """The lines outside fenced code blocks, with inline code removed, numbered from 1."""
    fenced = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, re.sub(r"`[^`]*`", "", line)


def anchors(path: Path, cache={}):
    if path not in cache:
        seen = {}
        found = set()
        for _, line in strip_code(path.read_text(encoding="utf-8").splitlines()):
            match = HEADING.match(line)
            if not match:
                continue
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        cache[path] = found
    return cache[path]


def check(path: Path, counted):
    problems = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in strip_code(lines):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            counted.append(target)
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: link '{target}'"
            if not linked.exists():
                problems.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where}: no heading with anchor '#{anchor}' in "
                                f"{linked.relative_to(ROOT)}")
    return problems


def main(argv):
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.split()
        files = [ROOT / name for name in listed]
    counted = []
    problems = [p for f in files for p in check(f, counted)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"doc links: {len(counted)} relative links in {len(files)} files, "
          f"{len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
