#!/usr/bin/env python3
"""Report Rust functions longer than a limit, outside tests.

Why this exists: a function a reader cannot hold in their head at once is where
rules drift apart unnoticed (issue 22 found the round rules written twice inside
two 200-line functions).  Cohort's rule is no function over 120 lines in
non-test code; rustc and clippy do not enforce a length, so this script does.

A function's length is counted from the line of its `fn` to the line of its
closing brace, comments and blank lines included (they are what a reader scrolls
through).  Functions inside `#[cfg(test)] mod` blocks, `#[test]` functions and
files under a `tests/` directory are skipped.  Comments, strings and char
literals are blanked first, so braces inside them do not count.

Usage: long-functions.py [--max N] [--top K] DIR...
Prints every function over N lines (default 120), longest first, and exits 1 if
there is one; `--top K` also lists the K longest that pass, for the record.
"""
import argparse
import importlib.util
import re
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "cycles", Path(__file__).with_name("check-module-cycles.py"))
_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cycles)
strip_code, block_end, TEST_MOD = _cycles.strip_code, _cycles.block_end, _cycles.TEST_MOD

FN = re.compile(r"\bfn\s+(\w+)")
TEST_ATTR = re.compile(r"#\[(?:test|tokio::test[^\]]*|cfg\(test\))\]\s*$")


def test_ranges(code):
    """(start, end) offsets of every `#[cfg(test)] mod x { ... }` block."""
    ranges = []
    for m in TEST_MOD.finditer(code):
        if m.group(2) == "{":
            brace = m.end() - 1
            ranges.append((m.start(), block_end(code, brace)))
    return ranges


def functions(path):
    """(lines, name, line number) of each non-test function with a body in `path`."""
    text = path.read_text(encoding="utf-8")
    code = strip_code(text)
    skip = test_ranges(code)
    found = []
    for m in FN.finditer(code):
        start = m.start()
        if any(a <= start < b for a, b in skip):
            continue
        # The attributes just above the signature: a `#[test]` function is a test.
        lines_above = code[:start].splitlines()[-3:]
        if any(TEST_ATTR.search(line.strip()) for line in lines_above):
            continue
        # The body is the first `{` after the signature, unless a `;` ends it first
        # (a trait method without a body, an extern declaration).
        brace = code.find("{", m.end())
        semi = code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue
        end = block_end(code, brace)
        first = code.count("\n", 0, start) + 1
        last = code.count("\n", 0, end - 1) + 1
        found.append((last - first + 1, m.group(1), first))
    return found


def test_files(root):
    """Files that are `#[cfg(test)] mod x;` modules: `x.rs` or `x/mod.rs` beside the
    declaring file (or in its directory, for a `mod.rs`/`lib.rs`)."""
    found = set()
    for path in root.rglob("*.rs"):
        code = strip_code(path.read_text(encoding="utf-8"))
        for m in TEST_MOD.finditer(code):
            if m.group(2) != ";":
                continue
            here = path.parent if path.name in ("mod.rs", "lib.rs", "main.rs") else path.with_suffix("")
            found |= {here / f"{m.group(1)}.rs", here / m.group(1) / "mod.rs"}
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=120)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    every = []
    for root in args.dirs:
        tests = test_files(root)
        for path in sorted(root.rglob("*.rs")):
            if "tests" in path.relative_to(root).parts[:-1] or path in tests:
                continue
            every += [(n, f"{path}:{line}", name) for n, name, line in functions(path)]
    every.sort(key=lambda f: (-f[0], f[1]))
    over = [f for f in every if f[0] > args.max]
    for n, where, name in over:
        print(f"{n:5} lines  {name}  {where}")
    if args.top:
        print(f"the {args.top} longest within {args.max} lines:")
        for n, where, name in [f for f in every if f[0] <= args.max][:args.top]:
            print(f"{n:5} lines  {name}  {where}")
    print(f"long functions: {'FAIL' if over else 'OK'}: {len(over)} over {args.max} lines "
          f"of {len(every)} functions")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
