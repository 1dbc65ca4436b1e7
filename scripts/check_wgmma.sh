#!/usr/bin/env bash
# Fails if ptxas serialises the wgmma products of any kernel (its note C7518: "wgmma.mma_async
# instructions are serialized"). ptxas does so, silently but for that note, when it must wait
# for an accumulator inside a branch that differs between a warpgroup's warps: every product
# then waits for the one before it. The results stay right, so no test of values sees it; the
# dK/dV attention kernel once ran so.
# On a GPU machine with CUDA's ptxas: fills the kernel cache (`ferrograd info
# --compile-kernels`), then assembles each module's newest PTX for the target it names.
# Without a GPU: PTX_DIR=<folder> assembles the PTX that `ferrograd info --emit-ptx <folder>
# [--arch sm_90a]` wrote there (NVRTC and ptxas needed, no GPU).
# Environment: BIN (the folder holding `ferrograd`, default .bin), PTXAS (default: on PATH,
# else /usr/local/cuda/bin/ptxas), FERROGRAD_KERNEL_CACHE (the cache folder, as ferrograd
# reads it), PTX_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.bin}
PTXAS=${PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
CACHE=${FERROGRAD_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrograd/kernels}
if [ -n "${PTX_DIR:-}" ]; then
  # PTX written by `ferrograd info --emit-ptx DIR --arch ARCH`, which needs no GPU.
  mapfile -t files < <(ls "$PTX_DIR"/*.ptx)
else
  "$BIN/ferrograd" info --compile-kernels | grep 'kernel modules'
  # The newest file of each module (files are named <module>-<hash>.ptx; older hashes are
  # earlier builds' sources, which the cache keeps).
  mapfile -t files < <(ls -t "$CACHE"/*.ptx | awk '{ k = $0; sub(/-[^-]*\.ptx$/, "", k); if (!(k in seen)) { seen[k] = 1; print } }')
fi
# One ptxas a file, all at once (the attention modules take seconds each).
notes=$(mktemp -d)
for ptx in "${files[@]}"; do
  (
    target=$(awk '$1 == ".target" { sub(/,.*/, "", $2); print $2; exit }' "$ptx")
    "$PTXAS" -arch="$target" -v "$ptx" -o /dev/null 2>&1 | grep -E 'C7518|serialized' \
      > "$notes/$(basename "$ptx").$target" || true
  ) &
done
wait
bad=0
for n in "$notes"/*; do
  if [ -s "$n" ]; then
    bad=$((bad + 1))
    echo "$(basename "$n"):"
    cat "$n"
  fi
done
rm -rf "$notes"
echo "wgmma check: ${#files[@]} modules assembled, $bad with serialised products"
[ "$bad" -eq 0 ]
