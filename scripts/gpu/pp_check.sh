#!/usr/bin/env bash
# Pipeline stages on CUDA (issue 14), PP=2 as two processes on the one GPU against PP=1, in one run:
#   tiny     check.py's tiny random Llama (4 layers): greedy tokens of PP=2 == PP=1 (prompts of 1 to 700 tokens)
#   8b       the 8B shape (random bf16 weights, MODEL_DIR made by make_model.py if missing): greedy PP=2 == PP=1,
#            then output throughput at c64 (1,024 prompt / 128 output tokens) for PP=1 and PP=2 with
#            micro-batches 1 (the default on one GPU) and 2, and PP=1's TTFT at c1
#   pd       1P1D over tcp whose decode worker is a 2-stage pipeline, on the tiny model and the 8B shape:
#            greedy == the PP=1 colocated greedy above; TTFT at c1 (1,024 tokens) against colocated PP=1
# Results: $OUT/pp_bench.jsonl (one `tandem bench` summary per run, tagged), $OUT/pp_check.txt (PASS/FAIL
# lines and the throughput ratios), and the serve logs.
# Usage: OUT=dir TANDEM_BIN=path MODEL_DIR=dir MAKE_MODEL=path/make_model.py scripts/gpu/pp_check.sh [tiny] [8b] [pd]
set -uo pipefail
gpu="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$gpu/../../out/gpu}"
BIN="${TANDEM_BIN:-$gpu/../../out/tandem}"
MODEL_DIR="${MODEL_DIR:-/tmp/model-8b}"
TINY_DIR="${TINY_DIR:-/tmp/model-tiny}"
C64_PROMPTS="${C64_PROMPTS:-192}"
what=" ${*:-tiny 8b pd} "
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/gpu/cuda_env.sh
source "$gpu/cuda_env.sh"
mkdir -p "$OUT"
work=/tmp/pp_check
mkdir -p "$work"
: >"$OUT/pp_bench.jsonl"
: >"$OUT/pp_check.txt"
say() { echo "$*" | tee -a "$OUT/pp_check.txt"; }

serve_pid=""
serve() { # name model yaml-lines
  printf 'model: %s\nserver: {host: 127.0.0.1, port: 8000}\n%s\n' "$2" "$3" >"$work/$1.yaml"
  "$BIN" serve --config "$work/$1.yaml" >"$OUT/serve-$1.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && return 0
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 1
  done
  say "FAIL server $1 did not start"
  tail -20 "$OUT/serve-$1.log"
  return 1
}
stop() { # the server started last, and with it its workers and stages
  [ -n "$serve_pid" ] || return 0
  kill "$serve_pid" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
  kill -9 "$serve_pid" 2>/dev/null
  serve_pid=""
  sleep 2
}

# Greedy completions of fixed token prompts, one request at a time (so every step has the same batch);
# with logprobs (logits to the host sampler) when logprobs is 1, else drawn on the GPU.
greedy() { # name vocab logprobs lens...
  local name="$1" vocab="$2" lp="$3"
  shift 3
  python3 - "$work/greedy-$name.json" "$vocab" "$lp" "$@" <<'PY'
import json, sys, urllib.request
path, vocab, lp, lens = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", [int(n) for n in sys.argv[4:]]
base = "http://127.0.0.1:8000/v1"
model = json.load(urllib.request.urlopen(base + "/models", timeout=30))["data"][0]["id"]
out = []
for n in lens:
    prompt = [(i * 7919 + n) % (vocab - 20) + 10 for i in range(n)]
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    if lp:
        body["logprobs"] = 1
    body = json.dumps(body).encode()
    req = urllib.request.Request(base + "/completions", body, {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=300))
    c = r["choices"][0]
    out.append([c["text"], c["logprobs"]["tokens"] if lp else None])
json.dump(out, open(path, "w"))
print(path, "greedy text lengths", [len(t[0]) for t in out])
PY
}
same() { # label a b
  if [ -s "$work/greedy-$2.json" ] && cmp -s "$work/greedy-$2.json" "$work/greedy-$3.json"; then
    say "PASS $1"
  else
    say "FAIL $1"
  fi
}

bench() { # label extra-args...
  local label="$1"
  shift
  timeout 400 "$BIN" bench --base-url http://127.0.0.1:8000 --tokenizer "$MODEL_DIR" --prompt-format tokens \
    --no-progress --output "$work/$label.json" "$@" >"$work/$label.log" 2>&1 ||
    { say "FAIL bench $label"; tail -5 "$work/$label.log"; }
  [ -f "$work/$label.json" ] && python3 - "$label" "$work/$label.json" <<'PY' | tee -a "$OUT/pp_bench.jsonl"
import json, sys
label, path = sys.argv[1], sys.argv[2]
for r in json.load(open(path))["runs"]:
    print(json.dumps({"label": label, "started_at": r["started_at"], "summary": r["summary"]}))
PY
}
c64() { bench "$1" --input-len 1024 --output-len 128 --num-prompts "$C64_PROMPTS" --max-concurrency 64 --warmup 8; }
ttft() { bench "$1" --input-len 1024 --output-len 128 --num-prompts 12 --max-concurrency 1 --warmup 2; }

