#!/usr/bin/env bash
# Data parallel over NCCL on a GPU machine, after `scripts/gpu_tests.sh build` (here) has
# filled .bin/: GPT-2 124M (bf16, B 8, T 1024, AdamW) trained plainly, then as one rank of
# `ferrograd launch --nproc-per-node N` (DDP, then ZeRO-1's sharded AdamW), then under
# `torchrun --standalone --no-python` when torchrun is installed; prints tokens/s, step time, peak and DDP's overhead against the plain
# run (N = 1 measures the whole data-parallel path on one GPU; with N GPUs tokens/s is the
# whole group's). The GPU test binary tests/gpu_dist (collectives, DDP over NCCL) runs first.
#   [ROUNDS=2] scripts/gpu_ddp.sh [NPROC] [STEPS]        (defaults: 1, 60)
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
# ROUNDS rounds of the three runs, alternating, so that drift hits each alike; each row
# shows every round's tokens/s and their mean, and the overhead compares the means.
ROUNDS=${ROUNDS:-2}
names=(plain "ferrograd launch, $N rank(s)")
cmds=("$B/ferrograd ${TRAIN[*]}" "$B/ferrograd launch --nproc-per-node $N -- $B/ferrograd ${TRAIN[*]}")
names+=("ferrograd launch, $N rank(s), --zero 1")
cmds+=("$B/ferrograd launch --nproc-per-node $N -- $B/ferrograd ${TRAIN[*]} --zero 1")
if command -v torchrun >/dev/null; then
  names+=("torchrun --no-python, $N rank(s)")
  cmds+=("torchrun --standalone --nproc-per-node $N --no-python $B/ferrograd ${TRAIN[*]}")
fi
declare -A tps peak
for round in $(seq "$ROUNDS"); do
  for k in "${!cmds[@]}"; do
    out=$(run ${cmds[$k]})
    tps[$k]="${tps[$k]:-} $(field "$out" tokens_per_s)"
    peak[$k]=$(field "$out" peak_bytes)
  done
done

mean() { python3 -c "import sys; v=[float(x) for x in sys.argv[1:]]; print(f'{sum(v)/len(v):.0f}')" $1; }
base=$(mean "${tps[0]}")
echo
echo "| run | tokens/s, mean (each round) | peak (rank 0) | overhead against plain |"
echo "|---|---:|---:|---:|"
for k in "${!cmds[@]}"; do
  m=$(mean "${tps[$k]}")
  each=$(python3 -c "import sys; print(', '.join(f'{float(x):.0f}' for x in sys.argv[1:]))" ${tps[$k]})
  # Time per token against the plain run's.
  over=$(python3 -c "print(f'{$base / $m * 100 - 100:+.1f}%')" 2>/dev/null || echo -)
  [ "$N" != 1 ] && over="(N = $N: compare tokens/s per rank)"
  echo "| ${names[$k]} | $m ($each) | ${peak[$k]} | $over |"
done
