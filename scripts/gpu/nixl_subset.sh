#!/usr/bin/env bash
# Copies the part of an unpacked nixl-cu13 wheel that tandem's `nixl` transport loads on a GPU machine
# (the C API, the UCX plugin, UCX with its CUDA and CMA modules, and everything they link), keeping the
# wheel's relative layout (its libraries find each other through $ORIGIN paths): the whole wheel is
# 229 MB unpacked, over what the GPU machine's file transfer carries.
# Usage: scripts/gpu/nixl_subset.sh WHEEL_DIR DEST_DIR   (WHEEL_DIR as scripts/test.sh unpacks it)
set -euo pipefail
src="$(cd "$1" && pwd)"
dst="$2"
mkdir -p "$dst"
roots=(
  .nixl_cu13.mesonpy.libs/libnixl_capi.so
  .nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so
  nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0
  nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0
  nixl_cu13.libs/ucx/libuct_cma.so.0.0.0
)
declare -A seen=()
for r in "${roots[@]}"; do
  for f in "$src/$r" $(ldd "$src/$r" | awk -v s="$src/" 'index($3, s) == 1 {print $3}'); do
    real="$(realpath "$f")"
    rel="${real#"$src"/}"
    [ -n "${seen[$rel]:-}" ] && continue
    seen[$rel]=1
    mkdir -p "$dst/$(dirname "$rel")"
    cp "$real" "$dst/$rel"
  done
done
# Keep the plugin where NIXL looks for it (beside libnixl.so, in plugins/).
echo "copied ${#seen[@]} files, $(du -sh "$dst" | cut -f1)"
