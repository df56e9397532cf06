#!/usr/bin/env bash
# `tandem sim` predicted against `tandem bench` measured on one GPU (issue 31): the GPU counterpart of
# scripts/sim_validation.sh, in two steps.
#
# 1. measure (on the device machine; needs only the binary, python3 and the model): `tandem profile
#    --device cuda`, then a colocated server and a 1P1D deployment (two worker processes sharing the one
#    GPU, KV over $TRANSPORT), each driven by `tandem bench` with a bursty and a c64 (64 requests in
#    flight) workload. Writes into $OUT: profile.json, bench-{colocated,1p1d}-{bursty,c64}.json,
#    workloads.env (the flags used, which step 2 reads back) and run.log (this script's log, with the
#    servers' log tails on failure): 7 files. Leaves nothing running.
#      OUT=dir TANDEM_BIN=path/tandem MODEL=model.gguf scripts/gpu/sim_validation.sh measure
#    An H100 takes about 3 minutes with the default SmolLM2-135M and about 6 with an 8B-shaped GGUF
#    (scripts/gpu/random_gguf.py --shape llama-8b --qtype q4_1).
# 2. table (here, on a machine with the same model file): `tandem sim` on the returned profile with the
#    same workloads and topologies (on cuda, 1P1D with `--shared-device`: both workers on the one GPU);
#    prints one Markdown table of predicted against measured TTFT p50/p99, ITL p50/p99 and output
#    throughput, with each error (ok: within 15%).
#      TANDEM_BIN=target/release/tandem scripts/gpu/sim_validation.sh table DIR [MODEL]
#    The model must be the profiled one (the profile records its identity hash); random_gguf.py makes the
#    same file again from the same arguments (its --seed defaults to 0).
#
# Settings (environment; step 1 records them in workloads.env):
#   DEVICE=cuda|cpu (cpu: the same steps on the CPU backend, one thread per worker — how this script is
#     tested on a machine without a GPU), KV_MIB (KV cache per worker, MiB; default 16384 on cuda, 256 on
#     cpu), TRANSPORT=tcp|shm (the 1P1D KV transport), PORT, STEP_TIMEOUT (seconds per profile or bench,
#     default 240), SMALL=1 (tiny workloads, for the CPU test).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mode="${1:-}"

# Prints the Markdown table of the sims (in $1) against the benches (in $1).
table() { # dir
  python3 - "$1" <<'PY'
import json, os, sys
out = sys.argv[1]
prof = json.load(open(os.path.join(out, "profile.json")))
hw = prof["hardware"]
print(f"Profile: {prof['model']['name']} on {hw['name']} ({hw['device']}), {prof['kv_blocks']} KV blocks of "
      f"{prof['block_size']} per worker")
print()
print("| topology | workload | figure | measured | predicted | error | within 15% |")
print("|---|---|---|---|---|---|---|")
for topo in ("colocated", "1p1d"):
    for w in ("bursty", "c64"):
        try:
            m = json.load(open(os.path.join(out, f"bench-{topo}-{w}.json")))["runs"][0]["summary"]
            p = json.load(open(os.path.join(out, f"sim-{topo}-{w}.json")))["summary"]
        except (OSError, KeyError, IndexError, ValueError) as e:
            print(f"| {topo} | {w} | (missing: {e}) | | | | |")
            continue
        for name, key, stat in (("TTFT p50 ms", "ttft_ms", "median"), ("TTFT p99 ms", "ttft_ms", "p99"),
                                ("ITL p50 ms", "itl_ms", "median"), ("ITL p99 ms", "itl_ms", "p99"),
                                ("output tok/s", "output_throughput", None)):
            a = m[key][stat] if stat else m[key]
            b = p[key][stat] if stat else p[key]
            err = (b - a) / a * 100 if a else float("nan")
            ok = "yes" if abs(err) <= 15 else "no"
            print(f"| {topo} | {w} | {name} | {a:.1f} | {b:.1f} | {err:+.0f}% | {ok} |")
PY
}

if [ "$mode" = table ]; then
  dir="${2:?usage: scripts/gpu/sim_validation.sh table DIR [MODEL]}"
  BIN="${TANDEM_BIN:-$root/target/release/tandem}"
  # shellcheck source=/dev/null
  source "$dir/workloads.env"
  model="${3:-$MODEL}"
  sims="$(mktemp -d)"
  trap 'rm -rf "$sims"' EXIT
  cp "$dir"/profile.json "$dir"/bench-*.json "$sims"/ 2>/dev/null || true
  for topo in colocated 1p1d; do
    topo_flags=""
    # The measured 1P1D runs both workers on the one GPU: the sim has their forwards share it (on the
    # CPU each worker has a thread, and a core, of its own).
    shared=""
    [ "$DEVICE" = cuda ] && shared="--shared-device"
    [ "$topo" = 1p1d ] && topo_flags="--prefill 1 --decode 1 --transport $TRANSPORT $shared"
    for w in bursty c64; do
      var="WL_$w"
      # shellcheck disable=SC2086
      "$BIN" sim --profile "$dir/profile.json" --model "$model" ${!var} --seed 7 $topo_flags --json \
        >"$sims/sim-$topo-$w.json"
    done
  done
  table "$sims"
  exit 0
fi

if [ "$mode" != measure ]; then
  echo "usage: scripts/gpu/sim_validation.sh measure | table DIR [MODEL]" >&2
  exit 2
fi

