#!/usr/bin/env bash
# Runs the MLP training-step benchmark in ferrograd and in PyTorch side by side, alternating
# runs, and prints each side's median step time and the ratio.
# Usage: scripts/bench_mlp_step.sh [PYTHON_WITH_TORCH] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
RUNS="${2:-5}"
cargo bench --bench mlp_step --no-run >/dev/null 2>&1
BIN=$(cargo bench --bench mlp_step --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*mlp_step[^"]*"' | tail -1 | cut -d'"' -f4)
ours=(); theirs=()
for _ in $(seq "$RUNS"); do
  ours+=("$("$BIN" | grep -o 'median_ms=[0-9.]*' | cut -d= -f2)")
  theirs+=("$("$PY" benches/pytorch/mlp_step.py | grep -o 'median_ms=[0-9.]*' | cut -d= -f2)")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m_ours=$(median "${ours[@]}"); m_theirs=$(median "${theirs[@]}")
printf '%-12s %12s   runs\n' "engine" "step ms (median of medians)"
printf '%-12s %12s   %s\n' ferrograd "$m_ours" "${ours[*]}"
printf '%-12s %12s   %s\n' pytorch "$m_theirs" "${theirs[*]}"
awk -v a="$m_ours" -v b="$m_theirs" 'BEGIN { printf "ratio ferrograd/pytorch = %.2f\n", a / b }'
