#!/usr/bin/env bash
# Device side: our bench (gpu-bin/bench, from scripts/gpu-build.sh) and PyTorch SDPA on the
# FlashAttention papers' grid (B*N = 16384 tokens, hidden 2048, D in $HDIMS (64, 128, 256), causal and not)
# plus the decode shapes, in one run; then the plot and the ratio table (ours / FA2, ours /
# cuDNN), printed last. Usage: bash scripts/gpu-bench.sh [modes] [dtype]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
modes=${1:-fwd,bwd,fwd_bwd}
dtype=${2:-bf16}
seqlens=${SEQLENS:-512,1024,2048,4096,8192,16384}
hdims=${HDIMS:-64,128,256}
# PyTorch's backends for the dtype: flash and cuDNN take 16-bit only; f32 compares with the
# memory-efficient backend (3xTF32 on tensor cores, as ours).
torch_impls=torch-flash,torch-cudnn
[ "$dtype" = f32 ] && torch_impls=torch-efficient
jsonl="$OUT/bench.jsonl"
: > "$jsonl"
# ROUNDS rounds, ours and PyTorch taking turns per head dim: the card's power cap moves its clocks
# by ~10% over seconds, so each implementation keeps its fastest round of a point (plot.py).
rounds=${ROUNDS:-2}
# Every point starts from a rested card (REST_MS of idle, then 50 ms of warm-up calls), ours and
# PyTorch's alike. Under sustained load the card sits at its 700 W cap with the SM clock at
# ~1500-1700 MHz instead of 1980. Without the rest, ours ran its points back to back (near the
# cap: that was the "fwd+bwd at 16k above fwd + bwd" of 2026-11-27 (commit 2031cb3)) while cuDNN idled
# for seconds before each new shape to build its plan, which was worth 5-12% to it
# (bench/NOTES.md, 2026-11-27, commit 378b375). bench/clocks.py prints the clocks each implementation's
# points ran at; experiments/power_ab.sh compares the two under sustained load.
rest=(--rest-ms "${REST_MS:-500}" --stamp)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 > "$OUT/smi.csv" 2>&1 &
smi=$!
: > "$OUT/stamps.txt"
for ((round = 1; round <= rounds; round++)); do
  for d in ${hdims//,/ }; do
    grid=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens "$seqlens" --dtype "$dtype" "${rest[@]}")
    gpu-bin/bench --device cuda --impl flash --mode "$modes" "${grid[@]}" --iters 10 2>>"$OUT/stamps.txt" | grep '^{' >> "$jsonl"
    python3 bench/sdpa.py --impl "$torch_impls" --mode "$modes" "${grid[@]}" 2>>"$OUT/stamps.txt" >> "$jsonl"
  done
done
# Decode: 1 query against long caches, 32 query / 8 KV heads, D = 128.
dec=(--nq 1 --seqlens 4096,32768 --heads 32 --hkv 8 --hdim 128 --batch 1,16 --causal false --dtype "$dtype")
gpu-bin/bench --device cuda --impl flash --mode fwd "${dec[@]}" --iters 20 2>>"$OUT/bench.err" | grep '^{' > "$OUT/decode.jsonl"
python3 bench/sdpa.py --impl "${torch_impls%%,*}" --mode fwd "${dec[@]}" --iters 20 >> "$OUT/decode.jsonl" 2>>"$OUT/bench.err"
# GQA prefill, Llama-3-8B-like: B = 1, 32 query / 8 KV heads, D = 128, causal.
gqa=(--seqlens "${GQA_SEQLENS:-2048,8192,32768}" --heads 32 --hkv 8 --hdim 128 --batch 1 --causal true --dtype "$dtype")
: > "$OUT/gqa.jsonl"
for ((round = 1; round <= rounds; round++)); do
  gpu-bin/bench --device cuda --impl flash --mode fwd,fwd_bwd "${gqa[@]}" "${rest[@]}" --iters 10 2>>"$OUT/stamps.txt" | grep '^{' >> "$OUT/gqa.jsonl"
  python3 bench/sdpa.py --impl "$torch_impls" --mode fwd,fwd_bwd "${gqa[@]}" "${rest[@]}" --iters 10 >> "$OUT/gqa.jsonl" 2>>"$OUT/stamps.txt"
done
kill $smi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
torchv=$(python3 -c 'import torch; print(torch.__version__, "cuDNN", torch.backends.cudnn.version())')
python3 bench/plot.py "$jsonl" "$OUT/bench.png" "candle-flash vs PyTorch SDPA, $dtype, $gpu, torch $torchv, $(date -u +%F)" > "$OUT/ratios.md"
echo "== decode (Sq=1): ms and K/V TB/s"
python3 - "$OUT/decode.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        if "error" not in r:
            print(f"{r['impl']:12s} b={r['b']:2d} nk={r['nk']:6d}  {r['ms']*1e3:8.1f} us  {r['kv_tbps']:.2f} TB/s")
PY
echo "== GQA prefill (B=1, 32/8 heads, D=128, causal)"
python3 bench/plot.py "$OUT/gqa.jsonl"
echo "== SM clocks during the points (bench/clocks.py)"
python3 bench/clocks.py "$OUT/smi.csv" "$OUT/stamps.txt"
grep -v '^point ' "$OUT/stamps.txt" >> "$OUT/bench.err"
echo "== $gpu, torch $torchv"
cat "$OUT/ratios.md"
