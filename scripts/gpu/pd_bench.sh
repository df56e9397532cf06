#!/usr/bin/env bash
# P/D against colocated serving on one GPU, side by side in one run (issue 14's targets): an 8B-shaped
# model with random bf16 weights (MODEL_DIR, made by make_model.py if missing), served colocated and as
# 1P1D (both workers on GPU 0, KV over $TRANSPORT), each measured with `tandem bench`:
#   ttft-1k / ttft-4k   TTFT at concurrency 1, 1,024- and 4,096-token prompts (128 out)
#   c64 / c256          output throughput and failures at fixed concurrency, 1,024/128
#   bursty              8 req/s of 256/256 plus 16 x 4,096-token prompts every 5 s
#   leak (only when named)  1,000 requests of 1,024 tokens, every tenth abandoned mid-flight: every worker's
#                       blocks, pins, staging and GPU memory back where they were (scripts/gpu/pd_leak.py)
#   guided (only when named)  colocated decode throughput of regex-guided requests (masked on the GPU) against
#                       unguided ones, 256/256 at concurrency 1 and 64 (issue 17's batch-64 target)
#   pdhand (only when named)  1P1D with the workers started by hand and registering, PREFILL_ENV in the prefill
#                       worker's environment only (e.g. CUDA_MPS_CLIENT_PRIORITY=1 under MPS=1)
#   load (a modifier)   the suites run only c64 and bursty (the two targets one GPU shared by two processes misses)
# MPS=1 runs everything under an NVIDIA MPS control daemon started for the run (and stopped after it), so
# that the two P/D processes share the GPU's SMs at once instead of taking turns in time slices.
# PREFILL_SM=N (with MPS=1) holds the prefill worker to N% of the SMs (deployment.prefill.mps_thread_percentage).
# DECODE_GPU=N puts the 1P1D decode worker on GPU N (deployment.decode.cuda_devices), prefill staying on GPU 0.
# Results: $OUT/pd_bench.jsonl (one `tandem bench --output` row per run, tagged) and $OUT/pd_summary.md;
# with TRANSPORT=nixl or auto also $OUT/kv_rates.txt: the rate of every large pull, from the workers' debug lines
# (NIXL: first layer announced to last READ done; tcp: the whole pull).
# Usage: OUT=dir TANDEM_BIN=path MODEL_DIR=dir MAKE_MODEL=path/make_model.py [TRANSPORT=shm|tcp|nixl|auto \
#          NIXL_LIB=unpacked-wheel-or-subset TCP_STREAMS=n MPS=1 PREFILL_SM=n] scripts/gpu/pd_bench.sh [colocated] [tcp] [pd] [leak]
#          [guided] [quick|load]
# (MAKE_MODEL: the workplace's shared gpu/make_model.py, needed only when MODEL_DIR has no model yet;
# NIXL_LIB: what scripts/gpu/nixl_subset.sh copies out of the nixl-cu13 wheel.)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$root/out/gpu}"
BIN="${TANDEM_BIN:-$root/out/tandem}"
MODEL_DIR="${MODEL_DIR:-/tmp/model-8b}"
TRANSPORT="${TRANSPORT:-shm}"
nixl_opt=""
case "$TRANSPORT" in
  nixl | auto) nixl_opt=", nixl_library: ${NIXL_LIB:?TRANSPORT=$TRANSPORT needs NIXL_LIB}" ;;
esac
TCP_STREAMS="${TCP_STREAMS:-4}"
# The workers' per-pull debug lines feed kv_rates.txt.
export RUST_LOG="${RUST_LOG:-info,tandem_kv::transport=debug}"
# One cluster token for every head and worker started here, and for pd_leak.py's calls to the workers.
export TANDEM_CLUSTER_TOKEN="${TANDEM_CLUSTER_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
what=" ${*:-colocated pd} "
# shellcheck source=scripts/gpu/cuda_env.sh
source "$root/scripts/gpu/cuda_env.sh"
mkdir -p "$OUT"
work=/tmp/pd_bench
mkdir -p "$work"

