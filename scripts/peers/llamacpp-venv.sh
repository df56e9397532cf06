#!/usr/bin/env bash
# Create/reuse .venv-llamacpp: llama-cpp-python built from its PyPI sdist (which vendors llama.cpp)
# for this CPU. Idempotent: does nothing when the venv already imports llama_cpp.
# The sdist is kept in .cache/sdist so that scripts/peers/build-llama-server.sh builds the same llama.cpp.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# LLAMACPP_VENV and LLAMACPP_CMAKE_ARGS choose another venv and build (scripts/fixtures/llamacpp-ref.sh builds the
# AVX2 CPU path the reference fixture was recorded with).
venv="${LLAMACPP_VENV:-$root/.venv-llamacpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
sdist="$root/.cache/sdist/llama_cpp_python-$version.tar.gz"
if [ ! -s "$sdist" ]; then
  "$venv/bin/pip" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root/.cache/sdist"
fi
start=$SECONDS
# Native CPU flags (AVX2/FMA/F16C here); skip the multimodal library, tests and examples to save build time.
CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON} -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$venv/bin/pip" install --quiet "$sdist"
echo "llama-cpp-python $version built in $((SECONDS - start)) s"
