#!/usr/bin/env bash
# The GPU speed table, ferrograd and PyTorch side by side, on a GPU machine after
# `scripts/gpu_tests.sh build` (here) has filled .bin/. Each row runs ours, then PyTorch's
# twin, each in its own process; prints one markdown table last (and the raw lines above it).
#
# Usage: scripts/gpu_speed.sh [PYTHON_WITH_TORCH]
# Environment: ROWS (space-separated subset of: attention layer-norm gpt2-bf16 gpt2-bf16-weights
#   gpt2-bf16-v50304 gpt2-bf16-b16 gpt2-bf16-b32 gpt2-f32 gpt2-bf16-recompute gpt2-bf16-gelu
#   gpt2-bf16-graphs gpt2-max-batch main-job main-job-eager main-job-f16 main-job-f16-eager
#   main-job-step-in-backward gpt-10m gpt-10m-eager gpt-10m-dropout; default all but
#   gpt2-max-batch, which takes minutes), OUT (a folder for
#   the raw log). `ferrograd train` replays a captured step (CUDA graphs) by default; the
#   -eager rows run it with --cuda-graphs off.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
B=.bin
ROWS="${ROWS:-attention layer-norm gpt2-bf16 gpt2-bf16-graphs gpt2-bf16-weights gpt2-bf16-v50304 gpt2-bf16-b16 gpt2-bf16-b32 gpt2-f32 gpt2-bf16-recompute gpt2-bf16-gelu main-job main-job-eager main-job-f16 main-job-f16-eager main-job-step-in-backward gpt-10m gpt-10m-eager gpt-10m-dropout}"
LOG="${OUT:-/tmp}/gpu_speed.log"
: >"$LOG"
TABLE=()

# A JSON field of the last JSON line of "$1".
field() { printf '%s\n' "$1" | grep '^{' | tail -1 | "$PY" -c "import json,sys; print(json.load(sys.stdin).get('$2'))"; }
# A key=value field of a line.
kv() { printf '%s\n' "$1" | grep -o "$2=[^ ]*" | tail -1 | cut -d= -f2; }
run() { echo "\$ $*" >>"$LOG"; "$@" 2>>"$LOG" | tee -a "$LOG"; }
mib() { "$PY" -c "print(f'{int($1)/2**20:.0f} MiB' if '$1' not in ('', 'None') else '-')"; }
ratio() { "$PY" -c "print(f'{float($1)/float($2):.2f}')" 2>/dev/null || echo -; }

# One attention row: label, then the JSON field both sides print.
attention_pair() {
  TABLE+=("| $1 | $(field "$a" "$2") | $(field "$p" "$2") (SDPA $(field "$p" sdpa_backend)) | $(ratio "$(field "$a" "$2")" "$(field "$p" "$2")") |")
}
row_attention() {
  local a p
  a=$(run "$B/attention" --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype bf16)
  p=$(run "$PY" benches/pytorch/attention.py --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype bf16)
  attention_pair "attention B8 H12 T1024 d64 bf16, fwd+bwd ms" fwd_bwd_ms
  attention_pair "attention forward ms" fwd_ms
  # Calls queued back to back: the device's time per call, each side's host overhead hidden.
  attention_pair "attention fwd+bwd ms, calls queued" fwd_bwd_queued_ms
  attention_pair "attention forward ms, calls queued" fwd_queued_ms
  # The issue's target names SDPA's flash kernel (FlashAttention-2); SDPA picks cuDNN on Hopper.
  p=$(run "$PY" benches/pytorch/attention.py --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype bf16 --backend flash)
  attention_pair "attention fwd+bwd ms, calls queued, against flash" fwd_bwd_queued_ms
  attention_pair "attention fwd+bwd ms, per call, against flash" fwd_bwd_ms
  a=$(run "$B/attention" --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype bf16 --dropout 0.1)
  p=$(run "$PY" benches/pytorch/attention.py --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype bf16 --dropout 0.1)
  attention_pair "attention, dropout 0.1 on the probabilities, fwd+bwd ms" fwd_bwd_ms
  # f32 heads: ours three TF32 products per product, PyTorch's memory-efficient kernel.
  a=$(run "$B/attention" --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype f32)
  p=$(run "$PY" benches/pytorch/attention.py --batch 8 --heads 12 --seq 1024 --head-dim 64 --dtype f32)
  attention_pair "attention f32, fwd+bwd ms" fwd_bwd_ms
  attention_pair "attention f32 forward ms" fwd_ms
}

