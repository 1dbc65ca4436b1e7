#!/usr/bin/env bash
# Data parallel over NCCL on a GPU machine, after `scripts/gpu_tests.sh build` (here) has
# filled .bin/: GPT-2 124M (bf16, B 8, T 1024, AdamW) trained plainly, then as one rank of
# `ferrograd launch --nproc-per-node N`, then under `torchrun --standalone --no-python` when
# torchrun is installed; prints tokens/s, step time, peak and DDP's overhead against the plain
# run (N = 1 measures the whole data-parallel path on one GPU; with N GPUs tokens/s is the
# whole group's). The GPU test binary tests/gpu_dist (collectives, DDP over NCCL) runs first.
#   scripts/gpu_ddp.sh [NPROC] [STEPS]        (defaults: 1, 60)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
B=.bin
N=${1:-1}
STEPS=${2:-60}
LOG=${OUT:-/tmp}/gpu_ddp.log
: >"$LOG"

GPT2="--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50257 --batch-size 8"
TRAIN=(train --device cuda --amp bf16 --max-steps "$STEPS" --eval-every 0 --eval-batches 1 --sample-chars 0 --json $GPT2)

# A JSON field of the last JSON line of "$1".
field() {
  printf '%s\n' "$1" | sed 's/^\[rank 0\] //' | grep '^{' | tail -1 \
    | python3 -c "import json,sys; print(json.load(sys.stdin).get('$2'))"
}
run() { echo "\$ $*" >>"$LOG"; "$@" 2>>"$LOG" | tee -a "$LOG"; }

echo "== tests/gpu_dist"
"$B/tests/gpu_dist" --test-threads=1 2>&1 | tee -a "$LOG" | grep -E '^test |test result'

# A first process on a fresh machine fills the driver's cache of compiled kernels; without
# this warm-up the first measured run would pay for it.
"$B/ferrograd" train --device cuda --amp bf16 --max-steps 2 --eval-every 0 --eval-batches 1 \
  --sample-chars 0 --json $GPT2 >>"$LOG" 2>&1
plain=$(run "$B/ferrograd" "${TRAIN[@]}")
launched=$(run "$B/ferrograd" launch --nproc-per-node "$N" -- "$B/ferrograd" "${TRAIN[@]}")
rows=("plain|$plain" "ferrograd launch, $N rank(s)|$launched")
if command -v torchrun >/dev/null; then
  viatorch=$(run torchrun --standalone --nproc-per-node "$N" --no-python "$B/ferrograd" "${TRAIN[@]}")
  rows+=("torchrun --no-python, $N rank(s)|$viatorch")
fi

base=$(field "$plain" tokens_per_s)
echo
echo "| run | tokens/s | peak (rank 0) | overhead against plain |"
echo "|---|---:|---:|---:|"
for r in "${rows[@]}"; do
  name=${r%%|*} out=${r#*|}
  tps=$(field "$out" tokens_per_s) peak=$(field "$out" peak_bytes)
  # Time per token against the plain run's.
  over=$(python3 -c "print(f'{$base / $tps * 100 - 100:+.1f}%')" 2>/dev/null || echo -)
  [ "$N" != 1 ] && over="(N = $N: compare tokens/s per rank)"
  echo "| $name | $tps | $peak | $over |"
done
