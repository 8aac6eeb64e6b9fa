#!/usr/bin/env python3
"""README's performance table, generated from the current result record (bench/results/ratios-h100.md,
the table scripts/gpu-bench.sh writes): ours and cuDNN at N = 16384, no mask, D = 64 / 128 / 256,
forward, backward and fwd+bwd. Rewrites the block between `<!-- perf-table -->` and
`<!-- /perf-table -->` in README.md; with --check, exits 1 when README.md differs from what the
record gives (CI runs that).
  python3 scripts/readme-table.py [--check]
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "ratios-h100.md"
README = ROOT / "README.md"
DIMS, N = (64, 128, 256), 16384
MODES = (("fwd", "forward"), ("bwd", "backward"), ("fwd_bwd", "fwd+bwd"))


def table():
    text = RECORD.read_text()
    stamp = re.match(r"<!-- (.*?);", text)
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 10 or cells[0] not in dict(MODES) or not cells[1].isdigit():
            continue
        mode, d, causal, n = cells[0], int(cells[1]), cells[2], int(cells[3])
        if causal == "False" and n == N and d in DIMS:
            rows[(mode, d)] = (cells[5], cells[7])  # ours, cuDNN TF/s
    missing = [(m, d) for m, _ in MODES for d in DIMS if (m, d) not in rows]
    if missing:
        sys.exit(f"{RECORD}: no rows for {missing}")
    out = [
        f"H100 80GB HBM3, bf16, B·N = 16384 tokens, hidden 2048, N = 16k, rested points, CUDA events,",
        "TFLOP/s (4·B·H·N²·D / time; ×2.5 backward, ×3.5 fwd+bwd), ours vs PyTorch's cuDNN backend,",
        f"{stamp.group(1) if stamp else 'see the record'} (`bench/results/ratios-h100.md`), at D = "
        + " / ".join(map(str, DIMS)) + ":",
        "",
        "| | ours | cuDNN |",
        "|---|---|---|",
    ]
    for mode, name in MODES:
        ours = " / ".join(rows[(mode, d)][0] for d in DIMS)
        cudnn = " / ".join(rows[(mode, d)][1] for d in DIMS)
        out.append(f"| {name} | {ours} | {cudnn} |")
    return "\n".join(out)


def main():
    readme = README.read_text()
    m = re.search(r"(<!-- perf-table -->\n)(.*?)(\n<!-- /perf-table -->)", readme, re.S)
    if not m:
        sys.exit("README.md has no <!-- perf-table --> ... <!-- /perf-table --> block")
    new = readme[: m.start(2)] + table() + readme[m.end(2):]
    if "--check" in sys.argv[1:]:
        if new != readme:
            sys.exit("README.md's performance table differs from bench/results/ratios-h100.md: "
                     "run python3 scripts/readme-table.py")
        return
    README.write_text(new)


if __name__ == "__main__":
    main()