engine="max_num_seqs: 256, max_waiting: 4096"
tiny_lens="1 17 300 700"
big_lens="1024 17 2000"
if [[ "$what" == *" tiny "* || "$what" == *" pd "* ]] && [ ! -f "$TINY_DIR/config.json" ]; then
  python3 - "$TINY_DIR" "$gpu" <<'PY' || exit 1
import sys
sys.path.insert(0, sys.argv[2])
from check import build_model
build_model(sys.argv[1])
PY
fi
if [[ "$what" == *" 8b "* || "$what" == *" pd "* ]] && [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "== making the 8B-shaped model in $MODEL_DIR"
  python3 "${MAKE_MODEL:-$gpu/make_model.py}" "$MODEL_DIR" 8b || exit 1
fi

if [[ "$what" == *" tiny "* || "$what" == *" pd "* ]]; then
  echo "== tiny model: PP=1 and PP=2 greedy"
  serve tiny1 "$TINY_DIR" "engine: {device: cuda, kv_cache_memory: 2GiB, $engine}" && greedy tiny1 1024 1 $tiny_lens
  stop
  serve tiny2 "$TINY_DIR" "engine: {device: cuda, kv_cache_memory: 2GiB, $engine, pipeline_parallel_size: 2}" &&
    greedy tiny2 1024 1 $tiny_lens
  stop
  same "tiny PP=2 greedy == PP=1 greedy" tiny1 tiny2
fi
if [[ "$what" == *" 8b "* ]]; then
  echo "== 8B shape: PP=1, PP=2 (micro-batches 1 and 2)"
  serve big1 "$MODEL_DIR" "engine: {device: cuda, kv_cache_memory: 48GiB, $engine}" &&
    { greedy big1 128256 0 $big_lens; c64 pp1-c64; ttft pp1-ttft-1k; }
  stop
  # Micro-batches left at their default: 1 when every stage shares one GPU.
  serve big2 "$MODEL_DIR" "engine: {device: cuda, kv_cache_memory: 48GiB, $engine, pipeline_parallel_size: 2}" &&
    { greedy big2 128256 0 $big_lens; c64 pp2-mb1-c64; }
  stop
  same "8B PP=2 greedy == PP=1 greedy" big1 big2
  serve big2mb2 "$MODEL_DIR" "engine: {device: cuda, kv_cache_memory: 48GiB, $engine, pipeline_parallel_size: 2, pipeline_micro_batches: 2}" &&
    c64 pp2-mb2-c64
  stop
fi
if [[ "$what" == *" pd "* ]]; then
  pd_yaml() { # kv budget per worker
    printf '%s\n' "engine: {device: cuda, kv_cache_memory: $1, $engine}" "deployment:" "  mode: pd" \
      "  decode: {replicas: 1, engine: {pipeline_parallel_size: 2}}" "  kv_transfer: {transport: tcp}"
  }
  echo "== 1P1D, decode a 2-stage pipeline"
  serve pdtiny "$TINY_DIR" "$(pd_yaml 1GiB)" && greedy pdtiny 1024 1 $tiny_lens
  stop
  same "tiny P/D (pipelined decode) greedy == colocated greedy" tiny1 pdtiny
  if [ -s "$work/greedy-big1.json" ]; then
    serve pdbig "$MODEL_DIR" "$(pd_yaml 24GiB)" && { greedy pdbig 128256 0 $big_lens; ttft pd-pp2-ttft-1k; }
    stop
    same "8B P/D (pipelined decode) greedy == colocated greedy" big1 pdbig
  fi
fi
python3 - "$OUT/pp_bench.jsonl" <<'PY' | tee -a "$OUT/pp_check.txt"
import json, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        rows[r["label"]] = r["summary"]
base = rows.get("pp1-c64", {}).get("output_throughput")
for label, s in rows.items():
    t, ttft, itl = s.get("output_throughput"), s.get("ttft_ms", {}), s.get("itl_ms", {})
    ratio = f" ({t / base:.2f}x PP=1)" if base and t else ""
    print(f"{label}: output {t:,.1f} tok/s{ratio}, TTFT p50 {ttft.get('median')} ms, "
          f"ITL p50 {itl.get('median')} ms, failed {s.get('failed')}")
PY
