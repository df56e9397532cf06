#!/usr/bin/env bash
# CI check of the Helm chart (tests/k8s): renders every profile of scripts/k8s-render.sh, validates every
# object against the Kubernetes 1.31 schemas in strict mode (kubernetes-validate), checks the wiring between
# head, pools and config, gives each container's command line to the release binary, and runs
# `tandem serve --check-config` on the ConfigMap's tandem.yaml ($TANDEM_BIN, default target/release/tandem).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$(bash scripts/k8s-venv.sh)" || exit 1
TANDEM_BIN="${TANDEM_BIN:-$root/target/release/tandem}" exec "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$root/tests/k8s" "$@"
