#!/usr/bin/env python3
"""The compiled kernels of two CUDA objects side by side, without a GPU: for each kernel whose
name matches, its SASS instructions, reciprocal sequences (MUFU.RCP, one an integer division by a
run-time value), registers and stack bytes in OLD and NEW, and with --loops the instructions of
each loop body (the span of a backward branch; a body with two paths counts both).

  python3 scripts/sass_compare.py OLD.o NEW.o [--match REGEX] [--loops] [--changed]

cuobjdump comes with a full CUDA toolkit; where the toolkit has none, `pip install
nvidia-cuda-cuobjdump` puts one under site-packages' nvidia/cu13/bin. CUOBJDUMP names it.
docs/benchmarks.md's static figures (e.g. the eighth session's) come from this script on
build/h/kernels/cuda/moe.o (sm_90a) against an older build's."""
import argparse
import os
import re
import subprocess
import sys

INSN = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRA = re.compile(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)")


def dump(obj, what):
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    return subprocess.run([tool, what, obj], check=True, capture_output=True, text=True).stdout


def kernels(obj):
    out = {}
    for block in dump(obj, "-sass").split("Function : ")[1:]:
        name = block.split("\n", 1)[0].strip()
        out[name] = [(int(m.group(1), 16), m.group(2))
                     for m in (INSN.match(line) for line in block.split("\n")) if m]
    res = {}
    name = None
    for line in dump(obj, "-res-usage").split("\n"):
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and name:
            res[name] = (int(m.group(1)), int(m.group(2)))
    return out, res


def loops(insns):
    sizes = []
    for addr, text in insns:
        m = BRA.search(text)
        if m and int(m.group(1), 16) < addr:
            head = int(m.group(1), 16)
            sizes.append(sum(1 for a, _ in insns if head <= a <= addr))
    return sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--match", default="", help="regular expression on the mangled kernel name")
    ap.add_argument("--loops", action="store_true", help="also each loop body's instructions")
    ap.add_argument("--changed", action="store_true", help="only kernels whose code differs")
    a = ap.parse_args()
    old, old_res = kernels(a.old)
    new, new_res = kernels(a.new)
    same = 0
    for name in old:
        if not re.search(a.match, name) or name not in new:
            continue
        o, n = old[name], new[name]
        if [t for _, t in o] == [t for _, t in n]:
            same += 1
            if a.changed:
                continue
        rcp = lambda k: sum("MUFU.RCP" in t for _, t in k)
        print("%s\n  instructions %d -> %d, reciprocals %d -> %d, registers/stack %s -> %s"
              % (name, len(o), len(n), rcp(o), rcp(n), old_res.get(name), new_res.get(name)))
        if a.loops:
            print("  loop bodies %s -> %s" % (loops(o), loops(n)))
    print("%d matching kernels with the same code" % same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
