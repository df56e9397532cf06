#!/usr/bin/env bash
# Runs everything of the CUDA backend on the GPU machine in one go and writes results under $OUT:
#   nvidia-smi.txt       the device
#   check.json           correctness against HF transformers (scripts/gpu/check.py)
#   sample_check.json    the on-device sampler's draws against the host sampler's distribution
#   tandem_bench.jsonl   tandem cuda-bench on the 8B-shaped model (random bf16 weights made on the GPU)
#   hf_bench.jsonl       HF transformers generate on the same shapes (scripts/gpu/hf-bench.py)
#   summary.md           the table for BENCHMARKS.md (scripts/gpu/summarize.py)
#   serve.log            the `tandem serve --device cuda` log of the engine check
#   ncu_summary.txt      per-kernel GPU time of one batch-1 decode step and one 4k prefill (ncu)
#   sweep.jsonl          `sweep`: cuda-bench rows of each $SWEEP entry, tagged with its label
#   ncu_detail.txt       `detail`: ncu's full section set for a few decode and prefill kernel launches
#   qwen3/check.json     `qwen3`: check.py's checks on a tiny random Qwen3 (q/k norms)
#   qwen3_bench.jsonl    `qwen3`: cuda-bench on Qwen3-8B's shape (random bf16 weights made on the GPU)
#   qwen3_moe/, qwen2_moe/  `moe`: check.py's checks on tiny random Qwen3-MoE and Qwen2-MoE models
#   moe_bench.jsonl      `moe`: cuda-bench on Qwen3-30B-A3B's shape, then (unless TANDEM_ONLY=1) HF's
#                        generate on the same shape (hf tagged "peer")
#   gemma3/, gemma3_hd256/  `gemma`: check.py's checks on tiny random Gemma 3 models (windows, two ropes,
#                        sandwich norms, GELU, scaled embedding, soft-capping; 128- and 256-wide heads)
#   gemma_bench.jsonl    `gemma`: cuda-bench on Gemma-3-27B's shape (random bf16 weights made on the GPU)
#   qwen3_fp8/           `gemma`, `fp8`: check.py's checks on a tiny Qwen3 saved as a block-scaled FP8 checkpoint
#                        (served in FP8 on the GPU)
#   fp8_bench.jsonl      `fp8`: cuda-bench on the 8B shape with bf16 and then FP8 weights (random, made on the GPU)
#   fp8_agreement.json   `fp8`: a real model quantized to FP8 at load against its bf16 run (top-1, KL)
#   gguf_greedy.json, gguf_agreement.json, gguf_bench.jsonl  `gguf`: the default GGUF model with its blocks
#                        packed on the GPU: greedy against the CPU, agreement with its bf16 upload, speed
#   gguf8b_bench.jsonl   `gguf`: cuda-bench on an 8B-shaped GGUF of random Q4_1 blocks, packed and bf16
#   kvfp8_bench.jsonl, pd_kv_dtype.json  `kvfp8`: the 8B shape's speed with bf16 and FP8 KV caches; the
#                        default model through 1P1D with each (KV bytes pulled, greedy against colocated)
# and, in the log only, `conformance`: the Backend contract on the CUDA backend (tandem-cuda's
# tests/conformance.rs, a test executable built elsewhere with
# `cargo test --release -p tandem-cuda --test conformance --no-run` and given as $CONFORMANCE_BIN,
# default out/conformance).
# (The device tool returns at most 8 files: keep it to these plus the caller's log.)
# The tandem binary is built elsewhere (`cargo build --release --features cuda`, stripped) and given as
# $TANDEM_BIN (default out/tandem). Usage: OUT=/some/dir scripts/gpu/run.sh [check|pick] [conformance] [sample] [bench] [qwen3] [moe] [gemma] [fp8] [gguf] [kvfp8] [profile] | all
# (TANDEM_ONLY=1 skips the HF peer in bench; `pick` checks $CANDIDATES and benches the first that passes.)
# `sweep` (only when named) runs `cuda-bench $SWEEP_ARGS` once per entry of $SWEEP, a space-separated
# list of label:FLAG,FLAG entries (A/B timings of the hidden --cuda-* tuning flags, e.g. --cuda-pdl or
# --cuda-gemv-unroll=4; BIN=path runs another binary), e.g.
# SWEEP="base: pdl:--cuda-pdl old:BIN=/x/tandemC" SWEEP_ARGS="--batches 1 --prefill 0".
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$root/out/gpu}"
BIN="${TANDEM_BIN:-$root/out/tandem}"
what=" ${*:-all} "
# Runs a part when it is named (several may be) or when "all" is.
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=scripts/gpu/cuda_env.sh
source "$root/scripts/gpu/cuda_env.sh"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv |
  tee "$OUT/nvidia-smi.txt"