# The residual add + layer norm of a GPT-2 step alone (ours; no PyTorch twin): microseconds a
# call and the forward's bytes per second, to set against the GPU's copy speed.
row_layer-norm() {
  local a
  a=$(run "$B/layer_norm" --rows 8192 --n 768 --half bf16)
  TABLE+=("| residual add + layer norm (8192, 768), f32 stream, bf16 out: forward µs (GB/s), forward + backward µs | $(field "$a" fwd_us) ($(field "$a" fwd_gb_per_s)), $(field "$a" fwd_bwd_us) | | |")
}

# gpt2 rows: ours (strategies bench) against PyTorch's strategies.py with extra flags.
# gpt2_row NAME STRATEGY FLAGS_BOTH TORCH_FLAGS TORCH_NAME [OUR_FLAGS]
# Leaves our output in GPT2_OURS, for rows that compare it with another of our runs.
GPT2_OURS=
gpt2_row() {
  local name=$1 strategy=$2 both=$3 torch_flags=$4 torch_name=$5 ours=${6:-} a p
  a=$(run "$B/strategies" --model gpt2 --strategy "$strategy" --device cuda --seq 1024 --steps 5 --warmup 3 $both $ours)
  GPT2_OURS=$a
  p=$(run "$PY" benches/pytorch/strategies.py --model gpt2 --strategy "$strategy" --device cuda --seq 1024 --steps 5 --warmup 3 $both $torch_flags)
  TABLE+=("| $name, step ms (peak) | $(field "$a" step_ms) ($(mib "$(field "$a" peak_bytes)")) | $(field "$p" step_ms) ($(mib "$(field "$p" peak_bytes)")) $torch_name | $(ratio "$(field "$a" step_ms)" "$(field "$p" step_ms)") |")
}

COMPILED="--sdpa --compile --fused-adam"
row_gpt2-bf16() {
  gpt2_row "GPT-2 124M B8 T1024 bf16" bf16 "--batch 8" "$COMPILED" "torch.compile+SDPA+fused AdamW"
  gpt2_row "GPT-2 124M B8 T1024 bf16" bf16 "--batch 8" "--sdpa" "eager+SDPA"
}
# The vocabulary padded to a multiple of 64 (nanoGPT's and llm.c's 50304) on both sides.
row_gpt2-bf16-v50304() {
  gpt2_row "GPT-2 124M B8 T1024 bf16, vocab 50304" bf16 "--batch 8 --vocab 50304" "$COMPILED" "torch.compile+SDPA+fused AdamW"
}
# Ours with the model in bf16 and AdamW master weights (no autocast casts), against the same
# torch.compile autocast step (PyTorch's recipe for this model; it has no twin of ours here).
row_gpt2-bf16-weights() {
  local a p
  a=$(run "$B/strategies" --model gpt2 --strategy bf16-weights --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8)
  p=$(run "$PY" benches/pytorch/strategies.py --model gpt2 --strategy bf16 --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 $COMPILED)
  TABLE+=("| GPT-2 124M B8 T1024, bf16 weights + f32 master (ours) vs bf16 autocast, step ms (peak) | $(field "$a" step_ms) ($(mib "$(field "$a" peak_bytes)")) | $(field "$p" step_ms) ($(mib "$(field "$p" peak_bytes)")) torch.compile+SDPA+fused AdamW | $(ratio "$(field "$a" step_ms)" "$(field "$p" step_ms)") |")
}
# The measured steps replay one captured step (ours only; --cuda-graphs), against the same
# torch.compile step, with nothing recomputed (--recompute off; row gpt2-bf16-gelu has
# `ferrograd train`'s GPU default).
row_gpt2-bf16-graphs() {
  local a p
  for s in bf16 bf16-weights; do
    a=$(run "$B/strategies" --model gpt2 --strategy $s --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 --cuda-graphs)
    p=$(run "$PY" benches/pytorch/strategies.py --model gpt2 --strategy bf16 --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 $COMPILED)
    TABLE+=("| GPT-2 124M B8 T1024 $s, CUDA graph replayed (ours), step ms (peak) | $(field "$a" step_ms) ($(mib "$(field "$a" peak_bytes)")) | $(field "$p" step_ms) ($(mib "$(field "$p" peak_bytes)")) torch.compile+SDPA+fused AdamW | $(ratio "$(field "$a" step_ms)" "$(field "$p" step_ms)") |")
  done
}

