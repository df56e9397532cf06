#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the baseline for benchmarks) into .cache/llama.cpp/ from the llama.cpp
# sources vendored in the llama-cpp-python sdist, i.e. the same llama.cpp as the reference fixtures.
# Idempotent: exits at once when the binary is already there. Prints the binary's path last.
# LLAMACPP_ISA=avx2 builds for AVX2+FMA+F16C only (no AVX-512, no AMX), into .cache/llama.cpp-avx2/, so it
# can be compared with tandem capped at TANDEM_KERNELS=avx2 on any x86 machine; the default is -DGGML_NATIVE=ON.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
isa="${LLAMACPP_ISA:-native}"
case "$isa" in
  native) dest="$root/.cache/llama.cpp"; isa_flags=(-DGGML_NATIVE=ON) ;;
  avx2)
    dest="$root/.cache/llama.cpp-avx2"
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
      -DGGML_AMX_INT8=OFF)
    ;;
  *) echo "LLAMACPP_ISA must be native or avx2" >&2; exit 2 ;;
esac
bin="$dest/bin/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
sdist="$root/.cache/sdist/llama_cpp_python-$version.tar.gz"
if [ ! -s "$sdist" ]; then
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$root/.cache/sdist"
fi
src="$root/.cache/llama_cpp_python-$version"
[ -d "$src/vendor/llama.cpp" ] || tar -xzf "$sdist" -C "$root/.cache"
# cmake and ninja come from PyPI into a small tool venv when the system has none.
tools="$root/.venv-buildtools"
cmake_bin="$(command -v cmake || true)"
if [ -z "$cmake_bin" ]; then
  [ -x "$tools/bin/cmake" ] || { python3 -m venv "$tools" && "$tools/bin/pip" install --quiet cmake ninja; }
  cmake_bin="$tools/bin/cmake"
  export PATH="$tools/bin:$PATH"
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
start=$SECONDS
"$cmake_bin" -S "$src/vendor/llama.cpp" -B "$dest/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$dest/bin" >"$dest.cmake.log" 2>&1 || { cat "$dest.cmake.log"; exit 1; }
"$cmake_bin" --build "$dest/build" --target llama-server -j "$(nproc)"
# llama.cpp's CMakeLists sets its own runtime output folder (build/bin), overriding ours.
mkdir -p "$dest/bin"
[ -x "$bin" ] || cp "$dest/build/bin/llama-server" "$bin"
echo "llama-server built in $((SECONDS - start)) s" >&2
test -x "$bin"
echo "$bin"
