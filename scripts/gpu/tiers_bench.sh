#!/usr/bin/env bash
# KV tiers on the GPU (issue 30), in one run on the GPU machine:
#   test        tandem-cuda's tests/kv_tiers.rs: GPU blocks evicted to the host tier and restored, greedy
#               output equal to tiers off ($TIERS_TEST_BIN, built elsewhere with
#               `cargo test --release -p tandem-cuda --test kv_tiers --no-run`; default out/kv_tiers)
#   restore     `cuda-bench --kv-restore-tokens 4096` on the 8B shape (random weights made on the GPU):
#               host -> device rate of the tiers' restore path for a 4k-token prefix  -> $OUT/restore.jsonl
#   multiturn   two `tandem serve --device cuda` on an 8B-shaped model with random bf16 weights (MODEL_DIR,
#               made by make_model.py if missing), tiers off and with a host tier, the device pool a quarter
#               of the working set; one `tandem bench --workload multi-turn` sends the same conversations to
#               both                                                        -> $OUT/multiturn.json, metrics-*.txt
# Sizes: CONVS (16) x TURNS (8), DOC (4000)-token shared document, 100-token user turns, 64-token answers;
# POOL (the device KV of each server; default a quarter of every conversation's final context).
# Usage: OUT=dir TANDEM_BIN=path MODEL_DIR=dir MAKE_MODEL=path/make_model.py scripts/gpu/tiers_bench.sh [test] [restore] [multiturn]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$root/out/gpu}"
BIN="${TANDEM_BIN:-$root/out/tandem}"
MODEL_DIR="${MODEL_DIR:-/tmp/model-8b}"
CONVS="${CONVS:-16}" TURNS="${TURNS:-8}" DOC="${DOC:-4000}"
# 128 KiB of bf16 KV per token on the 8B shape (32 layers x K/V x 8 heads x 128).
POOL="${POOL:-$(( CONVS * (DOC + TURNS * 164) * 128 / 1024 / 4 ))MiB}"
what=" ${*:-test restore multiturn} "
# shellcheck source=scripts/gpu/cuda_env.sh
source "$root/scripts/gpu/cuda_env.sh"
mkdir -p "$OUT"
status=0

if [[ "$what" == *" test "* ]]; then
  echo "== KV tiers on the CUDA backend (tests/kv_tiers.rs)"
  "${TIERS_TEST_BIN:-$root/out/kv_tiers}" --nocapture --test-threads 1 || status=1
fi

if [[ "$what" == *" restore "* ]]; then
  echo "== host -> device restore of a 4k-token prefix, 8B shape"
  "$BIN" cuda-bench --shape llama3-8b --batches 0 --prefill 0 --kv-restore-tokens 4096 \
    --out "$OUT/restore.jsonl" || status=1
fi

wait_ready() { # url timeout_s
  for _ in $(seq 1 "$2"); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

if [[ "$what" == *" multiturn "* ]]; then
  if [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "== making the 8B-shaped model in $MODEL_DIR"
    python3 "${MAKE_MODEL:-$root/scripts/gpu/make_model.py}" "$MODEL_DIR" 8b || exit 1
  fi
  echo "== multi-turn, $CONVS x $TURNS, $DOC-token document, device pool $POOL each"
  common=(serve "$MODEL_DIR" --device cuda --host 127.0.0.1 --kv-cache-memory "$POOL" --max-num-seqs 64)
  "$BIN" "${common[@]}" --port 18101 >"$OUT/serve-off.log" 2>&1 &
  off=$!
  "$BIN" "${common[@]}" --port 18102 --kv-offload-host 32GiB >"$OUT/serve-on.log" 2>&1 &
  on=$!
  if wait_ready http://127.0.0.1:18101 300 && wait_ready http://127.0.0.1:18102 300; then
    timeout 1200 "$BIN" bench --workload multi-turn --tokenizer "$MODEL_DIR" --no-progress \
      --endpoint on=http://127.0.0.1:18102 --endpoint off=http://127.0.0.1:18101 \
      --conversations "$CONVS" --turns "$TURNS" --doc-len "$DOC" --user-len 100 --answer-len 64 \
      --output "$OUT/multiturn.json" || status=1
    curl -s http://127.0.0.1:18101/metrics >"$OUT/metrics-off.txt"
    curl -s http://127.0.0.1:18102/metrics >"$OUT/metrics-on.txt"
  else
    echo "a server did not start"
    tail -20 "$OUT/serve-off.log" "$OUT/serve-on.log"
    status=1
  fi
  kill "$off" "$on" 2>/dev/null
  wait 2>/dev/null
fi
exit $status
