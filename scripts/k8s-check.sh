#!/usr/bin/env bash
# CI check of the Kubernetes manifests (tests/k8s): renders every profile in deploy/k8s/overlays/ with
# scripts/k8s-render.sh, validates every object against the Kubernetes 1.31 schemas in strict mode
# (kubernetes-validate), checks the wiring between head, pools and config, and runs
# `tandem serve --check-config` on the ConfigMap's tandem.yaml ($TANDEM_BIN, default target/release/tandem).
# The venv .venv-k8s is made from tests/k8s/requirements.txt and reused while that file is unchanged.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
req="$root/tests/k8s/requirements.txt"
venv="$root/.venv-k8s"
stamp="$(sha256sum "$req" | cut -d' ' -f1)"
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet -r "$req" &&
    echo "$stamp" >"$venv/.requirements.sha256" || exit 1
fi
TANDEM_BIN="${TANDEM_BIN:-$root/target/release/tandem}" exec "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$root/tests/k8s" "$@"
