#!/usr/bin/env bash
# Install the Debian packages the suite needs, only those missing (quiet when all are present).
# Used by `make test`/`make demo`; safe to run again.
set -euo pipefail

# The Soft-RoCE VM of tests/vm (qemu, busybox, tcpdump, ...) has its own list.
bash "$(dirname "${BASH_SOURCE[0]}")/vm-deps.sh"

PKGS=(
  python3 python3-venv python3-pip
  python3-pyverbs python3-systemd rdma-core ibverbs-providers libibverbs-dev
  tshark
  dbus libglib2.0-bin iproute2 util-linux systemd strace openssl
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing Debian packages: ${missing[*]}" >&2
  echo "install-deps: run as root, or: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# tshark asks whether non-root users may capture; the answer does not matter to us (we run as root).
echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