nvidia-smi -L | tee -a "$OUT/nvidia-smi.txt"

status=0
# Runs a tandem-cuda test executable built elsewhere (`cargo test --release -p tandem-cuda --test NAME
# --no-run`, then the executable it names copied to $2), or fails saying how to build it.
run_test_bin() {
  local name="$1" bin="$2"
  shift 2
  if [ -x "$bin" ]; then
    timeout 300 "$bin" --nocapture "$@" || status=1
  else
    echo "FAIL $bin is missing: cargo test --release -p tandem-cuda --test $name --no-run, then copy the executable it names"
    status=1
  fi
}
if want check; then
  echo "== correctness against HF transformers"
  timeout 180 python3 "$root/scripts/gpu/check.py" --bin "$BIN" --out "$OUT" || status=1
fi
if want qwen3; then
  # Qwen3 (per-head q/k norms): the same checks on a tiny random Qwen3 (qwen3/check.json), then the
  # 8B shape's speed (qwen3_bench.jsonl).
  echo "== Qwen3 correctness against HF transformers"
  timeout 180 python3 "$root/scripts/gpu/check.py" --family qwen3 --bin "$BIN" --work /tmp/tandem-tiny-qwen3 \
    --out "$OUT/qwen3" || status=1
  echo "== tandem cuda-bench --shape qwen3-8b"
  timeout 150 "$BIN" cuda-bench --shape qwen3-8b --out "$OUT/qwen3_bench.jsonl" || status=1
fi
if want gemma; then
  for fam in gemma3 gemma3_hd256 qwen3_fp8; do
    echo "== $fam correctness against HF transformers"
    timeout 240 python3 "$root/scripts/gpu/check.py" --family "$fam" --bin "$BIN" --work "/tmp/tandem-tiny-$fam" \
      --out "$OUT/$fam" || status=1
  done
  echo "== tandem cuda-bench --shape gemma3-27b"
  # Half the layers (27 GB of weights), so that 32 sequences of 4k tokens fit an H100 beside them.
  timeout 300 "$BIN" cuda-bench --shape gemma3-27b --layers 31 --batches 1,8,32 --context 4096 --max-model-len 8192 \
    --prefill 4096 \
    --out "$OUT/gemma_bench.jsonl" || status=1
