#!/usr/bin/env bash
# Sourced by install-deps.sh and vm-deps.sh: install the given Debian packages that are missing,
# quietly when all are present.
#
#   apt_install_missing TAG PACKAGE...
#
# TAG prefixes the messages. Not root and something missing: say what and how, return 1.

apt_install_missing() {
  local tag=$1
  shift
  local missing=() p
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "$tag: missing Debian packages: ${missing[*]}" >&2
    echo "$tag: run as root, or: sudo apt-get install ${missing[*]}" >&2
    return 1
  fi
  echo "$tag: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # tshark asks whether non-root users may capture; the answer does not matter to us (root).
  echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
