#!/usr/bin/env bash
# Makes the certificates of deploy/compose/compose.tls.yaml in DIR (default deploy/compose/tls): a private
# CA (ca.crt; its key ca.key stays beside it, and compose.tls.yaml mounts it nowhere), the head's
# certificate (head.crt/head.key: its HTTPS API and its cluster links) and the workers' one
# (worker.crt/worker.key, shared by every replica). P-256 keys, valid DAYS days (default 365), each for
# server and client use.
#
# Every certificate carries `tandem-cluster`, the name peers check instead of the container addresses DNS
# discovery finds (TANDEM_CLUSTER_TLS_SERVER_NAME); the head's also carries head, localhost and 127.0.0.1
# (what API clients dial through the published port), the workers' prefill and decode.
#
# The containers run as uid 10001 (the images' user tandem). Run as root, the files are given to that
# user and the keys stay 0600; run as another user, the keys are made readable by all (0644) so the
# containers can read them: keep DIR on a host no one else logs into, or chown it to 10001 yourself.
#   deploy/compose/tls-certs.sh [DIR] [DAYS]
set -euo pipefail
dir="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tls}"
days="${2:-365}"
command -v openssl >/dev/null || { echo "tls-certs.sh: openssl is not installed" >&2; exit 1; }
mkdir -p "$dir"
cd "$dir"
umask 077

openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -keyout ca.key -out ca.crt -subj "/CN=tandem compose CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# leaf NAME SAN: NAME.key and NAME.crt, signed by the CA.
leaf() {
  local name="$1" san="$2" ext
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$name.key" -out "$name.csr" -subj "/CN=tandem $name" 2>/dev/null
  ext="$(mktemp)"
  printf '%s\n' "subjectAltName=$san" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth,clientAuth" >"$ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
    -days "$days" -extfile "$ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$ext"
}
leaf head "DNS:tandem-cluster,DNS:head,DNS:localhost,IP:127.0.0.1"
leaf worker "DNS:tandem-cluster,DNS:prefill,DNS:decode"

chmod 0644 ca.crt head.crt worker.crt
if [ "$(id -u)" = 0 ]; then
  chown 10001:10001 . ca.crt head.crt head.key worker.crt worker.key
  chmod 0700 .
else
  chmod 0644 head.key worker.key
  chmod 0755 .
fi
echo "certificates in $dir: ca.crt, head.crt/head.key, worker.crt/worker.key (valid $days days)"
