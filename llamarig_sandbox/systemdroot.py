"""A Debian root booted with systemd as PID 1 on a machine that has no systemd of its own (the
GPU machine, GUIDE §8), with the NVIDIA devices, the driver's libraries and the CUDA toolkit
bound in and sshd on a loopback port: the host of the GPU acceptance tests (tests/gpu) and of
the GPU benchmarks (bench/). `systemd-root.sh` beside this file boots it; the root itself is
packed by bench/systemd-root-pack.sh and carried in parts. Everything is an argument."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from llamarig.config.ssh import SshTarget
from llamarig_sandbox.roots import hosts_file
from llamarig_sandbox.sshaccess import known_hosts_line, sshd_dropin

BOOT_SCRIPT = Path(__file__).with_name("systemd-root.sh")
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class SystemdRoot:
    """The root at ``root_dir``, named ``host_name``; ``ssh`` the rig's ssh settings (port,
    key, known_hosts) its sshd and the control side use; ``binds`` the directories bound in at
    the same path (the models, the llama.cpp mirror)."""

    root_dir: Path
    host_name: str
    ssh: dict
    binds: tuple[Path, ...] = ()
    _systemd_pid: list[int] = field(default_factory=list)

    def unpack(self, parts_dirs: tuple[Path, ...], archive: Path) -> dict:
        """Join the archive's parts (checked against the packer's sha256, found in one of
        ``parts_dirs``) into ``archive`` and unpack it."""
        parts = {
            part.name: part
            for directory in parts_dirs
            if directory.is_dir()
            for part in directory.glob("root.tar.xz.part-*")
        }
        expected = next(
            (d / "root.tar.xz.sha256").read_text().split()[0]
            for d in parts_dirs
            if (d / "root.tar.xz.sha256").is_file()
        )
        digest = hashlib.sha256()
        with open(archive, "wb") as out:
            for name in sorted(parts):
                data = parts[name].read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"the root's parts {sorted(parts)} do not add up to its sha256")
        self.root_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xJf", str(archive), "-C", str(self.root_dir)], check=True)
        return {"parts": sorted(parts), "bytes": archive.stat().st_size}

    def unpacked(self) -> bool:
        return (self.root_dir / "lib/systemd/systemd").exists()

    def chroot(self, *command: str) -> None:
        subprocess.run(["chroot", str(self.root_dir), *command], check=True)

    def configure(self) -> None:
        """sshd on its own loopback port with this run's host keys; root's authorized key; the
        driver's and toolkit's libraries in ld.so's path; nvidia-smi on the PATH."""
        root, port = self.root_dir, self.ssh["port"]
        (root / "etc/ssh/sshd_config.d/llamarig.conf").write_text(sshd_dropin(port))
        (root / "etc/hostname").write_text(f"{self.host_name}\n")
        (root / "etc/hosts").write_text(hosts_file(self.host_name))
        self.chroot("ssh-keygen", "-A")
        key = Path(self.ssh["key"])
        key.parent.mkdir(parents=True, exist_ok=True)
        if not key.exists():
            self.chroot(
                "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llamarig-h200", "-f", "/tmp/k"
            )
            for suffix in ("", ".pub"):
                (root / f"tmp/k{suffix}").rename(f"{key}{suffix}")
        ssh_dir = root / "root/.ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        (ssh_dir / "authorized_keys").chmod(0o600)
        host_key = (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text()
        Path(self.ssh["known_hosts"]).write_text(known_hosts_line(host_key, port))
        self.library_paths()
        smi = root / "usr/local/bin/nvidia-smi"
        if not smi.is_symlink():
            smi.symlink_to("/usr/local/nvidia/bin/nvidia-smi")

    def library_paths(self) -> None:
        """The driver's and toolkit's libraries (bound in at boot) in ld.so's path."""
        (self.root_dir / "etc/ld.so.conf.d/llamarig-gpu.conf").write_text(
            "/usr/local/nvidia/lib64\n/usr/local/cuda/lib64\n"
        )

    def ssh_client(self, bin_dir: Path) -> str:
        """An OpenSSH client on the PATH (testinfra's ssh:// and `llamarig run` need one): the
        machine's own, else the root's with the root's libraries, by a wrapper in ``bin_dir``."""
        found = subprocess.run(["sh", "-c", "command -v ssh"], capture_output=True, text=True)
        if found.returncode == 0:
            return found.stdout.strip()
        wrapper = bin_dir / "ssh"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        libs, ssh = self.root_dir / "usr/lib/x86_64-linux-gnu", self.root_dir / "usr/bin/ssh"
        wrapper.write_text(
            "#!/bin/sh\n# The container root's OpenSSH client (this machine has none).\n"
            f'exec {libs}/ld-linux-x86-64.so.2 --library-path {libs} {ssh} "$@"\n'
        )
        wrapper.chmod(0o755)
        os.environ["PATH"] = f"{wrapper.parent}:{os.environ['PATH']}"
        return str(wrapper)

    def boot(self, archive: Path, log: Path) -> float:
        """Boot it (a root already up is left as it is); its seconds."""
        start = time.monotonic()
        with open(log, "w") as out:
            subprocess.run(
                ["bash", str(BOOT_SCRIPT), str(archive), *(str(b) for b in self.binds)],
                env={**os.environ, "ROOT_DIR": str(self.root_dir)},
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
            )
        self.run("ldconfig")
        return round(time.monotonic() - start, 1)

    def systemd_pid(self) -> int:
        """PID (in the machine's namespace) of the root's systemd: the oldest `systemd`."""
        if not self._systemd_pid:
            output = subprocess.check_output(["pgrep", "-xo", "systemd"], text=True)
            self._systemd_pid.append(int(output.split()[0]))
        return self._systemd_pid[0]

    def run(self, command: str, check_rc: bool = True, timeout: float = 600):
        """A shell command as root in all of the root's namespaces."""
        result = subprocess.run(
            ["nsenter", "-t", str(self.systemd_pid()), "-a", "-r", "-w", "/bin/sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": CONTAINER_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
        )
        if check_rc and result.returncode:
            raise RuntimeError(
                f"in the container: {command} exited {result.returncode}\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        return result

    def wait_for_ssh(self, timeout: float = 60) -> float:
        """Until sshd answers with the pinned host key (strict checking, as the deploy does)."""
        start = time.monotonic()
        while True:
            probe = subprocess.run(
                [*SshTarget.of(self.ssh).argv(), "true"], capture_output=True, text=True, timeout=30
            )
            if probe.returncode == 0:
                return round(time.monotonic() - start, 1)
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"ssh to the container failed: {probe.stderr.strip()}")
            time.sleep(1)
