#!/usr/bin/env python3
"""The module graph of burn-tp and burn-tp-comm: fails on an import circle (between files, or
between a crate's top-level modules) and on a burn-tp module importing one on a floor above its
own (the floors of crates/burn-tp/src/lib.rs). Code only: doc comments and tests don't count.

    python3 .ci/imports.py            # check; prints each crate's top-level edges with -v
"""
import collections
import os
import re
import sys

# crates/burn-tp/src/lib.rs's floors, lowest first; a module imports only its floor and below.
FLOORS = [
    ["error", "rng", "local", "alloc"],
    ["backend"],
    ["ops"],
    ["init", "reshard"],
    ["linear", "embedding", "loss", "dropout", "norm", "attention", "transformer", "moe",
     "context"],
    ["decoder", "gpt", "llama", "gemma", "model"],
    ["generate", "checkpoint", "hf", "dp", "fsdp", "mesh", "precision", "recompute", "pipeline",
     "train", "testing", "lora"],
]


def modules(root):
    mods = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(d, f)
                parts = os.path.relpath(path, root)[:-3].split("/")
                if parts[-1] in ("mod", "lib"):
                    parts = parts[:-1]
                mods["::".join(parts)] = path
    return mods


def code(path):
    src = open(path).read()
    src = re.split(r"#\[cfg\(test\)\]\s*mod tests", src)[0]
    return "\n".join("" if l.strip().startswith("//") else l.split("//")[0] for l in src.split("\n"))


def edges(mods):
    def resolve(p):
        segs = p.strip(":").split("::")
        for i in range(len(segs), 0, -1):
            if "::".join(segs[:i]) in mods:
                return "::".join(segs[:i])
        return None

    out = collections.defaultdict(set)
    for m, path in mods.items():
        src = code(path)
        parent = "::".join(m.split("::")[:-1])
        refs = []
        for g in re.finditer(r"crate::((?:[a-z_0-9]+::)*)\{([^}]*)\}", src):
            refs += [g.group(1) + item.strip() for item in g.group(2).split(",") if item.strip()]
        refs += re.findall(r"crate::([a-z_0-9]+(?:::[A-Za-z_0-9]+)*)", src)
        refs += [(parent + "::" + r) for r in re.findall(r"\bsuper::([a-z_0-9]+(?:::[A-Za-z_0-9]+)*)", src)]
        for r in refs:
            t = resolve(r)
            # A folder's mod.rs and its own files re-export each other: not a dependency.
            if t and t != m and not t.startswith(m + "::") and not m.startswith(t + "::") and t:
                out[m].add(t)
    return out


def cycles(graph):
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")
    verbose = "-v" in sys.argv
    floor = {m: i for i, ms in enumerate(FLOORS) for m in ms}
    bad = []
    for crate in ("burn-tp", "burn-tp-comm"):
        mods = modules(os.path.join(root, crate, "src"))
        graph = edges(mods)
        top = collections.defaultdict(set)
        for a, bs in graph.items():
            for b in bs:
                ta, tb = a.split("::")[0], b.split("::")[0]
                if ta != tb:
                    top[ta].add(tb)
        for c in cycles(graph):
            bad.append(f"{crate}: files import each other in a circle: {' <-> '.join(c)}")
        for c in cycles(top):
            bad.append(f"{crate}: modules import each other in a circle: {' <-> '.join(c)}")
        if crate == "burn-tp":
            tops = {m.split("::")[0] for m in mods if m}
            for m in sorted(tops - set(floor)):
                bad.append(f"burn-tp: module `{m}` has no floor in .ci/imports.py (lib.rs's map)")
            for a in sorted(top):
                for b in sorted(top[a]):
                    if a in floor and b in floor and floor[b] > floor[a]:
                        bad.append(f"burn-tp: `{a}` (floor {floor[a]}) imports `{b}` (floor {floor[b]}), above it")
        if verbose:
            for a in sorted(top):
                print(f"{crate}: {a} -> {', '.join(sorted(top[a]))}")
    for b in bad:
        print(b)
    print(f"module graph: {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