# Each MLP's GELU output recomputed in backward (ours only; --recompute-gelu), with autocast
# (what `ferrograd train` does on a GPU by default, --recompute auto) and with bf16 weights,
# against the same torch.compile step (whose partitioner recomputes cheap pointwise ops such
# as the GELU by itself).
row_gpt2-bf16-gelu() {
  local a p
  p=$(run "$PY" benches/pytorch/strategies.py --model gpt2 --strategy bf16 --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 $COMPILED)
  for s in bf16 bf16-weights; do
    a=$(run "$B/strategies" --model gpt2 --strategy $s --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 --recompute-gelu --cuda-graphs)
    TABLE+=("| GPT-2 124M B8 T1024 $s, GELU recomputed, graph replayed (ours), step ms (peak) | $(field "$a" step_ms) ($(mib "$(field "$a" peak_bytes)")) | $(field "$p" step_ms) ($(mib "$(field "$p" peak_bytes)")) torch.compile+SDPA+fused AdamW | $(ratio "$(field "$a" step_ms)" "$(field "$p" step_ms)") (peak $(ratio "$(field "$a" peak_bytes)" "$(field "$p" peak_bytes)")) |")
  done
}
# Ours replaying a captured step, as `ferrograd train` does by default.
row_gpt2-bf16-b16() { gpt2_row "GPT-2 124M B16 T1024 bf16, GELU recomputed (train's GPU default), graph replayed (ours)" bf16 "--batch 16" "$COMPILED" "torch.compile+SDPA+fused AdamW" "--cuda-graphs --recompute-gelu"; }
row_gpt2-bf16-b32() { gpt2_row "GPT-2 124M B32 T1024 bf16, GELU recomputed (train's GPU default), graph replayed (ours)" bf16 "--batch 32" "$COMPILED" "torch.compile+SDPA+fused AdamW" "--cuda-graphs --recompute-gelu"; }
row_gpt2-f32() { gpt2_row "GPT-2 124M B8 T1024 f32, graph replayed (ours)" baseline "--batch 8" "--sdpa" "eager+SDPA" --cuda-graphs; }
# Every block recomputed in backward under bf16 autocast, against PyTorch's per-block
# torch.utils.checkpoint in the same autocast region; then what recomputation costs us: our
# recompute-bf16 step over our own plain bf16 step (run again here, so the two share a machine
# state).
row_gpt2-bf16-recompute() {
  local r b
  gpt2_row "GPT-2 124M B8 T1024 bf16, every block recomputed" recompute-bf16 "--batch 8" "--sdpa" "eager+SDPA"
  r=$(field "$GPT2_OURS" step_ms)
  b=$(field "$(run "$B/strategies" --model gpt2 --strategy bf16 --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8)" step_ms)
  TABLE+=("| GPT-2 124M B8 T1024 bf16, recompute overhead (ours: recompute-bf16 / bf16 step ms) | $r / $b = $(ratio "$r" "$b") | - | - |")
  # Selective: each recomputed block keeps its attention's output and log-sum-exp.
  local s
  s=$(run "$B/strategies" --model gpt2 --strategy recompute-bf16 --device cuda --seq 1024 --steps 5 --warmup 3 --batch 8 --keep-attention)
  TABLE+=("| same, selective (attention output kept), step ms (peak); overhead over bf16 | $(field "$s" step_ms) ($(mib "$(field "$s" peak_bytes)")); $(ratio "$(field "$s" step_ms)" "$b") | - | - |")
}

