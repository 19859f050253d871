#!/usr/bin/env python3
"""Report import cycles between sibling modules of Rust crates.

Why this exists: Cohort's architecture rule is that modules never import each
other in a circle.  Dependencies point one way -- http handlers -> driver ->
store, and everything -> core types -- so each layer can be read, tested and
changed without the ones above it.  rustc compiles circular `use`s happily, so
nothing else enforces the rule; this script does.

For each crate source dir (default: coordinator/src) it finds every module
(`x.rs`, `x/mod.rs`, `x.rs` + `x/`; `lib.rs`/`main.rs` are the root), collects
the `crate::`, `super::` and `self::` paths each one uses outside
`#[cfg(test)] mod` blocks (in `use` trees and inline), resolves each path to the
longest existing module prefix, and lifts every edge A -> B to the two siblings
under their lowest common ancestor (server::admin -> store::rounds counts as
server -> store at the crate root).  A parent using its child, or a child using
its parent's items, is not a cycle.  Each strongly connected component of more
than one sibling is a cycle, printed with one `file:line` per edge.

--allow FILE lists known components, one per line: `[CRATE_DIR] PARENT: MEMBER
MEMBER ...` (`crate` for the crate root; without CRATE_DIR, any crate; `#` starts
a comment).  A cycle whose members are a
subset of an allowed set passes as "known"; any other cycle exits 1.
"""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = "crate"
CHAR = r"'(?:\\(?:u\{[0-9a-fA-F]*\}|x..|.)|[^\\'])'"  # 'x' '\n' '{' -- but not the lifetime 'a
LEXEME = re.compile(r'//[^\n]*|/\*|\bb?r(#*)"[\s\S]*?"\1|b?"(?:\\[\s\S]|[^"\\])*"|' + CHAR)
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])")
INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")
PUB_IN = re.compile(r"\bpub\s*\(\s*in\s+[^)]*\)")  # pub(in crate::x) restricts, it doesn't import
USE_STMT = re.compile(r"\buse\s+([^;]*);")
USE_TOKEN = re.compile(r"::|[{},*]|\w+")
PATH = re.compile(r"\b(?:crate|self|super)(?:\s*::\s*\w+)+")


def blank(s):
    return re.sub(r"[^\n]", " ", s)


def strip_code(text):
    """Blank out comments, strings and char literals, keeping every offset and newline."""
    out, i = [], 0
    while m := LEXEME.search(text, i):
        end = m.end()
        if m.group() == "/*":  # block comments nest
            depth = 1
            while depth and end < len(text):
                step = {"/*": 1, "*/": -1}.get(text[end:end + 2], 0)
                depth, end = depth + step, end + (2 if step else 1)
        out += [text[i:m.start()], blank(text[m.start():end])]
        i = end
    return "".join(out) + text[i:]


def block_end(code, open_brace):
    """Offset just past the brace that closes the one at `open_brace`."""
    depth = 0
    for k in range(open_brace, len(code)):
        depth += {"{": 1, "}": -1}.get(code[k], 0)
        if depth == 0:
            return k + 1
    return len(code)


def parse_use_tree(toks, i, prefix):
    """Expand the use tree at toks[i] into [(segments, offset)]; returns (paths, next index)."""
    segs, pos = list(prefix), toks[i][1] if i < len(toks) else 0
    while i < len(toks):
        tok, pos = toks[i]
        if tok == "::":
            i += 1
        elif tok == "{":
            i, found = i + 1, []
            while i < len(toks) and toks[i][0] != "}":
                sub, i = parse_use_tree(toks, i, segs)
                found += sub
                i += i < len(toks) and toks[i][0] == ","
            return found, i + 1
        elif tok in ("*", ",", "}"):
            return [(segs, pos)], i + (tok == "*")
        else:
            segs, i = segs + [tok], i + 1
            if i < len(toks) and toks[i][0] == "::":
                continue
            i += 2 if i < len(toks) and toks[i][0] == "as" else 0
            return [(segs[:-1] if tok == "self" else segs, pos)], i
    return [(segs, pos)], i


def references(file, mod):
    """([(path segments, line, enclosing inline modules)], [test-only child modules]) of a file."""
    code = PUB_IN.sub(lambda m: blank(m.group()), strip_code(file.read_text(encoding="utf-8")))
    test_children = []
    for m in TEST_MOD.finditer(code):
        if m.group(2) == ";":
            test_children.append(mod + (m.group(1),))
        elif code[m.start()] == "#":  # skip blocks nested in one already blanked
            end = block_end(code, m.end() - 1)
            code = code[:m.start()] + blank(code[m.start():end]) + code[end:]
    spans = [(m.start(), block_end(code, m.end() - 1), m.group(1)) for m in INLINE_MOD.finditer(code)]
    found = []
    for m in USE_STMT.finditer(code):
        toks = [(t.group(), m.start(1) + t.start()) for t in USE_TOKEN.finditer(m.group(1))]
        found += parse_use_tree(toks, 0, [])[0]
    code = USE_STMT.sub(lambda m: blank(m.group()), code)
    found += [(re.split(r"\s*::\s*", m.group()), m.start()) for m in PATH.finditer(code)]
    return [(segs, code.count("\n", 0, off) + 1, tuple(name for a, b, name in spans if a < off < b))
            for segs, off in found if segs and segs[0] in ("crate", "self", "super")], test_children


