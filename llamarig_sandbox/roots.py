"""The Debian roots a sandbox boots: the host tools that build them, each release's pristine
base root (mmdebstrap, built once, never booted), and the working copy of it a sandbox boots,
given its name, SSH access and caches (apt archives and ccache shared across sandboxes)."""

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from llamarig_sandbox.layout import (
    APT_ARCHIVES_DIR,
    CCACHE_DIR,
    ROOTS_DIR,
    RUN_DIR,
    SANDBOX_CCACHE_PATH,
    lock,
    private_apt_archives,
    release_lock,
    sandbox_paths,
)
from llamarig_sandbox.processes import SandboxError, log_tail, remove_tree, run, say
from llamarig_sandbox.sshaccess import configure_sshd

RELEASES = ("trixie", "bookworm")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = (
    "systemd-sysv,udev,dbus,openssh-server,python3,ca-certificates,kmod,iproute2,curl,ccache"
)
# The compiler each release's kernel headers name (CC in their .kernelvariables): a sandbox
# runs it through ccache, so the DKMS builds of the heavy scenarios (bookworm, Secure Boot,
# trixie) share compiled objects across sandboxes and runs. The deploy's commands are the
# production ones: the box merely has a compiler cache in front of gcc, as a build host may.
KERNEL_COMPILERS = {"trixie": "gcc-14", "bookworm": "gcc-12"}

# A working root on a tmpfs (see roots_in_memory): on hosts with at least 20 GiB, each root
# capped at 12 GiB. The converged bookworm rig, with Debian's driver, CUDA toolkit, DKMS build
# and llama.cpp, takes 7.2 GiB, and a trixie rig beside it 1.2 (a CI run, 2026-12-06).
ROOTS_IN_MEMORY_MIN_KIB = 20 * 1024 * 1024
ROOT_TMPFS_SIZE = "12g"

# Host commands the sandbox needs, and the Debian package providing each.
HOST_COMMANDS = {
    "mmdebstrap": "mmdebstrap",
    "systemd-nspawn": "systemd-container",
    "git": "git",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
}


def hosts_file(name: str) -> str:
    """/etc/hosts for a sandbox whose hostname is `name`."""
    return (
        "127.0.0.1\tlocalhost\n"
        f"127.0.1.1\t{name}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\tip6-allnodes\n"
        "ff02::2\tip6-allrouters\n"
    )


_STANZA_KEYWORDS = ("iface", "auto", "mapping", "source", "source-directory", "allow-")


def drop_dhcp_stanzas(interfaces: str) -> str:
    """Remove ifupdown `iface X inet dhcp` stanzas and the auto lines that bring them up.

    Inside a sandbox sharing the host's network, DHCP would make networking.service wait for
    minutes and then fail.
    """
    dhcp_interfaces = {
        words[1]
        for words in (line.split() for line in interfaces.splitlines())
        if len(words) >= 4 and words[0] == "iface" and words[3] == "dhcp"
    }
    kept: list[str] = []
    in_dropped_stanza = False
    for line in interfaces.splitlines(keepends=True):
        words = line.split()
        if not words or words[0].startswith("#"):
            kept.append(line)
            continue
        if words[0].startswith(_STANZA_KEYWORDS):
            in_dropped_stanza = False
        if words[0] == "iface" and words[1] in dhcp_interfaces:
            in_dropped_stanza = True
            continue
        if in_dropped_stanza:
            continue
        if words[0] == "auto" or words[0].startswith("allow-"):
            remaining = [word for word in words[1:] if word not in dhcp_interfaces]
            if not remaining:
                continue
            if len(remaining) < len(words) - 1:
                line = " ".join([words[0], *remaining]) + "\n"
        kept.append(line)
    return "".join(kept)


def link_debs(source: Path, target: Path) -> None:
    """Hard-link the .deb files of `source` that `target` lacks (one filesystem: no copies)."""
    target.mkdir(parents=True, exist_ok=True)
    for deb in source.glob("*.deb"):
        if not (target / deb.name).exists():
            try:
                os.link(deb, target / deb.name)
            except OSError:
                shutil.copy2(deb, target / deb.name)


def ensure_host_tools() -> None:
    """Install, with apt, the host packages whose commands are missing."""
    with lock("host-tools"):
        _install_host_tools()


