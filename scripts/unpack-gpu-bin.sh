#!/usr/bin/env bash
# Device side: unpacks gpu-pack/bin.tar.xz (scripts/gpu-build.sh) into gpu-bin/ unless gpu-bin/
# already holds that very pack. A warm device machine keeps ignored folders between calls, so a
# gpu-bin/ left by an earlier pack would otherwise run stale binaries (it did once: a fixed test
# ran in its old form). Sourced by scripts/device-prelude.sh from the repository root.
pack=gpu-pack/bin.tar.xz
sum=$(sha256sum "$pack" | cut -d' ' -f1)
if [ "$(cat gpu-bin/.pack-sha256 2>/dev/null)" != "$sum" ]; then
  rm -rf gpu-bin
  mkdir -p gpu-bin
  tar -C gpu-bin -xJf "$pack"
  echo "$sum" > gpu-bin/.pack-sha256
fi
