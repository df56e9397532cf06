#!/usr/bin/env bash
# Runs everything of the CUDA backend on the GPU machine in one go and writes results under $OUT:
#   nvidia-smi.txt       the device
#   check.json           correctness against HF transformers (scripts/gpu/check.py)
#   tandem_bench.jsonl   tandem cuda-bench on the 8B-shaped model (random bf16 weights made on the GPU)
#   hf_bench.jsonl       HF transformers generate on the same shapes (scripts/gpu/hf_bench.py)
#   summary.md           the table for BENCHMARKS.md (scripts/gpu/summarize.py)
#   serve.log            the `tandem serve --device cuda` log of the engine check
#   ncu_summary.txt      per-kernel GPU time of one batch-1 decode step (ncu)
# (The device tool returns at most 8 files: keep it to these plus the caller's log.)
# The tandem binary is built elsewhere (`cargo build --release --features cuda`, stripped) and given as
# $TANDEM_BIN (default out/tandem). Usage: OUT=/some/dir scripts/gpu/run.sh [check|bench|all]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$root/out/gpu}"
BIN="${TANDEM_BIN:-$root/out/tandem}"
what="${1:-all}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# NVRTC and cuBLAS 13 come from the CUDA toolkit or from PyTorch's nvidia wheels.
libdirs="$(python3 - <<'PY'
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(d, "libnvrtc.so*")) or glob.glob(os.path.join(d, "libcublas*.so*")):
            dirs.append(d)
print(":".join(dirs))
PY
)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${libdirs}:${LD_LIBRARY_PATH:-}"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv |
  tee "$OUT/nvidia-smi.txt"
nvidia-smi -L | tee -a "$OUT/nvidia-smi.txt"

status=0
if [ "$what" = check ] || [ "$what" = all ]; then
  echo "== correctness against HF transformers"
  timeout 180 python3 "$root/scripts/gpu/check.py" --bin "$BIN" --out "$OUT" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== tandem cuda-bench (8B shape, random weights generated on the GPU)"
  timeout 150 "$BIN" cuda-bench --out "$OUT/tandem_bench.jsonl" || status=1
  echo "== HF transformers peer"
  timeout 220 python3 "$root/scripts/gpu/hf_bench.py" --out "$OUT/hf_bench.jsonl" || status=1
  python3 "$root/scripts/gpu/summarize.py" "$OUT" | tee "$OUT/summary.md" || status=1
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
  # Per-kernel GPU time of one eager batch-1 decode step (ncu replays each kernel; clocks untouched).
  # Skipped: 196 launches of weight generation, then 3 warm-up steps of 325 kernels each.
  echo "== ncu: kernels of one batch-1 decode step"
  TANDEM_CUDA_GRAPHS=0 timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip 1171 --launch-count 325 "$BIN" cuda-bench --batches 1 --steps 2 --prefill 0 \
    >/tmp/ncu_decode_b1.csv 2>/tmp/ncu.log &&
    python3 "$root/scripts/gpu/ncu_summary.py" /tmp/ncu_decode_b1.csv | tee "$OUT/ncu_summary.txt" ||
    { echo "ncu failed"; tail -5 /tmp/ncu.log; }
fi
exit $status
