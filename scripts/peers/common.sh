# Sourced by the peer comparison scripts after `set -euo pipefail`: works from the repository root ($root)
# and takes the model from the script's first argument ($model), the default model when there is none.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
model="${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
