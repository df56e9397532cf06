#!/usr/bin/env bash
# Gemma 3 270M (scripts/fetch-model.sh gemma3): one 4,096-token prompt through 1P1D on loopback, then the
# same prompt colocated. Prints both completions (equal when the windowed pull is right) and the KV bytes the
# decode worker pulled (tandem:kv_transfer_bytes_total), next to what pulling every layer's blocks would move.
# Usage: scripts/gemma3-pd-kv-bytes.sh [tcp|shm]   (BIN=path/to/tandem, default target/release/tandem)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${BIN:-$root/target/release/tandem}"
transport="${1:-tcp}"
model="$root/models/gemma-3-270m-q4_k_m.gguf"
[ -f "$model" ] || bash "$root/scripts/fetch-model.sh" gemma3 >/dev/null
port="${PORT:-8391}"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
head="model: $model
server: {host: 127.0.0.1, port: $port}
engine: {block_size: 16, kv_cache_memory: 512MiB, threads: 1, max_model_len: 8192}"
printf '%s\ndeployment:\n  mode: pd\n  prefill: {replicas: 1}\n  decode: {replicas: 1}\n  kv_transfer: {transport: %s}\n' \
  "$head" "$transport" >"$work/pd.yaml"
printf '%s\ndeployment: {mode: colocated}\n' "$head" >"$work/colocated.yaml"
for mode in pd colocated; do
  "$bin" serve --config "$work/$mode.yaml" >"$work/$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 1; done
  PORT="$port" MODE="$mode" python3 - <<'PY'
import json, os, time, urllib.request
ids = [2] + [(i * 7919) % 200000 + 1000 for i in range(4095)]
body = json.dumps({"model": "gemma-3-270m-q4_k_m", "prompt": ids, "max_tokens": 4, "temperature": 0}).encode()
url = f"http://127.0.0.1:{os.environ['PORT']}/v1/completions"
t = time.time()
r = json.load(urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=600))
print(f"{os.environ['MODE']}: {r['choices'][0]['text']!r}, {r['usage']['prompt_tokens']} prompt tokens, {time.time() - t:.1f} s")
PY
  if [ "$mode" = pd ]; then
    pulled="$(curl -s "localhost:$port/metrics" | awk '$1 == "tandem:kv_transfer_bytes_total" {print $2}')"
    # Every layer's blocks: 18 layers x 256 blocks x (K and V of 1 kv head x 16 slots x 256 dims x f32).
    all=$((18 * 256 * 2 * 16 * 256 * 4))
    echo "KV pulled: $pulled bytes; all layers' blocks would be $all bytes"
  fi
  kill "$pid"
  wait "$pid" 2>/dev/null || true
done
