#!/usr/bin/env bash
# tandem vs llama.cpp's own llama-server on the same model and machine, measured by `tandem bench` in one
# run: llama-server (--parallel 16, continuous batching), tandem colocated (examples/colocated.yaml) and
# tandem 1P1D (examples/pd.yaml), one server at a time, each given the same concurrency sweep of random
# prompts and the same bursty workload (identical prompts: same seeds). Writes every result file, one
# table (results.md) and the charts into $OUT (default out/compare/) and prints the table with the two
# targets of issue 5.
#
# Usage: scripts/peers/compare-peers.sh [MODEL.gguf]
# Knobs (environment): OUT, CONCURRENCIES (1,4,16), NUM_PROMPTS (32), INPUT_LEN (128), OUTPUT_LEN (64),
# BURSTY_PROMPTS (64), BURSTY_RATE (4), BURST_SIZE (4), BURST_INPUT_LEN (1024), BURST_INTERVAL (6),
# PEERS (llama-server,colocated,pd), LLAMA_THREADS (nproc), TANDEM_BIN (default: target/release/tandem,
# built if missing). With PEERS a subset, the table still includes the other peers' latest results in OUT.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
out="${OUT:-out/compare}"
concurrencies="${CONCURRENCIES:-1,4,16}"
num_prompts="${NUM_PROMPTS:-32}"
input_len="${INPUT_LEN:-128}"
output_len="${OUTPUT_LEN:-64}"
bursty_prompts="${BURSTY_PROMPTS:-64}"
bursty_rate="${BURSTY_RATE:-4}"
burst_size="${BURST_SIZE:-4}"
burst_input_len="${BURST_INPUT_LEN:-1024}"
burst_interval="${BURST_INTERVAL:-6}"
peers="${PEERS:-llama-server,colocated,pd}"
parallel=16
slot_ctx=1024
llama_extra=()
# llama.cpp's AMX matmul (chosen by -DGGML_NATIVE=ON on CPUs with AMX) crashes in this sandbox's kernel;
# --no-repack turns off the extra buffer types it runs through.
if grep -qw amx_tile /proc/cpuinfo; then
  llama_extra+=(--no-repack)
fi

bash scripts/fetch-model.sh >/dev/null
tandem="${TANDEM_BIN:-target/release/tandem}"
if [ -z "${TANDEM_BIN:-}" ]; then
  cargo build --release -p tandem --quiet
fi
llama_server=""
if [[ ",$peers," == *",llama-server,"* ]]; then
  llama_server="$(bash scripts/peers/build-llama-server.sh | tail -n1)"
fi
mkdir -p "$out"

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

wait_healthy() { # url log
  for _ in $(seq 1 600); do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      echo "server exited during startup; log $2:" >&2
      tail -n 30 "$2" >&2
      return 1
    fi
    if curl -fsS "$1/health" >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.5
  done
  echo "server at $1 not healthy after 300 s" >&2
  return 1
}

start_peer() { # name port
  local log="$out/$1.log"
  case "$1" in
    llama-server)
      "$llama_server" -m "$model" --host 127.0.0.1 --port "$2" --parallel "$parallel" \
        -c "$((parallel * slot_ctx))" --cont-batching -t "${LLAMA_THREADS:-$(nproc)}" "${llama_extra[@]}" >"$log" 2>&1 &
      ;;
    colocated)
      "$tandem" serve "$model" --config examples/colocated.yaml --port "$2" >"$log" 2>&1 &
      ;;
    pd)
      "$tandem" serve "$model" --config examples/pd.yaml --port "$2" >"$log" 2>&1 &
      ;;
    *)
      echo "unknown peer $1 (llama-server, colocated, pd)" >&2
      return 1
      ;;
  esac
  server_pid=$!
  wait_healthy "http://127.0.0.1:$2" "$log"
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
common=(--tokenizer "$model" --prompt-format tokens --no-progress --warmup 2)
IFS=',' read -r -a peer_list <<<"$peers"
for name in "${peer_list[@]}"; do
  rm -f "$out/$name"-*.json "$out/$name".log
  port="$(free_port)"
  echo "==> $name on port $port"
  start_peer "$name" "$port"
  url="http://127.0.0.1:$port"
  "$tandem" bench --endpoint "$name=$url" "${common[@]}" --concurrencies "$concurrencies" \
    --num-prompts "$num_prompts" --input-len "$input_len" --output-len "$output_len" --seed 1 \
    --output "$out/$name-sweep.json" >"$out/$name-sweep.txt"
  "$tandem" bench --endpoint "$name=$url" "${common[@]}" --workload bursty \
    --num-prompts "$bursty_prompts" --request-rate "$bursty_rate" --input-len 64 --output-len 32 \
    --burst-size "$burst_size" --burst-input-len "$burst_input_len" --burst-output-len 16 \
    --burst-interval "$burst_interval" --seed 100 --output "$out/$name-bursty.json" >"$out/$name-bursty.txt"
  stop_server
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Every peer's latest results, also those of earlier invocations with another PEERS.
files=()
for name in llama-server colocated pd; do
  for kind in sweep bursty; do
    [ -f "$out/$name-$kind.json" ] && files+=("$out/$name-$kind.json")
  done
done
"$tandem" bench plot "${files[@]}" --out-dir "$out" >/dev/null
python3 - "$out" "${files[@]}" <<'PY' | tee -a "$out/results.md"
import json, sys
out, files = sys.argv[1], sys.argv[2:]
runs = [r for f in files for r in json.load(open(f))["runs"]]
def find(endpoint, kind, conc=None):
    for r in runs:
        c = r["config"]
        if c["endpoint"] == endpoint and c["workload"]["kind"] == kind and (conc is None or c["max_concurrency"] == conc):
            return r["summary"]
    return None
print()
print("| target (issue 5) | measured | met |")
print("|---|---|---|")
llama, colo = find("llama-server", "random", 16), find("colocated", "random", 16)
if llama and colo and llama["output_throughput"] > 0:
    ratio = colo["output_throughput"] / llama["output_throughput"]
    print(f"| colocated ≥ 1.5× llama-server output tok/s at concurrency 16 | {colo['output_throughput']:.1f} vs {llama['output_throughput']:.1f} tok/s = {ratio:.2f}× | {'yes' if ratio >= 1.5 else 'no'} |")
pd, colo_b = find("pd", "bursty"), find("colocated", "bursty")
if pd and colo_b:
    a, b = pd["itl_ms"]["p99"], colo_b["itl_ms"]["p99"]
    print(f"| 1P1D ITL p99 < colocated's, bursty | {a:.1f} vs {b:.1f} ms | {'yes' if a < b else 'no'} |")
PY
echo
cat "$out/results.md"
echo
echo "charts: $out/latency_throughput.png $out/itl_over_time.png"
