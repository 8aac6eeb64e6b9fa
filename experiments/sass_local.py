#!/usr/bin/env python3
"""SASS of our kernels without a GPU: compiles one kernels/ translation unit to an sm_90a cubin
with the pinned nvcc (.cuda/env.sh) and disassembles it with nvdisasm from PyPI
(nvidia-cuda-nvdisasm 13.2.51, installed into .cuda/nvdisasm on first use: there is no 13.0
wheel, and 13.2 reads 13.0's cubins). Prints, per kernel whose name contains FILTER, the
instruction counts that the brief asks to check (HGMMA / QGMMA for wgmma, UTMALDG / UBLKCP /
UBLKRED for TMA and bulk copies, LDL / STL for local-memory spills) and MUFU, over the whole
kernel (static counts: every code path once).

  python3 experiments/sass_local.py kernels/sm90/fwd.cu e4m3        # the FP8 forward kernels
  python3 experiments/sass_local.py kernels/sm80/bwd_bf16.cu dkdv_sm90 --dump /tmp/bwd.sass

On the device, experiments/sass_diff.py (cuobjdump) compares two built libraries instead.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, ".cuda", "nvdisasm", "nvdisasm")
WHEEL = "nvidia-cuda-nvdisasm==13.2.51"
WATCH = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UBLKCP", "UBLKRED", "LDL", "STL", "MUFU", "BAR", "SYNCS")


def nvdisasm():
    if not os.path.exists(TOOL):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", d], check=True)
            whl = next(f for f in os.listdir(d) if f.endswith(".whl"))
            with zipfile.ZipFile(os.path.join(d, whl)) as z:
                data = z.read("nvidia/cu13/bin/nvdisasm")
        os.makedirs(os.path.dirname(TOOL), exist_ok=True)
        with open(TOOL, "wb") as f:
            f.write(data)
        os.chmod(TOOL, 0o755)
    return TOOL


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source", help="a kernels/ .cu file")
    ap.add_argument("filter", nargs="?", default="", help="substring of the (mangled) kernel names")
    ap.add_argument("--flags", default="", help="extra nvcc flags, e.g. -DCF_BWD_TRACE")
    ap.add_argument("--dump", help="write the selected kernels' SASS here")
    a = ap.parse_args()
    nvcc = os.path.join(ROOT, ".cuda", "root", "bin", "nvcc")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        subprocess.run([nvcc, "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-cubin",
                        "-gencode=arch=compute_90a,code=sm_90a", "-I" + os.path.join(ROOT, "kernels"),
                        *a.flags.split(), a.source, "-o", cubin], check=True)
        sass = subprocess.run([nvdisasm(), "-c", cubin], check=True, capture_output=True, text=True).stdout
    # one section per kernel: ".text.<mangled name>:" up to the next section
    kernels = {}
    for m in re.finditer(r"^\.text\.([^:\s]+):\n(.*?)(?=^\.text\.|\Z)", sass, flags=re.M | re.S):
        kernels[m.group(1)] = m.group(2)
    dump = []
    print("| kernel | instructions | " + " | ".join(WATCH) + " |")
    print("|---|---|" + "---|" * len(WATCH))
    for name, body in kernels.items():
        if a.filter not in name:
            continue
        ops = [re.sub(r"^@!?U?P\w+\s+", "", t.strip()).split()[0]
               for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", body)]
        c = Counter(op.split(".")[0] for op in ops)
        short = re.sub(r"^_ZN2cf\d+", "", name)[:90]
        print(f"| {short} | {len(ops)} | " + " | ".join(str(c.get(w, 0)) for w in WATCH) + " |")
        dump.append(f".text.{name}:\n{body}")
    if a.dump:
        with open(a.dump, "w") as f:
            f.write("\n".join(dump))


if __name__ == "__main__":
    main()
