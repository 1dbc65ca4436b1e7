#!/usr/bin/env bash
# ferrograd against PyTorch on the CPU, in one command: the main job's model (tokens/s over
# training steps) and the MLP 2048 B256 SGD-momentum step (median ms), the two engines run
# alternately RUNS times, medians and ratios printed with the CPU's flags, the thread counts
# and the load average (the figures mean little on a loaded machine).
#
# Usage: scripts/bench_cpu.sh [--runs N] [--steps N] [--threads N] [--avx2] [--full]
#   --threads N  both engines use N threads (RAYON_NUM_THREADS, OMP_NUM_THREADS); default: all
#   --avx2  both engines use AVX2 kernels only (FERROGRAD_CPU_CAPABILITY=avx2,
#           ATEN_CPU_CAPABILITY=avx2), as on a CPU without AVX-512
#   --full  also time `ferrograd` with no arguments (800 steps, evaluation, sampling) once
# PYTHON names an interpreter with torch (default python3); without torch only ferrograd runs.
# Other work on the machine skews both sides, PyTorch's OpenMP threads the most: read the load
# averages printed next to the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=3 STEPS=200 FULL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --threads) export RAYON_NUM_THREADS="$2" OMP_NUM_THREADS="$2"; shift 2 ;;
    --avx2) export FERROGRAD_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx2; shift ;;
    --full) FULL=1; shift ;;
    *) echo "unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"

cargo build --release -q -p ferrograd-cli
cargo bench -q --bench mlp_step --no-run 2>/dev/null
CLI=target/release/ferrograd
MLP=$(cargo bench --bench mlp_step --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*mlp_step[^"]*"' | tail -1 | cut -d'"' -f4)

TORCH=1
if ! "$PY" -c 'import torch' 2>/dev/null; then
  TORCH=0
  echo "PyTorch side skipped: '$PY' cannot import torch (set PYTHON to an interpreter that can)."
fi

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(getconf _NPROCESSORS_ONLN) cores"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
for f in avx2 fma avx512f; do
  case " $flags " in *" $f "*) printf '%s=yes ' "$f" ;; *) printf '%s=no ' "$f" ;; esac
done
echo "| kernels: ${FERROGRAD_CPU_CAPABILITY:-widest available} (ferrograd), ${ATEN_CPU_CAPABILITY:-default} (pytorch)"
echo "threads: ferrograd rayon ${RAYON_NUM_THREADS:-$(getconf _NPROCESSORS_ONLN) (all cores)}$(
  [ "$TORCH" = 1 ] && "$PY" -c 'import torch; print(f", pytorch {torch.get_num_threads()} (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})")')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

field() { grep -o "$1[=:] *[0-9.]*" | head -1 | sed 's/.*[=:] *//'; }
gpt_ours=(); gpt_theirs=(); mlp_ours=(); mlp_theirs=()
for i in $(seq "$RUNS"); do
  gpt_ours+=("$("$CLI" train --max-steps "$STEPS" --eval-every 0 --sample-chars 0 --json 2>/dev/null \
    | field '"tokens_per_s"' | cut -d. -f1)")
  mlp_ours+=("$("$MLP" | field median_ms)")
  if [ "$TORCH" = 1 ]; then
    gpt_theirs+=("$("$PY" benches/pytorch/gpt_step.py --steps "$STEPS" | field tokens_per_s)")
    mlp_theirs+=("$("$PY" benches/pytorch/mlp_step.py | field median_ms)")
  fi
  echo "run $i/$RUNS done, load $(cut -d' ' -f1-3 /proc/loadavg)"
done

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
row() { printf '%-34s %10s %10s %8s   %s | %s\n' "$@"; }
row "benchmark (median of $RUNS)" ferrograd pytorch ratio "ferrograd runs" "pytorch runs"
g1=$(median "${gpt_ours[@]}") m1=$(median "${mlp_ours[@]}")
if [ "$TORCH" = 1 ]; then
  g2=$(median "${gpt_theirs[@]}") m2=$(median "${mlp_theirs[@]}")
  row "main job model, tokens/s (higher)" "$g1" "$g2" "$(awk -v a="$g1" -v b="$g2" 'BEGIN{printf "%.2f", a/b}')" \
    "${gpt_ours[*]}" "${gpt_theirs[*]}"
  row "MLP 2048 B256 step, ms (lower)" "$m1" "$m2" "$(awk -v a="$m1" -v b="$m2" 'BEGIN{printf "%.2f", a/b}')" \
    "${mlp_ours[*]}" "${mlp_theirs[*]}"
  echo "ratios: tokens/s ferrograd/pytorch (>= 1 is at least as fast); step ms ferrograd/pytorch (<= 1 is at least as fast)"
else
  row "main job model, tokens/s (higher)" "$g1" - - "${gpt_ours[*]}" -
  row "MLP 2048 B256 step, ms (lower)" "$m1" - - "${mlp_ours[*]}" -
fi
if [ "$FULL" = 1 ]; then
  start=$(date +%s.%N)
  "$CLI" | grep -E '^step +800|^trained'
  echo "ferrograd with no arguments: $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s wall"
fi
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
