#!/usr/bin/env bash
# Regenerate tests/fixtures/hf/* (tiny random HF models + transformers reference logits).
# Creates/reuses the git-ignored venv .venv-ref. PyPI's torch is a CUDA build that refuses to import
# without its nvidia-* wheels (even on a CPU-only machine), so the full install is ~3 GB, once; the
# reference itself runs on the CPU in f32.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-ref"
if ! "$venv/bin/python" -c "import torch, transformers, safetensors, tokenizers, gguf" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 numpy gguf==0.19.0
fi
exec "$venv/bin/python" "$root/scripts/gen-hf-fixtures.py" "$@"
