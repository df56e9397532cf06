# Sourced by the GPU scripts: puts CUDA's run-time libraries (NVRTC, cuBLAS, the CUDA runtime that NIXL's
# UCX CUDA modules link) on LD_LIBRARY_PATH, from the CUDA toolkit or from PyTorch's nvidia wheels.
cuda_libdirs="$(python3 - <<'PY'
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))):
        if any(glob.glob(os.path.join(d, p)) for p in ("libnvrtc.so*", "libcublas*.so*", "libcudart.so*")):
            dirs.append(d)
print(":".join(dirs))
PY
)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${cuda_libdirs}:${LD_LIBRARY_PATH:-}"
