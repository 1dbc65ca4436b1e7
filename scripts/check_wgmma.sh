#!/usr/bin/env bash
# Fails if ptxas serialises the wgmma products of any kernel (its note C7518: "wgmma.mma_async
# instructions are serialized"). ptxas does so, silently but for that note, when it must wait
# for an accumulator inside a branch that differs between a warpgroup's warps: every product
# then waits for the one before it. The results stay right, so no test of values sees it; the
# dK/dV attention kernel once ran so.
# It assembles every module's PTX for the target it names: the PTX that `ferrograd info
# --emit-ptx <folder> [--arch sm_90a]` wrote to PTX_DIR, or, without PTX_DIR, PTX it writes so
# for sm_90a into a temporary folder (NVRTC and ptxas needed, no GPU; the kernel cache holds
# machine code, not PTX).
# Environment: BIN (the folder holding `ferrograd`, default .bin), PTXAS (default: on PATH,
# else /usr/local/cuda/bin/ptxas), PTX_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.bin}
PTXAS=${PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
emitted=
if [ -z "${PTX_DIR:-}" ]; then
  PTX_DIR=$(mktemp -d) emitted=$PTX_DIR
  "$BIN/ferrograd" info --emit-ptx "$PTX_DIR" --arch sm_90a | grep '^ptx'
fi
mapfile -t files < <(ls "$PTX_DIR"/*.ptx)
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
rm -rf "$notes" ${emitted:+"$emitted"}
echo "wgmma check: ${#files[@]} modules assembled, $bad with serialised products"
[ "$bad" -eq 0 ]
