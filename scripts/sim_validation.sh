#!/usr/bin/env bash
# Predicted (tandem sim) against measured (tandem bench) on this machine: a colocated server, a 1P1D and
# a 1P2D deployment (one thread per worker), each on a steady, a bursty and a shared-prefix workload; one
# profile (tandem profile, one thread) made first. Prints one Markdown table; leaves nothing running.
#   scripts/sim_validation.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/tandem}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${1:-out/sim-validation}
PORT=${PORT:-18461}
mkdir -p "$OUT"
export TANDEM_CLUSTER_TOKEN=${TANDEM_CLUSTER_TOKEN:-sim-validation-token}

"$BIN" profile "$MODEL" --threads 1 --kv-cache-mib 256 --repeats 3 -o "$OUT/profile.json"

declare -A WL=(
  [steady]="--workload random --num-prompts 24 --input-len 128 --output-len 32 --request-rate 2"
  [bursty]="--workload bursty --num-prompts 16 --input-len 32 --output-len 16 --request-rate 2 --burst-size 4 --burst-input-len 256 --burst-output-len 8 --burst-interval 3"
  [shared_prefix]="--workload shared-prefix --num-prompts 20 --prefix-len 256 --num-prefixes 2 --input-len 32 --output-len 16 --request-rate 2"
)

wait_healthy() {
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 0.5
  done
  echo "server on $PORT did not come up" >&2
  return 1
}

for topo in ${TOPOLOGIES:-colocated 1p1d 1p2d}; do
  if [ "$topo" = colocated ]; then
    "$BIN" serve "$MODEL" --host 127.0.0.1 --port "$PORT" --threads 1 --kv-cache-memory 256MiB \
      >"$OUT/serve-$topo.log" 2>&1 &
    SIMTOPO=""
  else
    decode="${topo#1p}"
    decode="${decode%d}"
    cat >"$OUT/pd.yaml" <<YAML
model: $MODEL
server: {host: 127.0.0.1, port: $PORT}
engine: {block_size: 16, kv_cache_memory: 256MiB}
deployment:
  mode: pd
  prefill: {replicas: 1, engine: {threads: 1}}
  decode: {replicas: $decode, engine: {threads: 1}}
  kv_transfer: {transport: tcp}
YAML
    "$BIN" serve --config "$OUT/pd.yaml" >"$OUT/serve-$topo.log" 2>&1 &
    SIMTOPO="--prefill 1 --decode $decode"
  fi
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  wait_healthy
  for w in steady bursty shared_prefix; do
    # shellcheck disable=SC2086
    "$BIN" bench --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" ${WL[$w]} --seed 7 \
      --warmup 1 --prompt-format tokens --no-progress --output "$OUT/bench-$topo-$w.json" >/dev/null
    # shellcheck disable=SC2086
    "$BIN" sim --profile "$OUT/profile.json" --model "$MODEL" ${WL[$w]} --seed 7 $SIMTOPO --json \
      >"$OUT/sim-$topo-$w.json"
  done
  kill "$SERVER"
  wait "$SERVER" 2>/dev/null || true
  trap - EXIT
done

python3 - "$OUT" ${TOPOLOGIES:-colocated 1p1d 1p2d} <<'PY'
import json, sys, os
out = sys.argv[1]
print("| topology | workload | figure | measured | predicted | error |")
print("|---|---|---|---|---|---|")
for topo in sys.argv[2:]:
    for w in ("steady", "bursty", "shared_prefix"):
        m = json.load(open(os.path.join(out, f"bench-{topo}-{w}.json")))["runs"][0]["summary"]
        p = json.load(open(os.path.join(out, f"sim-{topo}-{w}.json")))["summary"]
        for name, key, stat in (("TTFT p50 ms", "ttft_ms", "median"), ("TTFT p99 ms", "ttft_ms", "p99"),
                                ("ITL p50 ms", "itl_ms", "median"), ("ITL p99 ms", "itl_ms", "p99"),
                                ("output tok/s", "output_throughput", None)):
            a = m[key][stat] if stat else m[key]
            b = p[key][stat] if stat else p[key]
            err = (b - a) / a * 100 if a else float("nan")
            print(f"| {topo} | {w} | {name} | {a:.1f} | {b:.1f} | {err:+.0f}% |")
PY
