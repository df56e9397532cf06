#!/usr/bin/env bash
# Prints tandem's Kubernetes manifests for one profile (a folder of deploy/k8s/overlays/; default: cpu),
# rendered by kustomize: `kubectl kustomize` (kubectl carries kustomize), or a standalone `kustomize build`.
#   scripts/k8s-render.sh            # the CPU profile
#   scripts/k8s-render.sh gpu        # the GPU profile (CUDA image, one GPU per worker, NIXL)
#   scripts/k8s-render.sh --list     # the profiles
#   scripts/k8s-render.sh PATH       # any kustomization folder, e.g. your own overlay
# Apply the same with `kubectl apply -k deploy/k8s/overlays/PROFILE` (docs/deploy.md).
set -euo pipefail
export LC_ALL=C
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
overlays="$root/deploy/k8s/overlays"

if [ "${1:-}" = "--list" ]; then
  ls -1 "$overlays"
  exit 0
fi
profile="${1:-cpu}"
if [ -f "$profile/kustomization.yaml" ]; then
  dir="$profile"
elif [ -f "$overlays/$profile/kustomization.yaml" ]; then
  dir="$overlays/$profile"
else
  echo "k8s-render: no profile '$profile' (profiles: $(ls "$overlays" | tr '\n' ' '))" >&2
  exit 2
fi

if command -v kubectl >/dev/null 2>&1; then
  exec kubectl kustomize "$dir"
elif command -v kustomize >/dev/null 2>&1; then
  exec kustomize build "$dir"
fi
echo "k8s-render: needs kubectl (1.21 or newer, with kustomize built in) or kustomize on PATH" >&2
exit 127