def _install_host_tools() -> None:
    missing = sorted({pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    say(f"installing host packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update"], "apt-get update", env=env)
    run(
        ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        f"apt-get install {' '.join(missing)}",
        env=env,
    )


def ensure_base_root(release: str) -> Path:
    """Build the pristine root for `release` with mmdebstrap, once; return its path.

    It is built in `<release>.partial` and renamed when complete, so an interrupted build is
    started over rather than reused.
    """
    with release_lock(release):
        return _build_base_root(release)


def _build_base_root(release: str) -> Path:
    root = ROOTS_DIR / release
    if root.is_dir():
        return root
    partial = ROOTS_DIR / f"{release}.partial"
    log_path = ROOTS_DIR / f"{release}.log"
    remove_tree(partial)
    ROOTS_DIR.mkdir(parents=True, exist_ok=True)
    say(f"building the {release} base root with mmdebstrap (a minute; log {log_path})")
    started = time.monotonic()
    with open(log_path, "w") as log:
        result = subprocess.run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                # Kept as debootstrap kept them: a root boots with apt's lists in place.
                "--skip=cleanup/apt/lists",
                release,
                str(partial),
                DEBIAN_MIRROR,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if result.returncode != 0:
        raise SandboxError(
            f"mmdebstrap {release} failed (exit {result.returncode}): {log_tail(log_path, 1)}"
            f" (full log: {log_path})"
        )
    _drop_dhcp_config(partial)
    _write_machine_id(partial)
    partial.rename(root)
    say(f"{release} base root built in {time.monotonic() - started:.0f} s")
    return root


def _write_machine_id(root: Path) -> None:
    """Give the root the machine id debootstrap's systemd left: mmdebstrap leaves it empty,
    which makes a boot the first one (systemd's presets applied anew to every unit)."""
    (root / "etc/machine-id").write_text(f"{uuid.uuid4().hex}\n")


def _drop_dhcp_config(root: Path) -> None:
    network_dir = root / "etc/network"
    for config in [network_dir / "interfaces", *sorted(network_dir.glob("interfaces.d/*"))]:
        if config.is_file():
            text = config.read_text()
            cleaned = drop_dhcp_stanzas(text)
            if cleaned != text:
                config.write_text(cleaned)


def prepare_working_root(
    name: str, release: str, base_root: Path, ssh_port: int, in_memory: bool
) -> Path:
    """Copy the base root afresh (onto a tmpfs of its own if ``in_memory``) and configure its
    SSH access and identity."""
    root = sandbox_paths(name)["root"]
    remove_tree(root)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    if in_memory:
        run(
            ["mount", "-t", "tmpfs", "-o", f"mode=0755,size={ROOT_TMPFS_SIZE}", "tmpfs", str(root)],
            "mounting a tmpfs for the working root",
        )
    run(["cp", "-a", "--reflink=auto", f"{base_root}/.", str(root)], "copying the base root")

    configure_sshd(root, ssh_port)
    (root / "etc/hostname").write_text(f"{name}\n")
    (root / "etc/hosts").write_text(hosts_file(name))
    (root / SANDBOX_CCACHE_PATH.lstrip("/")).mkdir(parents=True, exist_ok=True)
    _cache_kernel_compiler(root, release)
    _quick_dpkg(root)
    for host_dir in (APT_ARCHIVES_DIR / release / "partial", CCACHE_DIR / release):
        host_dir.mkdir(parents=True, exist_ok=True)
    # Seeded from the release's shared archive; what it downloads goes back there on `down`.
    with release_lock(release):
        link_debs(APT_ARCHIVES_DIR / release, private_apt_archives(name))
    (private_apt_archives(name) / "partial").mkdir(exist_ok=True)
    return root


def roots_in_memory(meminfo: Path = Path("/proc/meminfo")) -> bool:
    """Whether working roots go on a tmpfs of their own: on a host with the memory for it
    (ROOTS_IN_MEMORY_MIN_KIB), unless LLAMARIG_SANDBOX_ROOTS_ON_DISK is 1. A root is rebuilt,
    never repaired, so it need not survive the host; on ext4, every file a root's dpkg, git or
    compiler creates searched the inode bitmaps past the inodes of roots deleted just before
    (`recently_deleted`, a third of an apt install's CPU time)."""
    on_disk = os.environ.get("LLAMARIG_SANDBOX_ROOTS_ON_DISK", "")
    if on_disk not in ("", "0", "1"):
        raise SandboxError(
            f"LLAMARIG_SANDBOX_ROOTS_ON_DISK is {on_disk!r}: set it to 1 to keep the sandbox"
            " roots on disk, or to 0 (or leave it unset) to put them in memory"
        )
    if on_disk == "1":
        return False
    total_kib = int(meminfo.read_text().splitlines()[0].split()[1])  # "MemTotal: N kB"
    return total_kib >= ROOTS_IN_MEMORY_MIN_KIB


def _cache_kernel_compiler(root: Path, release: str) -> None:
    """Put ccache in front of the kernel headers' compiler (a masquerading link on PATH before
    /usr/bin) with its cache in the host's ccache directory. A root built before ccache was
    among the base packages is left as it is."""
    if not (root / "usr/bin/ccache").is_file():
        return
    (root / "etc/ccache.conf").write_text(f"cache_dir = {SANDBOX_CCACHE_PATH}\n")
    link = root / "usr/local/bin" / KERNEL_COMPILERS[release]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to("/usr/bin/ccache")
    # apt runs dpkg, and so the DKMS build of a driver package's postinst, with its own PATH
    # (DPkg::Path, /usr/sbin:/usr/bin:/sbin:/bin), which would skip the link: every such build
    # compiled all 192 objects afresh (108 s on a quiet 2-core machine).
    (root / "etc/apt/apt.conf.d/50llamarig-sandbox-ccache").write_text(
        'DPkg::Path "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";\n'
    )


def _quick_dpkg(root: Path) -> None:
    """dpkg without an fsync per unpacked file (as Debian's container images set it): a
    sandbox that dies is rebuilt from its base root, never repaired. Unpacking Debian's CUDA
    toolkit took 70 s with the fsyncs."""
    (root / "etc/dpkg/dpkg.cfg.d/llamarig-sandbox-unsafe-io").write_text("force-unsafe-io\n")
