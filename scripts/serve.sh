#!/usr/bin/env bash
# The quick start: fetch the default model (once), build tandem (release) and serve it on 127.0.0.1:8000
# as the embedded default deployment — one ingress, one prefill worker, one decode worker, each its own
# OS process on this machine. Extra arguments go to `tandem serve` (e.g. --port 9000).
# TANDEM_CONFIG picks another deployment file (examples/colocated.yaml for a single process).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/fetch-model.sh
# The whole workspace, as scripts/test.sh builds it, so the tests reuse this build.
if [ ! -x target/release/tandem ]; then
  echo "Building tandem (release, the whole workspace): the first build takes several minutes (about 8 on 2 cores)." >&2
fi
cargo build --release --workspace
exec target/release/tandem serve --config "${TANDEM_CONFIG:-examples/pd.yaml}" "$@"
