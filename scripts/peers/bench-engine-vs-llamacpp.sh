#!/usr/bin/env bash
# Engine speed of tandem and llama.cpp on the same GGUF, same machine, same run; prints both and the ratios.
# Usage: scripts/peers/bench-engine-vs-llamacpp.sh [MODEL.gguf] [THREADS]
#
# llama.cpp comes from the source vendored in the llama-cpp-python sdist on PyPI, either
#   LLAMACPP=bench  (default) its own `llama-bench` tool, built with cmake next to llama-server
#                   (scripts/peers/build-llama-server.sh; minutes on 2 cores), pp512 and tg128, 3 repetitions;
#   LLAMACPP=python through llama-cpp-python itself (scripts/peers/llamacpp-venv.sh builds it once; 10–40 min),
#                   measured by scripts/peers/llamacpp-speed.py the way `tandem bench-engine` measures.
# Same instruction set on both sides of an AVX-512 machine: LLAMACPP_ISA=avx2 (llama-bench built for AVX2+FMA+F16C
# only, see build-llama-server.sh) with TANDEM_KERNELS=avx2. ROUNDS=N alternates the two N times and prints each
# round and the medians.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
threads="${2:-$(nproc)}"
mode="${LLAMACPP:-bench}"
bash scripts/fetch-model.sh >/dev/null
cargo build --release -p tandem --quiet
tandem_bin="${CARGO_TARGET_DIR:-target}/release/tandem"
case "$mode" in
  bench)
    bash scripts/peers/build-llama-server.sh >/dev/null
    build="$root/.cache/llama.cpp/build"
    [ "${LLAMACPP_ISA:-native}" = avx2 ] && build="$root/.cache/llama.cpp-avx2/build"
    bench_bin="$build/bin/llama-bench"
    [ -x "$bench_bin" ] || cmake_bin="$(command -v cmake || echo "$root/.venv-buildtools/bin/cmake")"
    [ -x "$bench_bin" ] || PATH="$root/.venv-buildtools/bin:$PATH" "$cmake_bin" --build "$build" --target llama-bench -j "$(nproc)" >/dev/null
    ;;
  python) bash scripts/peers/llamacpp-venv.sh ;;
  *) echo "LLAMACPP must be bench or python" >&2; exit 2 ;;
esac
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $(cut -d' ' -f1-3 /proc/loadavg); llama.cpp ISA: ${LLAMACPP_ISA:-native}"
measure_llama() {
  if [ "$mode" = bench ]; then
    # --repack 0: llama.cpp's repacked AMX path segfaults in ggml_backend_amx_mul_mat on the AMX-capable
    # development VM (seen 2026-12-03); the plain CPU path is the one that runs.
    "$bench_bin" -m "$model" -t "$threads" -p 512 -n 128 -r 3 --repack 0 -o json 2>/dev/null | python3 -c '
import json, sys
runs = json.load(sys.stdin)
pp = max(r["avg_ts"] for r in runs if r["n_prompt"] > 0 and r["n_gen"] == 0)
tg = max(r["avg_ts"] for r in runs if r["n_gen"] > 0 and r["n_prompt"] == 0)
print(json.dumps({"engine": "llama.cpp (llama-bench)", "single_stream_decode_tok_s": tg, "prefill_tok_s": pp}))
'
  else
    .venv-llamacpp/bin/python scripts/peers/llamacpp-speed.py "$model" "$threads"
  fi
}
# ROUNDS > 1 alternates the two engines that many times: on a machine whose speed drifts (a shared cloud
# host), the median of same-round ratios is steadier than one pair of runs.
results=()
for _ in $(seq 1 "${ROUNDS:-1}"); do
  results+=("$("$tandem_bin" bench-engine "$model" --threads "$threads" --json 2>/dev/null)")
  results+=("$(measure_llama)")
done
python3 - "${results[@]}" <<'PY'
import json, statistics, sys
pairs = [(json.loads(sys.argv[i]), json.loads(sys.argv[i + 1])) for i in range(1, len(sys.argv), 2)]
t0, l0 = pairs[0]
print(f"tandem kernels: {t0['kernels']}; llama.cpp measured through: {l0['engine']}")
rows = [
    ("single-stream decode (tok/s)", "single_stream_decode_tok_s", "single_stream_decode_tok_s", 1.2),
    ("prefill, 512-token prompt (tok/s)", "prefill_tok_s", "prefill_tok_s", 1.5),
    ("16-seq aggregate decode vs llama.cpp single stream (tok/s)", "concurrent_decode_tok_s", "single_stream_decode_tok_s", 3.0),
]
if len(pairs) > 1:
    for i, (t, l) in enumerate(pairs, 1):
        cells = "  ".join(f"{t[a]:.1f}/{l[b]:.1f} = {t[a] / l[b]:.2f}x" for _, a, b, _ in rows)
        print(f"round {i}: {cells}")
    print(f"medians over {len(pairs)} rounds (ratio: median of the rounds' ratios):")
print(f"{'figure':58} {'tandem':>9} {'llama.cpp':>10} {'ratio':>7} {'target':>7}")
for name, a, b, target in rows:
    ta = statistics.median(t[a] for t, _ in pairs)
    lb = statistics.median(l[b] for _, l in pairs)
    ratio = statistics.median(t[a] / l[b] for t, l in pairs)
    print(f"{name:58} {ta:9.1f} {lb:10.1f} {ratio:6.2f}x {target:6.1f}x")
PY
