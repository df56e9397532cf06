#!/usr/bin/env bash
# Makes (once) and prints the venv of the Kubernetes tooling: .venv-k8s from tests/k8s/requirements.txt
# (helm-python-sdk: Helm's engine for rendering without the helm command; kubernetes-validate; pytest).
# Reused while requirements.txt is unchanged. Used by scripts/k8s-render.sh and scripts/k8s-check.sh.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
req="$root/tests/k8s/requirements.txt"
venv="$root/.venv-k8s"
stamp="$(sha256sum "$req" | cut -d' ' -f1)"
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet -r "$req" && echo "$stamp" >"$venv/.requirements.sha256"; } >&2 ||
    { echo "k8s-venv: cannot make $venv from $req" >&2; exit 1; }
fi
echo "$venv"
