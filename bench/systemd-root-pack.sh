#!/bin/bash
# The container root of bench/systemd_h200.sh, built here (a machine that reaches Debian's
# mirror) and carried to the GPU machine (which reaches nothing): the sandbox's trixie base root
# (mmdebstrap minbase + systemd-sysv, udev, dbus, openssh-server, python3, ca-certificates,
# kmod, iproute2, curl) plus what `llama_cpp.build_dependencies: preinstalled` needs on the
# target's PATH (cc, c++, cmake, ninja, git; llama.cpp's build links libgomp1). Packed as tar.xz
# without documentation, locales, apt's lists and caches, or SSH host keys (each run makes its
# own), and without what a CMake + Ninja build of llama.cpp never runs (LTO, sanitizer runtimes,
# static C++ and C libraries, ctest/cpack, perl's modules, udev's hardware database): 73 MiB
# instead of 106, split into parts of 56 MiB, each small enough for one device call.
#
#   bash bench/systemd-root-pack.sh [OUT_DIR]     # as root; default .carry/systemd-root
set -euo pipefail
base=${BASE_ROOT:-/var/cache/llamarig/roots/trixie}
out=$(realpath -m "${1:-.carry/systemd-root}")
work=$(mktemp -d /tmp/systemd-root.XXXXXX)
R=$work/root
cleanup() {
  for mount in dev/pts dev proc; do umount "$R/$mount" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
cp -a "$base" "$R"
# apt in a chroot needs /proc (GUIDE §2) and warns without /dev/pts.
mount -t proc proc "$R/proc"
mount --bind /dev "$R/dev"
mount --bind /dev/pts "$R/dev/pts"
# No package may start a service in the chroot.
printf '#!/bin/sh\nexit 101\n' > "$R/usr/sbin/policy-rc.d"
chmod 755 "$R/usr/sbin/policy-rc.d"
chroot "$R" apt-get update -q
chroot "$R" env DEBIAN_FRONTEND=noninteractive apt-get install -q -y --no-install-recommends \
  gcc g++ cmake ninja-build git libgomp1
chroot "$R" apt-get clean
rm "$R/usr/sbin/policy-rc.d"
for mount in dev/pts dev proc; do umount "$R/$mount"; done
chroot "$R" dpkg-query -W -f '${Package} ${Version}\n' > "$work/packages.txt"
rm -f "$R"/etc/ssh/ssh_host_*
rm -rf "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/locale/* "$R"/usr/share/info/* \
  "$R"/var/cache/* "$R"/var/lib/apt/lists/*
gcc=$(chroot "$R" gcc -dumpversion)
rm -rf "$R"/usr/bin/*-lto-dump-* "$R"/usr/libexec/gcc/x86_64-linux-gnu/"$gcc"/lto1 \
  "$R"/usr/bin/ctest "$R"/usr/bin/cpack "$R"/usr/share/cmake-*/Help \
  "$R"/usr/lib/x86_64-linux-gnu/lib{asan,tsan,lsan,hwasan,ubsan}.so* \
  "$R"/usr/lib/gcc/x86_64-linux-gnu/"$gcc"/lib{asan,tsan,lsan,hwasan,ubsan}*.a \
  "$R"/usr/lib/gcc/x86_64-linux-gnu/"$gcc"/libstdc++{,exp}.a "$R"/usr/lib/x86_64-linux-gnu/libc.a \
  "$R"/usr/share/perl "$R"/usr/lib/x86_64-linux-gnu/perl "$R"/usr/lib/udev/hwdb.bin \
  "$R"/usr/lib/udev/hwdb.d
mkdir -p "$out"
rm -f "$out"/root.tar.xz.part-*
tar -C "$R" -cf - . | xz -T0 -9 | split -b 56M - "$out/root.tar.xz.part-"
cat "$out"/root.tar.xz.part-* | sha256sum | cut -d' ' -f1 > "$out/root.tar.xz.sha256"
cp "$work/packages.txt" "$out/packages.txt"
du -b "$out"/*
