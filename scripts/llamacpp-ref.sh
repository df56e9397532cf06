#!/usr/bin/env bash
# Regenerate tests/fixtures/llamacpp/* from llama.cpp (see scripts/llamacpp-ref.py for the format).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/fetch-model.sh"
bash "$root/scripts/llamacpp-venv.sh"
exec "$root/.venv-llamacpp/bin/python" "$root/scripts/llamacpp-ref.py" "$@"