if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "== making the 8B-shaped model in $MODEL_DIR"
  python3 "${MAKE_MODEL:-$root/scripts/gpu/make_model.py}" "$MODEL_DIR" 8b || exit 1
fi

wait_ready() { # url timeout_s
  for _ in $(seq 1 "$2"); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

bench() { # label extra-args...
  local label="$1"
  shift
  echo "-- $label: $*"
  timeout 300 "$BIN" bench --base-url http://127.0.0.1:8000 --tokenizer "$MODEL_DIR" --prompt-format tokens \
    --no-progress --output "$work/$label.json" "$@" >"$work/$label.log" 2>&1 ||
    { echo "bench $label failed"; tail -5 "$work/$label.log"; }
  if [ -f "$work/$label.json" ]; then
    python3 - "$label" "$work/$label.json" <<'PY' | tee -a "$OUT/pd_bench.jsonl"
import json, sys
label, path = sys.argv[1], sys.argv[2]
for r in json.load(open(path))["runs"]:
    print(json.dumps({"label": label, "started_at": r["started_at"], "summary": r["summary"]}))
PY
  fi
}

# Greedy completions of fixed token prompts (1,024 and 2,000 tokens, 32 out): P/D must equal colocated.
greedy() { # mode
  python3 - "$1" "$work/greedy-$1.json" <<'PY'
import json, sys, urllib.request
mode, path = sys.argv[1], sys.argv[2]
base = "http://127.0.0.1:8000/v1"
model = json.load(urllib.request.urlopen(base + "/models", timeout=30))["data"][0]["id"]
out = []
for n in (1024, 2000, 17, 3000):
    prompt = [(i * 7919 + n) % 120000 + 10 for i in range(n)]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 1}).encode()
    req = urllib.request.Request(base + "/completions", body, {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=120))
    out.append(r["choices"][0]["logprobs"]["tokens"])
json.dump(out, open(path, "w"))
print(mode, "greedy lengths", [len(t) for t in out])
PY
}

run_suite() { # mode
  local m="$1"
  if [[ "$what" == *" load "* ]]; then
    bench "$m-c64" --input-len 1024 --output-len 128 --num-prompts 256 --max-concurrency 64 --warmup 8
    bench "$m-bursty" --workload bursty --input-len 256 --output-len 256 --request-rate 8 --num-prompts 120 \
      --burst-input-len 4096 --burst-output-len 16 --burst-size 16 --burst-interval 5
    return
  fi
  greedy "$m"
  bench "$m-ttft-1k" --input-len 1024 --output-len 128 --num-prompts 12 --max-concurrency 1 --warmup 2
  bench "$m-ttft-4k" --input-len 4096 --output-len 128 --num-prompts 8 --max-concurrency 1 --warmup 1
  if [[ "$what" != *" quick "* ]]; then
    bench "$m-c64" --input-len 1024 --output-len 128 --num-prompts 256 --max-concurrency 64 --warmup 8
    bench "$m-c256" --input-len 1024 --output-len 128 --num-prompts 384 --max-concurrency 256 --warmup 8
    bench "$m-bursty" --workload bursty --input-len 256 --output-len 256 --request-rate 8 --num-prompts 120 \
      --burst-input-len 4096 --burst-output-len 16 --burst-size 16 --burst-interval 5
  fi
}

common="
model: $MODEL_DIR
server: {host: 127.0.0.1, port: 8000}
"
serve() { # name yaml
  printf '%s\n%s\n' "$common" "$2" >"$work/$1.yaml"
  "$BIN" serve --config "$work/$1.yaml" >"$OUT/serve-$1.log" 2>&1 &
  echo $! >"$work/$1.pid"
  if ! wait_ready http://127.0.0.1:8000 240; then
    echo "server $1 did not start"; tail -20 "$OUT/serve-$1.log"; return 1
  fi
}
stop() { kill "$(cat "$work/$1.pid")" 2>/dev/null; sleep 3; pkill -f "tandem (serve|worker)" 2>/dev/null; sleep 1; }

