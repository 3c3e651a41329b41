#!/bin/sh
# Runs inside the systemd VM as smcd-vm-test.service (tests/systemd/harness.py writes the unit;
# the VM powers off when it ends). Argument: the checkout. systemd is PID 1 on the host's root,
# shared read-only: this script mounts the host's result directory
# (the vng --rwdir export, which only virtme's own init would mount), puts tmpfs-backed overlays
# on /usr, /etc, /var and the checkout so that `make install` can write where a real install
# writes, then runs the guest tests (tests/systemd/guest) with pytest.
set -u
# systemd's SuccessAction=poweroff does not end this VM (systemd thinks it runs in a container):
# power off with sysrq, as the Soft-RoCE guest does, whatever happens.
trap 'sync; echo o >/proc/sysrq-trigger' EXIT
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p" | head -n 1; }
out="/$(arg virtme_initmount0)"
fstype="$(arg virtme_initmount0_fstype)"
repo="$1"
echo "smcd-systemd-vm: results in $out ($fstype), checkout $repo"
# /tmp first (the result directory usually lives under the host's /tmp). A checkout under /tmp
# (CI clones anywhere) would vanish under that tmpfs: hold it by a bind mount, put it back after.
case "$repo" in
    /tmp/*) mkdir -p /run/smcd-vm-repo && mount --bind "$repo" /run/smcd-vm-repo ;;
esac
mount -t tmpfs -o mode=1777 tmpfs /tmp
case "$repo" in
    /tmp/*) mkdir -p "$repo" && mount --bind /run/smcd-vm-repo "$repo" ;;
esac
mkdir -p "$out"
if [ "$fstype" = virtiofs ]; then
    mount -t virtiofs virtme.initmount0 "$out"
else
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 virtme.initmount0 "$out"
fi || { echo "smcd-systemd-vm: cannot mount the result directory"; exit 1; }
log="$out/boot.log"
exec >>"$log" 2>&1
echo "boot.sh: $(date) uptime $(cut -d' ' -f1 /proc/uptime)"

modprobe overlay
rw=/run/smcd-vm-rw
mkdir -p "$rw" && mount -t tmpfs -o size=1500M,mode=0755 tmpfs "$rw"
for dir in /usr /etc /var "$repo"; do
    name=$(echo "$dir" | tr / _)
    mkdir -p "$rw/$name/upper" "$rw/$name/work"
    mount -t overlay overlay \
        -o "lowerdir=$dir,upperdir=$rw/$name/upper,workdir=$rw/$name/work" "$dir" \
        || { echo "boot.sh: overlay on $dir failed"; echo '{"setup_error": "overlay on '"$dir"' failed"}' >"$out/guest.json"; exit 1; }
done
# dbus-daemon and systemd read their configuration from the overlays from now on.
systemctl daemon-reload
# D-Bus activation gives up after service_start_timeout (25 s by default) without the name:
# smcd's start-up (Python imports, the BPF verifier) takes about that long under TCG on a loaded
# host, well under a second on hardware. The guest's bus waits longer; the path is the same.
cat >/etc/dbus-1/system.d/zz-smcd-vm-tcg.conf <<'XML'
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <limit name="service_start_timeout">180000</limit>
</busconfig>
XML
systemctl reload dbus.service

# A host's systemd makes every mount shared at boot, so that a service with a mount namespace
# of its own (smcd.service: PrivateMounts=, ProtectSystem=) receives what the host mounts later,
# such as the bind of a namespace `ip netns add` makes. This one believes it runs in a container
# (/.dockerenv on the shared root, see tests/systemd/harness.py) and, as systemd does there,
# leaves them private. Do what a host's systemd does, and record what was there before.
echo "boot.sh: container: $(systemd-detect-virt -c); / was $(findmnt -no PROPAGATION /)"
mount --make-rshared / || { echo "boot.sh: mount --make-rshared / failed"; exit 1; }

cd "$repo" || exit 1
# The wheelhouse was built on the host just before the boot; files of the tree edited since then
# or while the tests run (other work going on in the shared checkout) must not make the offline
# guest try to rebuild it: its stamp is dated a day ahead.
touch -d "@$(( $(date +%s) + 86400 ))" .cache/wheels/.complete build/bpf/smc_option.bpf.o
echo "{\"uptime_at_tests\": $(cut -d' ' -f1 /proc/uptime), \"systemd\": \"$(systemctl --version | head -n 1)\"}" >"$out/guest.json"
export HOME=/root PYTHONDONTWRITEBYTECODE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export SMCD_VM_REPORT="$out/results.jsonl" SMCD_SYSTEMD_VM_OUT="$out"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
"$repo/.venv/bin/python" -m pytest -p pytest_timeout -p no:cacheprovider \
    -p tests.vm.guest_report --rootdir "$repo" --confcutdir "$repo/tests/systemd/guest" \
    --timeout=240 -v "$repo/tests/systemd/guest" >"$out/guest-pytest.log" 2>&1
echo "boot.sh: pytest exited $? at uptime $(cut -d' ' -f1 /proc/uptime)"
journalctl -b --no-pager -o short-monotonic >"$out/journal.txt" 2>&1
sync
