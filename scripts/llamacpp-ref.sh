#!/usr/bin/env bash
# Regenerate tests/fixtures/llamacpp/* from llama.cpp (see scripts/llamacpp-ref.py for the format).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/fetch-model.sh"
# The fixture is llama.cpp's AVX2 CPU arithmetic (recorded on an AVX2 machine), which tandem's kernels follow
# operation for operation: build that path on any x86-64 machine (a native AVX-512 build rounds differently
# and agrees with the fixture on only 685/705 top-1 tokens).
export LLAMACPP_VENV="$root/.venv-llamacpp-avx2"
export LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
bash "$root/scripts/llamacpp-venv.sh"
exec "$LLAMACPP_VENV/bin/python" "$root/scripts/llamacpp-ref.py" "$@"
