#!/usr/bin/env bash
# The one test command (also what CI runs through .ci/run): fetch the model, build, run every Rust test,
# lint, check formatting, then run the black-box Python tests against the release binary, build the
# container images and test them and the compose deployment (needs a running Docker daemon).
# Every step runs even after a failure (except the Python tests, which need the binary); a summary is
# printed at the end and the exit status is non-zero when any step failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

summary=()
failed=0
run_step() {
  local name="$1"
  shift
  local start=$SECONDS
  echo
  echo "==> $name: $*"
  if "$@"; then
    summary+=("ok    $name ($((SECONDS - start)) s)")
    return 0
  fi
  summary+=("FAIL  $name ($((SECONDS - start)) s)")
  failed=1
  return 1
}

# The Python test venv (.venv-test), reused while tests/python/requirements.txt is unchanged.
ensure_venv() {
  local req="$root/tests/python/requirements.txt"
  if [ ! -f "$req" ]; then
    echo "tests/python/requirements.txt is missing" >&2
    return 1
  fi
  venv="$root/.venv-test"
  local stamp
  stamp="$(sha256sum "$req" | cut -d' ' -f1)"
  if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv" &&
      "$venv/bin/pip" install --quiet -r "$req" &&
      echo "$stamp" >"$venv/.requirements.sha256" || return 1
  fi
}

python_tests() {
  ensure_venv || return 1
  TANDEM_BIN="$root/target/release/tandem" "$venv/bin/python" -m pytest -q "$root/tests/python"
}

# The images' and the compose deployment's tests (tests/compose): they use the images scripts/images.sh
# built and the model in models/, bring each deployment up under its own compose project and always take
# it down. The tests of the DNS-discovery deployment fail, saying so, where tandem lacks `discovery:`.
# test_faults.py kills, cuts off, scales and restarts containers under load (about 2.5 minutes).
compose_tests() {
  ensure_venv || return 1
  "$venv/bin/python" -m pytest -q "$root/tests/compose"
}

total_start=$SECONDS
run_step "fetch model" bash scripts/fetch-model.sh
# Gemma 3 270M (241 MiB, sha-checked): tandem-model's tests/gemma3_gguf.rs follows llama.cpp's greedy tokens on it.
run_step "fetch model (gemma3)" bash scripts/fetch-model.sh gemma3
run_step "cargo fmt --check" cargo fmt --all --check
build_ok=0
# The same build as scripts/serve.sh's (release, the whole workspace, default features), so a machine that
# served first builds nothing here, and the test build below reuses it (the workspace's dependencies ask
# for the features the tests' dependencies would add: crates/tandem/Cargo.toml's getrandom).
run_step "cargo build --release" cargo build --workspace --release && build_ok=1
# NIXL for the `nixl` KV transport tests (tandem-kv's tests/nixl.rs): the nixl-cu13 wheel (its C API, UCX
# and plugins), unpacked under .cache/; they skip, saying why, when TANDEM_TEST_NIXL_LIB is unset.
fetch_nixl() {
  local dir="$root/.cache/nixl-1.5.1"
  if [ ! -f "$dir/.nixl_cu13.mesonpy.libs/libnixl_capi.so" ]; then
    rm -rf "$dir" && mkdir -p "$dir" &&
      python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" 'nixl-cu13==1.5.1' &&
      python3 -m zipfile -e "$dir"/nixl_cu13-*.whl "$dir" && rm -f "$dir"/nixl_cu13-*.whl || return 1
  fi
  export TANDEM_TEST_NIXL_LIB="$dir"
}
run_step "fetch NIXL (nixl-cu13 1.5.1)" fetch_nixl
run_step "cargo test --release" cargo test --workspace --release --no-fail-fast
run_step "cargo clippy -D warnings" cargo clippy --workspace --all-targets --release -- -D warnings
# The CUDA backend builds without CUDA (libraries load at run time); it runs only on the GPU machine
# (scripts/gpu/run.sh), so CI checks that the `cuda` feature compiles and lints clean.
run_step "cargo clippy --features cuda" cargo clippy -p tandem --features cuda --release -- -D warnings
# The CUDA tools and the `cuda:` settings' conversion live in the binary behind the feature; their
# tests that need no GPU (cuda-check's CPU mode, the options the settings make) run here.
run_step "cargo test --features cuda (binary)" cargo test -p tandem --features cuda --release --bins

