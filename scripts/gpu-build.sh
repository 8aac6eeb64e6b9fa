#!/usr/bin/env bash
# Builds (here, no GPU needed) the `cuda` test binaries and the bench examples, and copies them
# stripped into the ignored folder gpu-bin/, with the library-path helper, for the GPU machine:
#   bash scripts/gpu-run.sh   (there, with gpu-pack/ copied along)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .cuda/env.sh ] || bash scripts/install-cuda.sh
# shellcheck disable=SC1091
source .cuda/env.sh

out=gpu-bin
rm -rf "$out"
mkdir -p "$out/tests"
# Test binaries: one per tests/*.rs and llama/tests/*.rs (plus both libs' unit tests), found in
# cargo's JSON output.
cargo test --release -p candle-flash -p candle-flash-llama --features candle-flash/cuda,candle-flash-llama/cuda --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  cp "$exe" "$out/tests/$name"
done
cargo build --release --features cuda --example bench
cp "${CARGO_TARGET_DIR:-target}/release/examples/bench" "$out/bench"
cargo build --release --features cuda --example block_sparse_bench
cp "${CARGO_TARGET_DIR:-target}/release/examples/block_sparse_bench" "$out/block_sparse_bench"
strip "$out"/tests/* "$out/bench" "$out/block_sparse_bench"
# ../shared does not travel to the device: carry its library-path helper along.
cp ../shared/device/cuda-libs.sh "$out/"
# The binaries embed candle's PTX (~200 MB together); xz -9 shrinks them under the device
# tool's 64 MiB carry limit (~10 MB). Carry gpu-pack; the device scripts unpack it.
mkdir -p gpu-pack
# (written aside and moved in whole: a pack being written is never the one carried)
tar -C "$out" -cf - . | xz --lzma2=preset=9,dict=256MiB -T1 > gpu-pack/bin.tar.xz.part
mv gpu-pack/bin.tar.xz.part gpu-pack/bin.tar.xz
ls -la "$out/tests" gpu-pack
