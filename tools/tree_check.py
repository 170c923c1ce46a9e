#!/usr/bin/python3
"""tools/tree_check.py: the tree's structural rules, checked from the sources.

  layers    a folder includes only its own headers and those of the layers
            below it (the order in LAYERS; tests and tools may include all)
  length    no function over 100 lines in dht/, net/, swarm/, routing/, peer/,
            capi/
  comments  every function prototype in a header has a comment: the nearest
            line above it in the same block (no blank line between) ends a
            comment

Usage: tools/tree_check.py [SOURCE_ROOT]; prints each breach and exits 1
when there is one, 0 otherwise.
"""
import os
import re
import sys

# Each folder and the folders it may include (besides itself).
LAYERS = {
    "dht": [],
    "expert": [],
    "cuda": ["expert"],
    "net": ["dht"],
    "swarm": ["dht", "expert", "net"],
    "routing": ["dht", "expert", "net", "swarm"],
    "peer": ["dht", "expert", "cuda", "net", "swarm", "routing"],
    "capi": ["dht", "expert", "net", "swarm", "routing"],
}
SHORT = ["dht", "net", "swarm", "routing", "peer", "capi"]
MAX_LINES = 100
HEADER_FOLDERS = ["dht", "expert", "cuda", "net", "swarm", "peer", "routing", "capi", "tools"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"')
FUNC_HEAD = re.compile(r"^(?:static\s+inline\s+|EXPERT__INLINE\s+)?[A-Za-z_][\w\s\*]*\b\w+\s*\(")


def sources(root, folder, exts):
    d = os.path.join(root, folder)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(exts))


def check_layers(root):
    bad = []
    for folder, allowed in LAYERS.items():
        for path in sources(root, folder, (".c", ".h", ".cu", ".cuh")):
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                m = INCLUDE.match(line)
                if m and m.group(1) != folder and m.group(1) not in allowed and m.group(1) != "config.h":
                    bad.append(f"{os.path.relpath(path, root)}:{n}: {folder}/ includes {m.group(1)}/ "
                               f"(a layer it may not use)")
    return bad


def check_length(root):
    bad = []
    for folder in SHORT:
        for path in sources(root, folder, (".c",)):
            lines = open(path, encoding="utf-8").read().split("\n")
            start = None
            for i, line in enumerate(lines):
                if start is None and FUNC_HEAD.match(line) and not line.rstrip().endswith(";"):
                    # a definition: its body opens with "{" at column 0 within a few lines
                    for j in range(i, min(i + 6, len(lines))):
                        if lines[j].startswith("{"):
                            start = i
                            break
                        if lines[j].rstrip().endswith(";"):
                            break
                elif start is not None and line.startswith("}"):
                    if i - start + 1 > MAX_LINES:
                        name = re.findall(r"(\w+)\s*\(", lines[start])[0]
                        bad.append(f"{os.path.relpath(path, root)}:{start + 1}: {name} is "
                                   f"{i - start + 1} lines (at most {MAX_LINES})")
                    start = None
    return bad


def check_comments(root):
    bad = []
    for folder in HEADER_FOLDERS:
        for path in sources(root, folder, (".h",)):
            lines = open(path, encoding="utf-8").read().split("\n")
            depth, i = 0, 0
            while i < len(lines):
                line = lines[i]
                if depth == 0 and FUNC_HEAD.match(line) and not line.startswith(("typedef", "#", " ")):
                    j = i
                    while j < len(lines) and not (lines[j].rstrip().endswith((";", "{"))
                                                  or lines[j].startswith("{")):
                        j += 1
                    k, ok = i - 1, False
                    while k >= 0 and lines[k].strip():
                        if lines[k].rstrip().endswith("*/"):
                            ok = True
                            break
                        k -= 1
                    if not ok:
                        bad.append(f"{os.path.relpath(path, root)}:{i + 1}: prototype without a comment: "
                                   f"{line.strip()[:80]}")
                    i = j + 1
                    continue
                depth += line.count("{") - line.count("}")
                i += 1
    return bad


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    bad = check_layers(root) + check_length(root) + check_comments(root)
    for b in bad:
        print(b)
    print(f"tree_check: {len(bad)} breach{'es' if len(bad) != 1 else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
