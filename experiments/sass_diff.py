#!/usr/bin/env python3
"""Opcode histogram difference of one kernel between two builds (cuobjdump on the device).
usage: sass_diff.py lib_a lib_b name_substring"""
import collections, re, subprocess, sys


def kernels(lib, sub):
    out = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True).stdout
    ks, cur = {}, None
    for line in out.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = m.group(1) if sub in m.group(1) else None
            if cur:
                ks[cur] = []
            continue
        if cur and re.match(r"\s+/\*[0-9a-f]{4,5}\*/", line):
            ins = line.split("*/", 1)[1].split(";")[0].strip()
            ks[cur].append(ins.split()[1] if ins.startswith("@") else ins.split()[0])
    return ks


def strip_params(name):
    """The mangled name without its parameter list: builds whose kernels gained a parameter still pair up."""
    return re.sub(r"E+v\d+Cf.*$", "", name)


a, b = kernels(sys.argv[1], sys.argv[3]), kernels(sys.argv[2], sys.argv[3])
for name in sorted(a):
    key = strip_params(name)
    other = [n for n in b if strip_params(n) == key]
    if not other:
        continue
    ca, cb = collections.Counter(a[name]), collections.Counter(b[other[0]])
    diff = {o: cb[o] - ca[o] for o in set(ca) | set(cb) if ca[o] != cb[o]}
    print(f"{key[-60:]}: {len(a[name])} -> {len(b[other[0]])} instructions; {diff}")