fi
if want fp8; then
  # FP8 weights (E4M3, one scale per row and 128 columns): the kernels against a float32 reference on the same
  # dequantized weights (tandem-cuda's tests/fp8.rs, built elsewhere as $FP8_TEST_BIN, default out/fp8),
  # the block-scaled FP8 checkpoint served in FP8 against HF, the 8B shape's speed in bf16 and FP8 in
  # one run (fp8_bench.jsonl), and a real model quantized at load against its own bf16 run over real
  # text ($FP8_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf; fp8_agreement.json).
  echo "== FP8 kernels against float32 on the dequantized weights"
  run_test_bin fp8 "${FP8_TEST_BIN:-$root/out/fp8}"
  echo "== qwen3_fp8 (block-scaled FP8 checkpoint, FP8 on the GPU) against HF transformers"
  timeout 240 python3 "$root/scripts/gpu/check.py" --family qwen3_fp8 --bin "$BIN" --work /tmp/tandem-tiny-qwen3_fp8 \
    --out "$OUT/qwen3_fp8" || status=1
  echo "== tandem cuda-bench, 8B shape, bf16, FP8 weights, FP8 weights with FP8 tensor-core GEMMs"
  for q in "" "--quantization fp8" "--quantization fp8 --cuda-fp8-gemm"; do
    # shellcheck disable=SC2086
    # cuda-bench rewrites its --out file: each run's rows are appended to fp8_bench.jsonl.
    timeout 240 "$BIN" cuda-bench --batches 1,8,64 --prefill 4096 $q --out /tmp/fp8_bench_one.jsonl || status=1
    cat /tmp/fp8_bench_one.jsonl >>"$OUT/fp8_bench.jsonl"
  done
  model="${FP8_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  if [ -f "$model" ]; then
    echo "== $model quantized to FP8 at load against its own bf16 run (teacher-forced real text)"
    # Eight passages of ARCHITECTURE.md: their first part is one prefill step (cuBLAS over the
    # dequantized FP8 tiles), their last 128 tokens are fed one decode step at a time, eight rows a
    # step through the FP8 GEMV kernels (--cuda-gemv-max-rows 8).
    python3 - "$root/ARCHITECTURE.md" /tmp/fp8_text.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
step = 1400
json.dump([{"text": text[i * step:(i + 1) * step]} for i in range(8)], open(sys.argv[2], "w"))
PY
    timeout 240 "$BIN" cuda-check "$model" --prompts /tmp/fp8_text.json --decode-steps 128 --agreement \
      --quantization fp8 --cuda-gemv-max-rows 8 --out "$OUT/fp8_agreement.json" || status=1
    cat "$OUT/fp8_agreement.json"
  else
    echo "skipped the agreement run: $model is not here (carry it, or set FP8_MODEL)"
  fi
fi
if want gguf; then
  # GGUF weights packed for the GPU (4-bit codes for Q4_0/Q4_1/Q4_K, 8-bit for the rest, a (scale, min)
  # pair per 16-byte chunk): the kernels against a float32 reference on the decoded values (tandem-cuda's
  # tests/gguf.rs, built elsewhere as $GGUF_TEST_BIN, default out/gguf); then the default model
  # ($GGUF_MODEL, default models/SmolLM2-135M-Instruct.Q4_1.gguf): greedy tokens against the CPU
  # backend's (8 prompts x 64 tokens, gguf_greedy.json), agreement with its bf16 upload over real text
  # (gguf_agreement.json), and decode/prefill speed packed and bf16 in one run (gguf_bench.jsonl).
  echo "== packed GGUF kernels against float32 on the decoded weights"
  run_test_bin gguf "${GGUF_TEST_BIN:-$root/out/gguf}"
  model="${GGUF_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  if [ -f "$model" ]; then
    # Eight passages of README.md and ARCHITECTURE.md: greedy prompts (their first 600 characters),
    # and teacher-forced texts (1,400 characters, the last 128 tokens fed one decode step at a time).
    python3 - "$root/README.md" "$root/ARCHITECTURE.md" /tmp/gguf_prompts.json /tmp/gguf_text.json <<'PY'
