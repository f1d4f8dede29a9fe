#!/usr/bin/env python3
"""Whose instructions a request spends: a callgrind profile split by owner.

    benches/attribute.py PROFILE REQUESTS [--top K]

PROFILE is a callgrind output kept by `KEEP=dir benches/instr.sh` from a binary built with line
tables (`CARGO_PROFILE_RELEASE_DEBUG=line-tables-only cargo build --release`: the same code, with
the source file of every instruction known). Each instruction's self cost goes to the crate whose
source line it is (code inlined from `hyper` into a tollgate function is hyper's); lines of the
standard library go to the crate of the function they were inlined into. Printed: instructions per
request by owner, then the K costliest functions of tollgate's own.
"""
import re
import subprocess
import sys
from collections import defaultdict

OWN = "tollgate"
REGISTRY = re.compile(r"/registry/src/[^/]+/([A-Za-z0-9_\-]+?)-\d+\.\d+[^/]*/")
STD = re.compile(r"/rustc/[0-9a-f]+/library/|/library/(core|alloc|std)/")
LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(.*?):(.*?)(?: \[(.*)\])?$")


def symbol_crate(func):
    """The crate a function symbol belongs to: the first path segment of its type or path."""
    m = re.search(r"([A-Za-z_][A-Za-z0-9_]*)::", func)
    if not m:
        return None
    return m.group(1)


def owner(path, func):
    # tollgate's own files: `src/...` (callgrind_annotate shortens paths under the current
    # directory) or an absolute path to a checkout's `src/` outside cargo's registry.
    if path.startswith("src/") or (
        path.startswith("/") and "/src/" in path and not REGISTRY.search(path) and not STD.search(path)
        and "/deps/" not in path
    ):
        return OWN
    m = REGISTRY.search(path)
    if m:
        return m.group(1).replace("-", "_")
    if STD.search(path) or path == "???":
        crate = symbol_crate(func)
        # `<tollgate::X as hyper::Y>::f` is tollgate's type implementing a trait: tollgate's.
        if crate in (None, "core", "alloc", "std"):
            inner = re.findall(r"<([A-Za-z_][A-Za-z0-9_]*)::", func)
            crate = inner[0] if inner else crate
        return crate or "other"
    if "libc.so" in path or path.startswith("./") or "sysdeps" in path:
        return "libc (memcpy, ...)"
    return "other"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    profile, requests = sys.argv[1], float(sys.argv[2])
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 15
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", "--show-percs=no", profile],
        capture_output=True, text=True, check=True,
    ).stdout
    by_owner, own_funcs, total = defaultdict(float), defaultdict(float), 0.0
    for line in out.splitlines():
        m = LINE.match(line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        cost = float(m.group(1).replace(",", ""))
        path, func = m.group(2).strip(), m.group(3).strip()
        who = owner(path, func)
        by_owner[who] += cost
        total += cost
        if who == OWN:
            own_funcs[func] += cost
    print(f"{'owner':<28} {'instr/request':>14} {'share':>7}")
    for who, cost in sorted(by_owner.items(), key=lambda kv: -kv[1]):
        if cost / requests >= 5:
            print(f"{who:<28} {cost / requests:>14,.0f} {cost / total:>7.1%}")
    print(f"{'total':<28} {total / requests:>14,.0f}")
    print(f"\ntollgate's own, by function (self, with what was inlined from tollgate's files):")
    for func, cost in sorted(own_funcs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cost / requests:>8,.0f}  {func[:110]}")


if __name__ == "__main__":
    main()