# The largest GPT-2 124M batch (T 1024, bf16 autocast) each side fits in the GPU's free memory
# (about 139 GiB on an H200), and its speed. Ours: the batch `ferrograd plan --budget` picks for
# the short run below, trained for three steps (the summary has the planned and the measured
# peaks). PyTorch (torch.compile): bytes per sequence from its peaks at B 16 and B 32, the
# largest batch under 97% of the free memory by that line (its reserved bytes run above its
# allocated ones), run there, 8 fewer on OOM.
GPT2_JOB="--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50257 --amp bf16"
row_gpt2-max-batch() {
  local free b a p16 p32 bt p short="--max-steps 3 --warmup 1 --eval-every 0 --eval-batches 1"
  free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
  b=$("$B/ferrograd" plan --device cuda $GPT2_JOB $short --budget "${free}MiB" --batch-steps any 2>>"$LOG" \
    | awk '/^largest micro-batch/{f=1;next} f && /\(as given\)/{print $3; exit}')
  # `ferrograd train` times every step from the first (warm-up and capture included), so the
  # steady rate is taken from two runs: the tokens and seconds of steps 4 to 8. A first run
  # tunes the GEMMs and stores its choices, so the two timed runs start alike.
  local a3 a
  train_b() { run "$B/ferrograd" train --device cuda $GPT2_JOB "$@" --batch-size "$b" --sample-chars 0 --json; }
  train_b $short >/dev/null
  a3=$(train_b $short)
  a=$(train_b ${short/--max-steps 3/--max-steps 8})
  local steady
  steady=$("$PY" -c "print(f'{5 * $b * 1024 / ($(field "$a" seconds) - $(field "$a3" seconds)):.0f}')" 2>/dev/null || echo -)
  TABLE+=("| GPT-2 124M bf16, largest batch in the free $(mib $((free << 20))) (ours, planned), tokens/s of steps 4-8 (peak / reserved / planned reserved) | B $b: $steady ($(mib "$(field "$a" peak_bytes)") / $(mib "$(field "$a" peak_reserved_bytes)") / $(mib "$(field "$a" predicted_peak_reserved_bytes)")) | | |")
  # PyTorch's step at a batch, and whether it fit (a peak was printed).
  torch_b() { run "$PY" benches/pytorch/strategies.py --model gpt2 --strategy bf16 --device cuda --seq 1024 --steps 2 --warmup 1 --batch "$1" $COMPILED; }
  fits() { local pk; pk=$(field "$1" peak_bytes); [ -n "$pk" ] && [ "$pk" != None ]; }
  local o16 o32
  o16=$(torch_b 16)
  o32=$(torch_b 32)
  p16=$(field "$o16" peak_bytes)
  p32=$(field "$o32" peak_bytes)
  # Its largest batch: the estimate from the B16/B32 peaks first (its large batches also hold
  # whole-logits blocks, so the estimate can run high), then halving the gap between the largest
  # batch seen to fit (lo, B32 at first) and the smallest seen to fail (hi), in multiples of 8;
  # while nothing has failed, the next try extrapolates from the largest fit's peak.
  local name="same, PyTorch torch.compile+SDPA+fused AdamW, largest batch found"
  if ! fits "$o32"; then
    TABLE+=("| $name | | B 32 out of memory | |")
    return
  fi
  local lo=32 hi=0 lo_out=$o32 tries=0
  bt=$("$PY" -c "per = ($p32 - $p16) / 16; print(int((0.97 * $free * 2**20 - ($p16 - 16 * per)) // per) // 8 * 8)")
  while [ "$tries" -lt "${MAX_BATCH_TRIES:-4}" ] && [ "$bt" -gt "$lo" ]; do
    tries=$((tries + 1))
    p=$(torch_b "$bt")
    if fits "$p"; then
      lo=$bt lo_out=$p
    else
      hi=$bt
    fi
    if [ "$hi" = 0 ]; then
      # Nothing has failed yet: extrapolate from the peak of the largest fit, 8 at least.
      bt=$("$PY" -c "per = $(field "$lo_out" peak_bytes) / $lo; print(max($lo + 8, int(0.97 * $free * 2**20 // per) // 8 * 8))")
    else
      bt=$(( (lo + hi) / 16 * 8 ))
    fi
  done
  local above="no larger batch tried"
  [ "$hi" -gt 0 ] && above="B $hi out of memory"
  TABLE+=("| $name in $tries tries past B32, step ms (peak) | | B $lo: $(field "$lo_out" step_ms) ms ($(mib "$(field "$lo_out" peak_bytes)")); $above | |")
}