# NVRTC needs no GPU: with PyPI's libnvrtc (13.0, the GPU machine's version; cached under .cache/) the
# CUDA kernels are compiled for sm_90 here, so a kernel that does not compile fails CI, not the GPU run.
nvrtc_compile() {
  local dir="$root/.cache/nvrtc-13.0"
  if [ ! -f "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    rm -rf "$dir" && mkdir -p "$dir" &&
      python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" 'nvidia-cuda-nvrtc==13.0.*' &&
      python3 -m zipfile -e "$dir"/nvidia_cuda_nvrtc-*.whl "$dir" || return 1
  fi
  # --workspace (not -p tandem-cuda; the test is tandem-cuda/tests/nvrtc.rs): the same features as the test step's build, so nothing recompiles.
  TANDEM_REQUIRE_NVRTC=1 LD_LIBRARY_PATH="$dir/nvidia/cu13/lib" cargo test --workspace --release --test nvrtc compiles_for_hopper -- --nocapture
}
run_step "CUDA kernels compile (NVRTC, sm_90)" nvrtc_compile
# Fuzzing (about 5 minutes, mostly the instrumented build): each libFuzzer target under fuzz/ for 10 s from
# its seeds; longer runs and their figures are in docs/reliability.md.
run_step "fuzz targets (10 s each)" bash scripts/fuzz.sh 10
# The Helm chart (seconds): every profile of deploy/helm/tandem rendered by Helm's engine, validated against
# the Kubernetes 1.31 schemas in strict mode, its wiring checked, and its ConfigMap through `serve --check-config`.
run_step "Helm chart (tests/k8s)" env TANDEM_BIN="$root/target/release/tandem" bash scripts/k8s-check.sh
# The console's browser tests (tests/python/test_console.py) drive Debian's chromium through
# chromium-driver: installed here from Debian's packages when either command is missing (they fail,
# saying how to install them, where this step could not).
ensure_chromium() {
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    return 0
  fi
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq &&
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
}
run_step "chromium + chromium-driver (console tests)" ensure_chromium
if [ "$build_ok" = 1 ]; then
  run_step "pytest tests/python" python_tests
else
  summary+=("FAIL  pytest tests/python (skipped: the release build failed)")
  failed=1
fi

# Container images from the binaries built here (no Rust is compiled in an image): tandem:cpu from
# target/release/tandem, tandem:cuda from the `cuda` binary, built into its own target dir so that
# target/release/tandem stays the CPU binary the steps above test. scripts/images.sh builds the Debian
# base image first only where the daemon lacks it.
run_step "cargo build --features cuda (target/cuda)" \
  cargo build --release -p tandem --features cuda --target-dir target/cuda
if [ "$build_ok" = 1 ]; then
  run_step "image tandem:cpu" bash scripts/images.sh cpu
else
  summary+=("FAIL  image tandem:cpu (skipped: the release build failed)")
  failed=1
fi
run_step "image tandem:cuda" bash scripts/images.sh cuda
run_step "pytest tests/compose (images, compose deployment)" compose_tests
# The Helm chart's CPU-profile pods run under Docker as a kubelet would run them (their args with POD_IP,
# uid/gid, no capabilities, the ConfigMap's file, a read-only model): served, probed, SIGTERM'd.
run_step "k8s pods under Docker (tests/k8s)" env TANDEM_K8S_DOCKER_IMAGE=tandem:cpu \
  TANDEM_BIN="$root/target/release/tandem" bash scripts/k8s-check.sh -k pods_in_docker

echo
echo "==== summary ($((SECONDS - total_start)) s) ===="
printf '%s\n' "${summary[@]}"
if [ "$failed" != 0 ]; then
  echo "RESULT: FAILED"
  exit 1
fi
echo "RESULT: all steps passed"