def resolve(segs, here, modules):
    """The longest existing module prefix of a crate/self/super path used in `here`."""
    base, rest = ([], segs[1:]) if segs[0] == "crate" else (list(here), segs)
    while rest and rest[0] in ("self", "super"):
        if rest[0] == "super":
            if not base:
                return None
            base.pop()
        rest = rest[1:]
    full = tuple(base + rest)
    return next(full[:k] for k in range(len(full), -1, -1) if full[:k] in modules or k == 0)


def sibling_edges(src):
    """{parent label: {(child a, child b): "file:line (A -> B)"}} for one crate source dir."""
    files = []
    for f in sorted(src.rglob("*.rs")):
        parts = f.relative_to(src).with_suffix("").parts
        if parts[0] == "bin":
            continue  # src/bin/* are separate crates
        mod = () if parts in (("lib",), ("main",)) else parts[:-1] if parts[-1] == "mod" else parts
        files.append((f, mod, *references(f, mod)))
    test_only = {t for *_, tests in files for t in tests}
    live = {mod for _, mod, *_ in files if not any(mod[:len(t)] == t for t in test_only)}
    edges = defaultdict(dict)
    for f, mod, refs, _ in files:
        for segs, line, inline in refs if mod in live else []:
            target = resolve(segs, mod + inline, live)
            if target is None:
                continue
            k = next((k for k, (x, y) in enumerate(zip(mod, target)) if x != y), None)
            if k is None:
                continue  # same module, an ancestor or a descendant
            where = f"{f}:{line} ({'::'.join(mod) or ROOT} -> {'::'.join(target) or ROOT})"
            edges["::".join(mod[:k]) or ROOT].setdefault((mod[k], target[k]), where)
    return edges


def components(edges):
    """Strongly connected components with more than one member (iterative Kosaraju)."""
    graph, rev = defaultdict(set), defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        rev[b].add(a)
    order, seen = [], set()
    for root in sorted(graph.keys() | rev.keys()):
        stack = [] if root in seen else [(root, iter(sorted(graph[root])))]
        seen.add(root)
        while stack:
            v, it = stack[-1]
            w = next((x for x in it if x not in seen), None)
            if w is None:
                order.append(stack.pop()[0])
            else:
                seen.add(w)
                stack.append((w, iter(sorted(graph[w]))))
    comps, done = [], set()
    for root in reversed(order):
        comp, todo = set(), [] if root in done else [root]
        done.add(root)
        while todo:
            v = todo.pop()
            comp.add(v)
            todo += rev[v] - done
            done |= rev[v]
        if len(comp) > 1:
            comps.append(comp)
    return sorted(comps, key=sorted)


def closed_walk(comp, edges):
    """A walk along real edges from the smallest member through all of them and back."""
    nxt = defaultdict(list)
    for a, b in sorted(edges):
        if a in comp and b in comp:
            nxt[a].append(b)

    def hop(a, goals):  # shortest path from a to the nearest goal, without a itself
        prev, queue = {a: None}, [a]
        for v in queue:
            if v in goals and v != a:
                steps = [v]
                while prev[steps[-1]] != a:
                    steps.append(prev[steps[-1]])
                return steps[::-1]
            for w in nxt[v]:
                if w not in prev:
                    prev[w] = v
                    queue.append(w)

    walk = [min(comp)]
    while missing := comp - set(walk):
        walk += hop(walk[-1], missing)
    return walk + hop(walk[-1], {walk[0]})


def load_allow(path):
    """[(crate dir or None, parent, members, text)] from lines `[CRATE_DIR] PARENT: MEMBERS`."""
    allowed = []
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            where, _, members = line.partition(":")
            *crate, parent = where.split() or [""]
            allowed.append((Path(crate[0]) if crate else None, parent, frozenset(members.split()), line))
    return allowed


def allows(entry, src, parent, comp):
    crate, allowed_parent, members, _ = entry
    same_crate = crate is None or src.resolve().parts[-len(crate.parts):] == crate.parts
    return same_crate and allowed_parent == parent and comp <= members


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="*", default=["coordinator/src"], help="crate source dirs")
    ap.add_argument("--allow", metavar="FILE", help="allow-list of known cycles")
    args = ap.parse_args(argv)
    allowed = load_allow(args.allow) if args.allow else []
    still = defaultdict(set)  # allow-list entry -> its members still found in a cycle
    known = new = 0
    for src in map(Path, args.src):
        if not src.is_dir():
            print(f"error: {src} is not a directory", file=sys.stderr)
            return 2
        for parent, edges in sorted(sibling_edges(src).items()):
            for comp in components(edges):
                entry = next((e for e in allowed if allows(e, src, parent, comp)), None)
                known, new = known + bool(entry), new + (not entry)
                still[entry] |= comp
                walk = " -> ".join(closed_walk(comp, edges))
                print(f"{'known ' if entry else ''}cycle in {parent} ({src}): {walk}")
                for (a, b), where in sorted(edges.items()):
                    if a in comp and b in comp:
                        print(f"    {a} -> {b}: {where}")
    for entry in allowed:
        if gone := entry[2] - still[entry]:
            print(f"note: allow-list entry '{entry[3]}' can shrink;"
                  f" no longer in a cycle: {' '.join(sorted(gone))}")
    print(f"module cycles: {'FAIL' if new else 'OK'}: {known + new} found, {known} known, {new} new"
          f" in {len(args.src)} crate dir(s)")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