# ferrograd train against benches/pytorch/gpt_step.py on the same flags.
train_row() {
  local name=$1 steps=$2 flags=$3 torch_flags=$4 a p
  a=$(run "$B/ferrograd" train --device cuda --max-steps "$steps" --eval-every 0 --sample-chars 0 --json $flags)
  p=$(run "$PY" benches/pytorch/gpt_step.py --device cuda --steps "$steps" --warmup-steps 20 $torch_flags)
  # How our steps ran: replaying a CUDA graph, or eager.
  case "$(field "$a" cuda_graphs)" in "CUDA graphs: on"*) name="$name [graph]" ;; *) name="$name [eager]" ;; esac
  TABLE+=("| $name, tokens/s (peak) | $(field "$a" tokens_per_s) ($(mib "$(field "$a" peak_bytes)")) | $(kv "$p" tokens_per_s) ($(mib "$(kv "$p" peak_bytes)")) eager+SDPA | $(ratio "$(field "$a" tokens_per_s)" "$(kv "$p" tokens_per_s)") |")
}

row_main-job() { train_row "main job model (4×128, B16 T64, f32)" 300 "" ""; }
row_main-job-eager() { train_row "main job model, --cuda-graphs off" 300 "--cuda-graphs off" ""; }
# f16 autocast with loss scaling: ours decides the skip and the scale on the GPU.
row_main-job-f16() { train_row "main job model, f16 + GradScaler" 300 "--amp f16" "--amp f16"; }
row_main-job-f16-eager() { train_row "main job model, f16 + GradScaler, --cuda-graphs off" 300 "--amp f16 --cuda-graphs off" "--amp f16"; }
# The optimizer inside backward (ours only; PyTorch's twin steps after backward): AdamW's
# hooks, and SGD's gradient-free path.
row_main-job-step-in-backward() {
  train_row "main job model, --step-in-backward (AdamW hooks)" 300 "--step-in-backward" ""
  train_row "main job model, --step-in-backward --optimizer sgd (gradient-free)" 300 "--step-in-backward --optimizer sgd" ""
}
GPT10="--n-layer 6 --n-head 6 --n-embd 384 --batch-size 64 --block-size 256 --amp bf16 --clip 1.0"
GPT10_PT="--n-layer 6 --n-head 6 --n-embd 384 --batch 64 --block 256 --amp bf16 --clip 1.0"
row_gpt-10m() { train_row "10.8M GPT B64 T256 bf16" 300 "$GPT10" "$GPT10_PT"; }
row_gpt-10m-eager() { train_row "10.8M GPT B64 T256 bf16, --cuda-graphs off" 300 "$GPT10 --cuda-graphs off" "$GPT10_PT"; }
row_gpt-10m-dropout() { train_row "10.8M GPT, dropout 0.2" 300 "$GPT10 --dropout 0.2" "$GPT10_PT --dropout 0.2"; }

for r in $ROWS; do "row_$r"; done
echo
echo "| workload | ferrograd | PyTorch | ratio (ours / theirs) |"
echo "|---|---:|---:|---:|"
printf '%s\n' "${TABLE[@]}"