import json, sys
readme, arch = open(sys.argv[1]).read(), open(sys.argv[2]).read()
json.dump([{"prompt_text": t[i * 900:i * 900 + 600]} for t in (readme, arch) for i in range(4)], open(sys.argv[3], "w"))
json.dump([{"text": arch[i * 1400:(i + 1) * 1400]} for i in range(8)], open(sys.argv[4], "w"))
PY
    echo "== $model: CUDA greedy (packed GGUF) against the CPU backend's"
    timeout 240 "$BIN" cuda-check "$model" --prompts /tmp/gguf_prompts.json --decode-steps 63 --greedy-vs-cpu \
      --out "$OUT/gguf_greedy.json" || status=1
    cat "$OUT/gguf_greedy.json"
    echo "== $model: packed GGUF against its bf16 upload (teacher-forced real text, 8-row GEMVs)"
    timeout 240 "$BIN" cuda-check "$model" --prompts /tmp/gguf_text.json --decode-steps 128 --agreement \
      --cuda-gemv-max-rows 8 --out "$OUT/gguf_agreement.json" || status=1
    cat "$OUT/gguf_agreement.json"
    echo "== $model: cuda-bench packed GGUF, then bf16"
    for q in "" "--quantization bf16"; do
      # shellcheck disable=SC2086
      timeout 240 "$BIN" cuda-bench --model "$model" --batches 1,8,64 --context 1024 --prefill 512,2048 $q \
        --out /tmp/gguf_bench_one.jsonl || status=1
      cat /tmp/gguf_bench_one.jsonl >>"$OUT/gguf_bench.jsonl"
    done
    # The default model is too small to fill the GPU (a step is launch-bound): the packed kernels' bandwidth
    # on an 8B shape, from a file of random Q4_1 blocks with the default model's tokenizer (random_gguf.py).
    echo "== cuda-bench on an 8B-shaped GGUF of random Q4_1 blocks, packed, then bf16"
    big=/tmp/llama8b-q4_1.gguf
    timeout 120 python3 "$root/scripts/gpu/random_gguf.py" --like "$model" --shape llama-8b --qtype q4_1 --out "$big" ||
      status=1
    for q in "" "--quantization bf16"; do
      # shellcheck disable=SC2086
      timeout 300 "$BIN" cuda-bench --model "$big" --batches 1,8,64 --context 1024 --prefill 4096 $q \
        --out /tmp/gguf8b_bench_one.jsonl || status=1
      cat /tmp/gguf8b_bench_one.jsonl >>"$OUT/gguf8b_bench.jsonl"
    done
  else
    echo "FAIL $model is not here (carry models/, or set GGUF_MODEL)"
    status=1
  fi
fi
if want kvfp8; then
  # The FP8 KV cache (`cuda.kv_cache_dtype: fp8`): every attention kernel against a float32 reference and
  # blocks moved between two instances (tandem-cuda's tests/kv_fp8.rs, $KVFP8_TEST_BIN, default
  # out/kv_fp8); the 8B shape's decode at batch 1 and 64 over 4,096-token contexts and a 4k prefill with
  # bf16 and FP8 KV in one run (kvfp8_bench.jsonl); the default model through 1P1D with each KV dtype: KV
  # bytes pulled and greedy against colocated (pd_kv_dtype.json).
  echo "== FP8 KV cache against float32"
  run_test_bin kv_fp8 "${KVFP8_TEST_BIN:-$root/out/kv_fp8}"
  echo "== tandem cuda-bench, 8B shape, bf16 KV then FP8 KV"
  for kv in bf16 fp8; do
    timeout 300 "$BIN" cuda-bench --batches 1,64 --context 4096 --prefill 4096 --kv-cache-dtype "$kv" \
      --out /tmp/kvfp8_bench_one.jsonl || status=1
    cat /tmp/kvfp8_bench_one.jsonl >>"$OUT/kvfp8_bench.jsonl"
  done
  model="${GGUF_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  if [ -f "$model" ]; then
    echo "== $model through 1P1D with bf16 and FP8 KV: bytes pulled, greedy against colocated"
    timeout 400 python3 "$root/scripts/gpu/pd_kv_dtype.py" --bin "$BIN" --model "$model" \
      --out "$OUT/pd_kv_dtype.json" || status=1
  else
    echo "FAIL $model is not here (carry models/, or set GGUF_MODEL)"
    status=1
  fi
