#!/usr/bin/env bash
# GPU tests and benchmarks in two steps, for a GPU machine that has no Rust toolchain:
#   scripts/gpu_tests.sh build   # here: builds the GPU test binaries, the CLI and the benches into .bin/
#   scripts/gpu_tests.sh run     # on the GPU machine: runs every test binary, prints a pass/fail summary
# Environment for run: ONLY (space-separated test binaries to run, default all), FILTER (a test
# name filter passed to each), SANITIZE=1 (each under compute-sanitizer's memcheck, which
# reports any access outside a live allocation), OUT (a folder for the logs), DEADLINE_S (seconds
# from the start after which no binary runs on: each runs under the time left, and those after
# it are reported as skipped), THREADS (test threads per binary, default 1). Before the tests,
# `ferrograd info --compile-kernels` fills the kernel cache on every host thread (a cold one
# otherwise costs the first tests minutes of compiling, one module at a time); WARM=0 skips it.
# With every binary run (no ONLY), it ends with scripts/check_wgmma.sh, which needs CUDA's
# ptxas (PTXAS, on PATH or /usr/local/cuda/bin; reported as skipped without it).
# The GPU test targets (tests/gpu_*.rs and the CUDA variants of the golden tests) exist only
# with the `gpu-tests` feature and fail, not skip, when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.bin

build() {
  export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=true
  rm -rf "$BIN" && mkdir -p "$BIN/tests"
  cargo build --release -p ferrograd-cli
  cp "${CARGO_TARGET_DIR:-target}/release/ferrograd" "$BIN/"
  cargo test --release -p ferrograd --features gpu-tests --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 \
    | grep -E '/(gpu_[a-z_]+|golden_ops|golden_rows|gpt)-[0-9a-f]+$' \
    | while read -r exe; do cp "$exe" "$BIN/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  cargo bench -p ferrograd --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 \
    | grep -E '/(mlp_step|gemm|strategies|attention|layer_norm)-[0-9a-f]+$' \
    | while read -r exe; do cp "$exe" "$BIN/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  ls -la "$BIN" "$BIN/tests"
}

run() {
  local pass=0 fail=0 skipped=0 wrap=() start=$SECONDS limit=()
  if [ "${WARM:-1}" = 1 ] && [ -x "$BIN/ferrograd" ]; then
    "$BIN/ferrograd" info --compile-kernels | grep 'kernel modules' || echo "kernel warm-up failed: the tests compile as they go"
  fi
  if [ "${SANITIZE:-0}" = 1 ]; then
    wrap=("${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}" --tool memcheck --error-exitcode 1)
  fi
  for t in "$BIN"/tests/*; do
    local name log
    name=$(basename "$t"); log=$(mktemp)
    if [ -n "${ONLY:-}" ] && ! printf ' %s ' $ONLY | grep -q " $name "; then continue; fi
    if [ -n "${DEADLINE_S:-}" ]; then
      local left=$((DEADLINE_S - (SECONDS - start)))
      if [ "$left" -lt 10 ]; then
        printf '%-18s SKIPPED (deadline)\n' "$name"; skipped=$((skipped + 1)); continue
      fi
      limit=(timeout "$left")
    fi
    local rc=0
    "${limit[@]}" "${wrap[@]}" "$t" --test-threads="${THREADS:-1}" ${FILTER:-} >"$log" 2>&1 || rc=$?
    case $rc in
      0) status=PASS; pass=$((pass + 1)) ;;
      124) status="FAIL (deadline: cut off)"; fail=$((fail + 1)) ;;
      *) status=FAIL; fail=$((fail + 1)) ;;
    esac
    printf '%-18s %s  %s\n' "$name" "$status" "$(grep -E '^test result' "$log" | tail -1)"
    if [ "$status" != PASS ]; then grep -E -A3 -e '--- FAILED|panicked|^failures:' "$log" | head -40 || true; fi
    [ -n "${OUT:-}" ] && cp "$log" "$OUT/$name.log"
  done
  echo "gpu test binaries: $pass passed, $fail failed, $skipped skipped"
  # With every binary run: whether ptxas serialises any kernel's wgmma (check_wgmma.sh).
  if [ -z "${ONLY:-}" ]; then
    if command -v "${PTXAS:-ptxas}" >/dev/null || [ -x /usr/local/cuda/bin/ptxas ]; then
      BIN="$BIN" scripts/check_wgmma.sh | grep -v "kernel modules" || fail=$((fail + 1))
    else
      echo "wgmma check: SKIPPED (no ptxas; set PTXAS)"
    fi
  fi
  [ "$fail" -eq 0 ]
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