pd_yaml() { # kv_transfer keys: 1P1D, both workers on GPU 0 with half the colocated KV each
  printf '%s\n' "engine: {device: cuda, kv_cache_memory: 24GiB, max_num_seqs: 256, max_waiting: 4096}" \
    "deployment:" "  mode: pd" "  kv_transfer: {$1}"
  [ -n "${PREFILL_SM:-}" ] && printf '%s\n' "  prefill: {mps_thread_percentage: $PREFILL_SM}"
  [ -n "${DECODE_GPU:-}" ] && printf '%s\n' "  decode: {cuda_devices: [$DECODE_GPU]}"
  true
}

: >"$OUT/pd_bench.jsonl"
if [ "${MPS:-0}" = 1 ]; then
  # The daemon's pipe and log directories are the run's own; every process started below inherits them.
  export CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "== MPS control daemon started"
    trap 'echo quit | nvidia-cuda-mps-control; echo "== MPS control daemon stopped"' EXIT
  else
    echo "MPS control daemon did not start; running without it"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
if [[ "$what" == *" guided "* ]]; then
  echo "== colocated: regex-guided against unguided decode (masks applied on the GPU)"
  # make_model.py's word-level vocabulary has no JSON punctuation; this constraint allows the words that
  # start with a-m (about half the vocabulary) and never completes, so every request makes 256 tokens.
  fmt='{"type":"regex","regex":"( [a-m][a-z]*)+"}'
  if serve guided "engine: {device: cuda, kv_cache_memory: 48GiB, max_num_seqs: 256, max_waiting: 4096}"; then
    for c in 1 64; do
      n=$((c == 1 ? 8 : 256))
      bench "unguided-c$c" --input-len 256 --output-len 256 --num-prompts $n --max-concurrency $c --warmup 2
      bench "guided-c$c" --input-len 256 --output-len 256 --num-prompts $n --max-concurrency $c --warmup 2 \
        --response-format "$fmt"
    done
  fi
  grep -iE "error|warn" "$OUT/serve-guided.log" | tail -5
  stop guided
fi
if [[ "$what" == *" colocated "* ]]; then
  echo "== colocated"
  serve colocated "engine: {device: cuda, kv_cache_memory: 48GiB, max_num_seqs: 256, max_waiting: 4096}" &&
    run_suite colocated
  stop colocated
fi
if [[ "$what" == *" tcp "* ]]; then
  echo "== 1P1D over tcp, $TCP_STREAMS connections per pull (greedy and TTFT only)"
  serve pdtcp "$(pd_yaml "transport: tcp, streams: $TCP_STREAMS")" && greedy pdtcp && bench pdtcp-ttft-4k --input-len 4096 --output-len 16 --num-prompts 6 --max-concurrency 1 --warmup 1
  stop pdtcp
  cmp -s "$work/greedy-colocated.json" "$work/greedy-pdtcp.json" && echo "PASS P/D over tcp greedy == colocated" || echo "FAIL P/D over tcp greedy differs (or missing)"
fi
if [[ "$what" == *" pd "* ]]; then
  echo "== 1P1D over $TRANSPORT"
  serve pd "$(pd_yaml "transport: $TRANSPORT$nixl_opt, staging_mib: 8192")" && run_suite pd
  curl -s http://127.0.0.1:8000/metrics | grep -E "^tandem:kv_transfer" >"$OUT/pd_metrics.txt"
  grep -iE "error|warn" "$OUT/serve-pd.log" | tail -5
  stop pd