BIN="${TANDEM_BIN:?TANDEM_BIN: the tandem binary (built with --features cuda for DEVICE=cuda)}"
MODEL="${MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${OUT:?OUT: where the profile and the bench results go}"
DEVICE="${DEVICE:-cuda}"
TRANSPORT="${TRANSPORT:-tcp}"
PORT="${PORT:-18471}"
# Seconds the profile, and each bench, may take (a hung step leaves the others their time).
STEP_TIMEOUT="${STEP_TIMEOUT:-240}"
if [ "$DEVICE" = cuda ]; then
  KV_MIB="${KV_MIB:-16384}"
  # One process per GPU worker: no CPU thread count to pin.
  threads_flag=""
  worker_engine=""
  [ -f "$root/scripts/gpu/cuda_env.sh" ] && source "$root/scripts/gpu/cuda_env.sh"
else
  KV_MIB="${KV_MIB:-256}"
  # One thread per worker, as scripts/sim_validation.sh: the profile is of one such worker.
  threads_flag="--threads 1"
  worker_engine=", engine: {threads: 1}"
fi
# The engine limits the profile is measured for and the servers run with (the engine's defaults).
MAX_SEQS=64
MAX_BATCHED=512
if [ "${SMALL:-0}" = 1 ]; then
  WL_bursty="--workload bursty --num-prompts 8 --input-len 32 --output-len 8 --request-rate 2 --burst-size 2 --burst-input-len 128 --burst-output-len 4 --burst-interval 2"
  WL_c64="--num-prompts 16 --input-len 64 --output-len 8 --max-concurrency 64"
  profile_size="--quick --repeats 2"
else
  WL_bursty="--workload bursty --num-prompts 80 --input-len 256 --output-len 128 --request-rate 8 --burst-size 16 --burst-input-len 2048 --burst-output-len 16 --burst-interval 4"
  WL_c64="--num-prompts 192 --input-len 1024 --output-len 128 --max-concurrency 64"
  profile_size="--repeats 3"
fi
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export TANDEM_CLUSTER_TOKEN="${TANDEM_CLUSTER_TOKEN:-sim-validation-token}"
work="$(mktemp -d /tmp/sim_validation.XXXXXX)"
echo "== $(date -u +%FT%TZ) $("$BIN" --version) on $DEVICE; model $MODEL; KV $KV_MIB MiB per worker"
[ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

cat >"$OUT/workloads.env" <<ENV
MODEL='$MODEL'
DEVICE='$DEVICE'
KV_MIB='$KV_MIB'
TRANSPORT='$TRANSPORT'
WL_bursty='$WL_bursty'
WL_c64='$WL_c64'
ENV

echo "== profile"
t0=$SECONDS
# shellcheck disable=SC2086
timeout "$STEP_TIMEOUT" "$BIN" profile "$MODEL" --device "$DEVICE" $threads_flag --kv-cache-mib "$KV_MIB" \
  --max-num-seqs $MAX_SEQS --max-num-batched-tokens $MAX_BATCHED $profile_size -o "$OUT/profile.json" ||
  echo "profile failed (the benches still run)"
echo "profile took $((SECONDS - t0)) s"

SERVER=""
stop_server() {
  if [ -n "$SERVER" ]; then
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=""
  fi
}
trap 'stop_server; rm -rf "$work"' EXIT

wait_healthy() { # log
  for _ in $(seq 600); do
    "$BIN" probe "http://127.0.0.1:$PORT/health" --timeout 2 >/dev/null 2>&1 && return 0
    if ! kill -0 "$SERVER" 2>/dev/null; then
      echo "the server exited"; tail -20 "$1"; return 1
    fi
    sleep 0.5
  done
  echo "server on $PORT did not come up in 300 s"; tail -20 "$1"
  return 1
}

for topo in colocated 1p1d; do
  echo "== $topo"
  t0=$SECONDS
  log="$work/serve-$topo.log"
  if [ "$topo" = colocated ]; then
    # shellcheck disable=SC2086
    "$BIN" serve "$MODEL" --host 127.0.0.1 --port "$PORT" --device "$DEVICE" $threads_flag \
      --kv-cache-memory "${KV_MIB}MiB" --max-num-seqs $MAX_SEQS --max-num-batched-tokens $MAX_BATCHED \
      >"$log" 2>&1 &
  else
    # Both workers on the one GPU (cuda.device, 0 unless set), each with the profiled worker's KV cache.
    cat >"$work/pd.yaml" <<YAML
model: $MODEL
server: {host: 127.0.0.1, port: $PORT}
engine: {device: $DEVICE, block_size: 16, kv_cache_memory: ${KV_MIB}MiB, max_num_seqs: $MAX_SEQS, max_num_batched_tokens: $MAX_BATCHED}
deployment:
  mode: pd
  prefill: {replicas: 1$worker_engine}
  decode: {replicas: 1$worker_engine}
  kv_transfer: {transport: $TRANSPORT}
YAML
    "$BIN" serve --config "$work/pd.yaml" >"$log" 2>&1 &
  fi
  SERVER=$!
  if ! wait_healthy "$log"; then
    stop_server
    continue
  fi
  echo "up after $((SECONDS - t0)) s"
  for w in bursty c64; do
    var="WL_$w"
    t1=$SECONDS
    # shellcheck disable=SC2086
    if ! timeout "$STEP_TIMEOUT" "$BIN" bench --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" ${!var} --seed 7 \
      --warmup 1 --prompt-format tokens --no-progress --output "$OUT/bench-$topo-$w.json" >"$work/bench.log" 2>&1; then
      echo "bench $topo $w failed"; tail -5 "$work/bench.log"; tail -20 "$log"
    fi
    echo "bench $topo $w took $((SECONDS - t1)) s"
  done
  grep -iE "\b(error|warn)" "$log" | tail -5 || true
  stop_server
  # The GPU memory of the workers is back before the next server loads.
  sleep 2
done
echo "== done in $SECONDS s; the table: TANDEM_BIN=target/release/tandem scripts/gpu/sim_validation.sh table DIR [MODEL]"
