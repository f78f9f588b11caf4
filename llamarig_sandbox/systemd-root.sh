#!/bin/bash
# Boot a Debian root with systemd as PID 1 on the GPU machine (which has no systemd of its own), with
# the NVIDIA devices, the driver's libraries and the CUDA toolkit bound in. Seen working on the one-H200
# machine (driver 580.159.04, kernel 6.18, cgroup2); see GUIDE §8 for what ran inside and what was seen.
# A copy of shared/gpu/systemd-root.sh (which does not travel to the device machine), used by
# llamarig_sandbox/systemdroot.py; a root already unpacked at ROOT_DIR is booted as it is.
#
#   bash systemd-root.sh ROOT.tar.xz [EXTRA_DIR ...]   # each EXTRA_DIR is bind-mounted at the same path
#
# The root: an mmdebstrap root (the sandbox's cached base root) packed without usr/share/{doc,man,
# locale}, var/cache and var/lib/apt/lists (42 MB as tar.xz for trixie minbase + systemd + sshd + python3).
# A plain chroot does not work (systemd 257: "Failed to fork off sandboxing environment for executing
# generators: Protocol error"); pivot_root into a bind mount of the root does.
# Afterwards:  nsenter -t "$(pgrep -xo systemd)" -a -r -w systemctl status   (pgrep -f would also
#              match any shell whose command line holds the pattern)
# Its log:     dmesg (the script turns on printk_devkmsg so systemd's lines are not rate-limited).
# Stop it:     nsenter -t "$(pgrep -xo systemd)" -a -r -w systemctl poweroff
# Seen there too: a transient unit with DynamicUser, DevicePolicy=closed, DeviceAllow=char-nvidiactl and
# char-nvidia-uvm, ProcSubset=pid, ProtectProc=invisible runs `nvidia-smi -L`; without char-nvidiactl
# it fails (the device filter is enforced).
set -euo pipefail
archive=$1; shift
if pid=$(pgrep -xo systemd); then echo "systemd already up: pid $pid"; exit 0; fi
R=${ROOT_DIR:-/srv/root}
mkdir -p "$R"
[ -x "$R/lib/systemd/systemd" ] || xz -dc "$archive" | tar -x -C "$R"
cuda=$(readlink -f /usr/local/cuda)
mkdir -p "$R/usr/local/cuda" "$R/usr/local/nvidia" "$R/oldroot"
binds=""
for dir in "$@"; do mkdir -p "$R$dir"; binds+="mount --rbind $dir $R$dir"$'\n'; done
echo on > /proc/sys/kernel/printk_devkmsg
cat > /tmp/systemd-root-inner.sh <<IN
set -e
mount --make-rprivate /
mount --bind $R $R
mount --rbind $cuda $R/usr/local/cuda
mount --rbind /usr/local/nvidia $R/usr/local/nvidia
$binds
mount --rbind /dev $R/dev
mount --rbind /sys $R/sys
mount -t proc proc $R/proc
cd $R
pivot_root . oldroot
umount -l /oldroot
# Shared, as on a host booted by systemd or in systemd-nspawn: systemd mounts each unit's
# credentials (LoadCredential=) from a child mount namespace, which needs propagation; on the
# private root left by --make-rprivate, /run/credentials/UNIT never appears.
mount --make-rshared /
exec env container=gpu-systemd /lib/systemd/systemd --system --log-target=kmsg --log-level=info
IN
setsid unshare --pid --fork --mount --uts --ipc bash /tmp/systemd-root-inner.sh > /tmp/systemd-root.log 2>&1 < /dev/null &
for _ in $(seq 1 30); do
  pid=$(pgrep -xo systemd || true)
  [ -n "$pid" ] && nsenter -t "$pid" -a -r -w systemctl is-system-running 2>/dev/null | grep -qE "running|degraded" && { echo "systemd up: pid $pid"; exit 0; }
  sleep 1
done
echo "systemd did not come up; dmesg:"; dmesg | tail -20; exit 1