fi
if [[ "$what" == *" pdhand "* ]]; then
  # As on two hosts: a head with no workers of its own, and the two workers started here with --register,
  # so each has an environment of its own: PREFILL_ENV (e.g. CUDA_MPS_CLIENT_PRIORITY=1) goes to prefill only.
  echo "== 1P1D over $TRANSPORT, workers started by hand; prefill environment: ${PREFILL_ENV:-(none)}"
  printf '%s\n%s\n%s\n' "$common" "$(pd_yaml "transport: $TRANSPORT$nixl_opt, staging_mib: 8192")" \
    "  prefill: {replicas: 0}" >"$work/pdhand.yaml"
  sed -i 's/^  prefill: {replicas: 0}$/  prefill: {replicas: 0}\n  decode: {replicas: 0}/' "$work/pdhand.yaml"
  "$BIN" serve --config "$work/pdhand.yaml" >"$OUT/serve-pdhand.log" 2>&1 &
  echo $! >"$work/pdhand.pid"
  sleep 2
  hand_worker() { # role env...
    local role="$1"
    shift
    env "$@" "$BIN" worker --role "$role" --model "$MODEL_DIR" --device cuda --host 127.0.0.1 --port 0 \
      --kv-cache-memory 24GiB --max-num-seqs 256 --max-waiting 4096 --transport "$TRANSPORT" \
      ${NIXL_LIB:+--nixl-library "$NIXL_LIB"} --staging-mib 8192 --register http://127.0.0.1:8000 \
      >"$OUT/worker-$role.log" 2>&1 &
  }
  # shellcheck disable=SC2086
  hand_worker prefill ${PREFILL_ENV:-}
  hand_worker decode
  if wait_ready http://127.0.0.1:8000 240; then run_suite pdhand; else echo "pdhand did not start"; tail -5 "$OUT"/worker-*.log; fi
  stop pdhand
fi
if [[ "$what" == *" leak "* ]]; then
  echo "== 1P1D over $TRANSPORT: 1,000 requests, a tenth abandoned mid-flight, nothing leaked"
  serve pdleak "$(pd_yaml "transport: $TRANSPORT$nixl_opt, staging_mib: 8192")" &&
    python3 "$root/scripts/gpu/pd_leak.py" --requests 1000 --concurrency 32 --out "$OUT/pd_leak.json"
  stop pdleak
fi
if [ -f "$work/greedy-colocated.json" ] && [ -f "$work/greedy-pd.json" ]; then
  if cmp -s "$work/greedy-colocated.json" "$work/greedy-pd.json"; then echo "PASS P/D greedy == colocated greedy (4 prompts, 32 tokens)" | tee -a "$OUT/pd_bench.jsonl"
  else echo "FAIL P/D greedy differs from colocated" | tee -a "$OUT/pd_bench.jsonl"; fi
fi
# Rates of pulls of at least 256 MiB (the 4,096-token prompts: 512 MiB of 8B KV), per log.
python3 - "$OUT" <<'PY' | tee "$OUT/kv_rates.txt"
import glob, re, statistics, sys
unit = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
for log in sorted(glob.glob(sys.argv[1] + "/serve-*.log")):
    nixl, pulls = [], []
    for line in open(log, errors="replace"):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        b = re.search(r"\bbytes=(\d+)", line)
        if not b or int(b.group(1)) < 256 << 20:
            continue
        n = int(b.group(1))
        if "NIXL READs done" in line:
            g = re.search(r"gbps=([\d.]+)", line)
            nixl.append((float(g.group(1)), "in_place=true" in line))
        elif "KV pull done" in line:
            e = re.search(r"elapsed=([\d.]+)(s|ms|µs|us|ns)", line)
            if e:
                pulls.append(n / (float(e.group(1)) * unit[e.group(2)]) / 1e9)
    name = log.rsplit("/", 1)[-1]
    if nixl:
        rates = [g for g, _ in nixl]
        print(f"{name}: {len(nixl)} NIXL READ sets of >=256 MiB ({sum(p for _, p in nixl)} in place): "
              f"median {statistics.median(rates):.1f} GB/s, min {min(rates):.1f}, max {max(rates):.1f}")
    if pulls:
        print(f"{name}: {len(pulls)} whole pulls of >=256 MiB: median {statistics.median(pulls):.1f} GB/s, "
              f"min {min(pulls):.1f}, max {max(pulls):.1f}")
PY
python3 "$root/scripts/gpu/pd_summary.py" "$OUT/pd_bench.jsonl" | tee "$OUT/pd_summary.md"