fi
if want moe; then
  for fam in qwen3_moe qwen2_moe; do
    echo "== $fam correctness against HF transformers"
    timeout 240 python3 "$root/scripts/gpu/check.py" --family "$fam" --bin "$BIN" --work "/tmp/tandem-tiny-$fam" \
      --out "$OUT/$fam" || status=1
  done
  echo "== tandem cuda-bench --shape qwen3-30b-a3b"
  timeout 300 "$BIN" cuda-bench --shape qwen3-30b-a3b --batches 1,8,64 --prefill 4096 \
    --out "$OUT/moe_bench.jsonl" || status=1
  if [ "${TANDEM_ONLY:-0}" != 1 ]; then
    echo "== HF transformers peer on the same shape"
    timeout 400 python3 "$root/scripts/gpu/hf-bench.py" --shape qwen3-30b-a3b --batches 1,64 --new-tokens 16 \
      --prefill 4096 --out /tmp/hf_moe.jsonl || status=1
    cat /tmp/hf_moe.jsonl >>"$OUT/moe_bench.jsonl"
  fi
fi
if [[ "$what" == *" pick "* ]]; then  # only when named: "all" checks $BIN alone
  # CANDIDATES="bin1 bin2 ...": checks them all at once (each in its own work dir) and keeps the first
  # that passes as $BIN for the later parts; its check.json goes to $OUT, the others' verdicts to stdout.
  echo "== correctness of the candidates: ${CANDIDATES:-}"
  i=0
  for b in ${CANDIDATES:-}; do
    timeout 240 python3 "$root/scripts/gpu/check.py" --bin "$b" --work "/tmp/pick$i" --out "/tmp/pick$i/out" \
      >"/tmp/pick$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  i=0
  picked=""
  for b in ${CANDIDATES:-}; do
    if grep -q '"pass": false' "/tmp/pick$i/out/check.json" 2>/dev/null || [ ! -f "/tmp/pick$i/out/check.json" ]; then
      echo "FAIL $b"; grep -E '^(PASS|FAIL)' "/tmp/pick$i.log" | grep FAIL; tail -3 "/tmp/pick$i.log"
    else
      echo "PASS $b"
      if [ -z "$picked" ]; then
        picked="$b"
        cp "/tmp/pick$i/out/check.json" "$OUT/check.json"
        grep -E '^(PASS|FAIL)' "/tmp/pick$i.log"
      fi
    fi
    i=$((i + 1))
  done
  if [ -n "$picked" ]; then BIN="$picked"; echo "picked $BIN"; else status=1; fi
fi
if want conformance; then
  echo "== the Backend contract on the CUDA backend"
  run_test_bin conformance "${CONFORMANCE_BIN:-$root/out/conformance}" --test-threads 1
fi
if want sample; then
  echo "== on-device sampler against the host sampler's distribution"
  timeout 120 "$BIN" cuda-sample-check --out "$OUT/sample_check.json" 2>/tmp/sample_check.log |
    python3 -c 'import json,sys; r=json.load(sys.stdin); [print("PASS" if c["pass"] else "FAIL", c) for c in r["cases"]]' ||
    { status=1; echo "FAIL sample check"; tail -5 /tmp/sample_check.log; }
fi
if want bench; then
  echo "== tandem cuda-bench (8B shape, random weights generated on the GPU)"
  timeout 150 "$BIN" cuda-bench --out "$OUT/tandem_bench.jsonl" || status=1
  if [ "${TANDEM_ONLY:-0}" != 1 ]; then
    echo "== HF transformers peer"
    timeout 220 python3 "$root/scripts/gpu/hf-bench.py" --out "$OUT/hf_bench.jsonl" || status=1
    python3 "$root/scripts/gpu/summarize.py" "$OUT" | tee "$OUT/summary.md" || status=1
  fi
