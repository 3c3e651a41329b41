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
  dbus libglib2.0-bin iproute2 nftables util-linux systemd strace openssl
  # `cc` and libc headers: bench/_ceiling.py compiles bench/ceiling.c (the smoke test's ceiling
  # row); gcc only recommends libc6-dev, and recommends are not installed
  gcc libc6-dev
  # peer detection (make bpf, tests/bpf): clang builds the eBPF object against libbpf-dev's
  # headers, libbpf1 loads it at run time, bpftool checks attachment in the tests
  clang libbpf-dev bpftool tcpdump
)

. "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"
apt_install_missing install-deps "${PKGS[@]}"
