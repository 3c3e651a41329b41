#!/usr/bin/env bash
# Debian packages the Soft-RoCE VM of tests/vm needs, installed only when missing (quiet when all
# are present). Called from tests/host/install-deps.sh; safe to run again.
#
#   qemu-system-x86  the emulator (TCG: the hosts' KVM cannot boot a stock kernel)
#   busybox-static   virtme-ng's initramfs
#   kmod             depmod for the unpacked kernel's modules, modprobe in the guest
#   file             virtme-ng reads the kernel version from the image with it
#   tcpdump          guest tests capture RoCEv2 (UDP 4791) on the virtio NICs
#   iproute2         `ip` and `rdma link add ... type rxe` in the guest
#   rdma-core ibverbs-providers python3-pyverbs   verbs (the rxe provider) for the guest tests
#   apt dpkg         `apt-get download` + `dpkg-deb -x` of linux-image-amd64 (tests/vm/kernel.py)
#   gcc-12 make patch xz-utils binutils libelf1
#                    build the patched rdma_rxe.ko out of tree against the unpacked
#                    linux-headers (tests/vm/kmod.py; Debian's 6.1 headers name gcc-12, and
#                    linux-kbuild's objtool links libelf)
# The guest shares the host's root filesystem, so everything it runs comes from this list.
# virtme-ng itself is a Python package: the `test` extra of pyproject.toml pins it.
set -euo pipefail

PKGS=(
  qemu-system-x86 busybox-static kmod file tcpdump iproute2
  rdma-core ibverbs-providers python3-pyverbs
  apt dpkg
  gcc-12 make patch xz-utils binutils libelf1
)

. "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"
apt_install_missing vm-deps "${PKGS[@]}"