fi
if [[ "$what" == *" sweep "* ]]; then
  echo "== sweep: ${SWEEP:-} (cuda-bench ${SWEEP_ARGS:-})"
  for entry in ${SWEEP:-}; do
    label="${entry%%:*}"
    bin="$BIN"
    flags=()
    IFS=',' read -ra kv <<<"${entry#*:}"
    for a in "${kv[@]}"; do
      case "$a" in
        BIN=*) bin="${a#BIN=}" ;;
        ?*) flags+=("$a") ;;
      esac
    done
    # shellcheck disable=SC2086 # SWEEP_ARGS is a list of arguments
    timeout 120 "$bin" cuda-bench ${SWEEP_ARGS:-} "${flags[@]}" 2>"/tmp/sweep-$label.log" |
      sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT/sweep.jsonl" || status=1
    grep -qi 'error' "/tmp/sweep-$label.log" && tail -3 "/tmp/sweep-$label.log"
  done
fi
if [[ "$what" == *" detail "* ]]; then
  # Throughput, occupancy, stall reasons... of a few launches: decode kernels of batch-1 eager steps
  # (past the first steps' launches), then one prefill attention launch.
  echo "== ncu details" | tee "$OUT/ncu_detail.txt"
  timeout 200 ncu --clock-control none --set full \
    --kernel-name "regex:^(${DETAIL_DECODE:-gemv_silu_1|gemv_add_1|gemv_qkv_1|attn_decode_small})\$" \
    --launch-skip 200 --launch-count 5 "$BIN" cuda-bench --batches 1 --steps 4 --prefill 0 --no-cuda-graphs \
    >>"$OUT/ncu_detail.txt" 2>&1 || echo "ncu (decode) failed"
  timeout 200 ncu --clock-control none --set full \
    --kernel-name "regex:^attn_prefill\$" --launch-skip 40 --launch-count 1 \
    "$BIN" cuda-bench --batches 0 --prefill 4096 --no-cuda-graphs >>"$OUT/ncu_detail.txt" 2>&1 || echo "ncu (prefill) failed"
fi
if want profile; then
  # Per-kernel GPU time of one eager batch-1 decode step and of one 4k prefill (ncu replays each
  # kernel; clocks untouched). Weight generation is 196 launches. Decode: 3 warm-up steps of
  # DECODE_KERNELS launches are skipped (5 per layer with the fused GEMVs, + embed, final norm, head,
  # argmax). Prefill: the first of the 6 prefill runs (one cuBLAS GEMM launch per projection assumed).
  decode_kernels="${DECODE_KERNELS:-164}"
  prefill_kernels="${PREFILL_KERNELS:-293}"
  echo "== ncu: kernels of one batch-1 decode step"
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip $((196 + 3 * decode_kernels)) --launch-count "$decode_kernels" \
    "$BIN" cuda-bench --batches 1 --steps 2 --prefill 0 --no-cuda-graphs \
    >/tmp/ncu_decode_b1.csv 2>/tmp/ncu.log &&
    python3 "$root/scripts/gpu/ncu-summary.py" /tmp/ncu_decode_b1.csv | tee "$OUT/ncu_summary.txt" ||
    { echo "ncu failed"; tail -5 /tmp/ncu.log; }
  if [ "${PROFILE_PREFILL:-1}" = 1 ]; then
    echo "== ncu: kernels of one 4,096-token prefill"
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-skip 196 --launch-count "$prefill_kernels" \
      "$BIN" cuda-bench --batches 0 --prefill 4096 --no-cuda-graphs \
      >/tmp/ncu_prefill.csv 2>/tmp/ncu_p.log &&
      python3 "$root/scripts/gpu/ncu-summary.py" /tmp/ncu_prefill.csv | tee -a "$OUT/ncu_summary.txt" ||
      { echo "ncu failed"; tail -5 /tmp/ncu_p.log; }
  fi
fi
exit $status
