#!/usr/bin/env bash
# Prints tandem's Kubernetes manifests: the Helm chart deploy/helm/tandem rendered for one profile (default:
# cpu, the chart's own values) as `helm template` does, plus any values files given with -f.
#   scripts/k8s-render.sh                      # the CPU profile (values.yaml)
#   scripts/k8s-render.sh gpu                  # the GPU profile (values-gpu.yaml)
#   scripts/k8s-render.sh gpu -f my.yaml       # a profile with your values over it
#   scripts/k8s-render.sh --list               # the profiles
# With the `helm` command on PATH it runs `helm template`; otherwise Helm's engine from PyPI
# (helm-python-sdk, in the venv scripts/k8s-venv.sh makes). Install with
# `helm install tandem deploy/helm/tandem [-f deploy/helm/tandem/values-gpu.yaml]` (docs/deploy.md).
# TANDEM_RELEASE (default tandem) and TANDEM_NAMESPACE (default default) name the release.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
chart="$root/deploy/helm/tandem"

# Profile -> values files (relative to the chart), in order.
profiles="cpu gpu gpu-efa cpu-hostpath eks-example"
profile_files() {
  case "$1" in
    cpu) ;;
    gpu) echo values-gpu.yaml ;;
    gpu-efa) echo values-gpu.yaml ci/efa-monitoring-values.yaml ;;
    cpu-hostpath) echo ci/hostpath-values.yaml ;;
    eks-example) echo values-gpu.yaml values-eks-example.yaml ;;
    *) return 1 ;;
  esac
}

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' $profiles
  exit 0
fi
profile=cpu
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  profile="$1"
  shift
fi
if ! files="$(profile_files "$profile")"; then
  echo "k8s-render: no profile '$profile' (profiles: $profiles)" >&2
  exit 2
fi
values=()
for f in $files; do values+=("$chart/$f"); done
while [ $# -gt 0 ]; do
  case "$1" in
    -f | --values)
      [ $# -ge 2 ] || { echo "k8s-render: $1 needs a file" >&2; exit 2; }
      values+=("$(realpath "$2")")
      shift 2
      ;;
    *) echo "k8s-render: unknown argument '$1' (usage: k8s-render.sh [PROFILE] [-f VALUES.yaml]...)" >&2; exit 2 ;;
  esac
done
release="${TANDEM_RELEASE:-tandem}"
namespace="${TANDEM_NAMESPACE:-default}"

if command -v helm >/dev/null 2>&1; then
  args=()
  for v in ${values[@]+"${values[@]}"}; do args+=(-f "$v"); done
  # --kube-version: the version CI validates against, so older helm commands (whose default is older than
  # the chart's kubeVersion, >=1.30) render too; `helm install` takes the cluster's own.
  exec helm template "$release" "$chart" --namespace "$namespace" --kube-version "${TANDEM_KUBE_VERSION:-1.31.0}" ${args[@]+"${args[@]}"}
fi
venv="$(bash "$root/scripts/k8s-venv.sh")"
exec "$venv/bin/python" "$root/scripts/k8s_render.py" "$chart" "$release" "$namespace" ${values[@]+"${values[@]}"}
