#!/usr/bin/env bash
# Builds the libFuzzer targets under fuzz/ (cargo fuzz, on the stable toolchain: `--sanitizer none`, so
# they find panics, aborts, hangs and runaway memory rather than memory errors, which safe Rust rules
# out) and runs each for SECS seconds (default 10) from its seeds (fuzz/seeds/TARGET) and the corpus it
# grew before (fuzz/corpus/TARGET, git-ignored). A crash leaves its input under fuzz/artifacts/TARGET and
# fails the script; turn it into a regression test beside the code it broke.
#   scripts/fuzz.sh [SECS] [TARGET...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"
secs="${1:-10}"
shift || true
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz@0.13.2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(api_request chat_template kv_frames worker_rpc stage_link nixl_bodies)
cargo fuzz build -O --sanitizer none
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "seeds/$t"
  echo "== $t: ${secs} s"
  cargo fuzz run -O --sanitizer none "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -max_len=8192 \
    -print_final_stats=1 2>&1 | grep -E "^(#[0-9]+[[:space:]]+DONE|Done [0-9]+ runs|stat::|==[0-9]+== ERROR|thread .* panicked|SUMMARY)" || {
    echo "$t: fuzzing failed (see fuzz/artifacts/$t)" >&2
    exit 1
  }
done
