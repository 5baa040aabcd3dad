#!/usr/bin/env bash
# Installs etcd (Debian's etcd-server) for the etcd membership tests, when it is missing
# and apt can install it (root, apt-get present). Never fails: without etcd those tests
# skip, saying why. TE_ETCD=skip leaves it alone.
set -uo pipefail
[ "${TE_ETCD:-}" = "skip" ] && exit 0
command -v etcd >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_etcd: etcd not installed and apt-get unavailable here; etcd tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# the package tries to start a system service; policy-rc.d or no init keeps it from that
if ! timeout 120 apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1; then
    timeout 120 apt-get update -qq >/dev/null 2>&1
    timeout 180 apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1 \
        || echo "setup_etcd: could not install etcd-server; etcd tests will skip" >&2
fi
exit 0
