#!/usr/bin/env bash
# Engine speed of tandem and llama.cpp on the same GGUF, same machine, same run; prints both and the ratios.
# Usage: scripts/bench-engine-vs-llamacpp.sh [MODEL.gguf] [THREADS]
# Needs .venv-llamacpp (scripts/llamacpp-venv.sh builds it once; ~10–40 min on 2 cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
threads="${2:-$(nproc)}"
bash scripts/fetch-model.sh >/dev/null
bash scripts/llamacpp-venv.sh
cargo build --release -p tandem --quiet
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg)"
tandem_json="$(target/release/tandem bench-engine "$model" --threads "$threads" --json 2>/dev/null)"
llama_json="$(.venv-llamacpp/bin/python scripts/llamacpp-speed.py "$model" "$threads")"
python3 - "$tandem_json" "$llama_json" <<'PY'
import json, sys
t, l = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rows = [
    ("single-stream decode (tok/s)", t["single_stream_decode_tok_s"], l["single_stream_decode_tok_s"], 1.2),
    ("prefill, 512-token prompt (tok/s)", t["prefill_tok_s"], l["prefill_tok_s"], 1.5),
    ("16-seq aggregate decode vs llama.cpp single stream (tok/s)", t["concurrent_decode_tok_s"], l["single_stream_decode_tok_s"], 3.0),
]
print(f"{'figure':58} {'tandem':>9} {'llama.cpp':>10} {'ratio':>7} {'target':>7}")
for name, a, b, target in rows:
    print(f"{name:58} {a:9.1f} {b:10.1f} {a / b:6.2f}x {target:6.1f}x")
PY
