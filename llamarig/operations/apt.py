"""apt: packages installed without prompts, the lists refreshed when stale, and the NVIDIA
driver's packages with their DKMS build."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import (
    operation,
)
from pyinfra.facts.apt import noninteractive_apt

from llamarig.facts.apt import AptListsAge, PackageVersions
from llamarig.facts.cache import known
from llamarig.onhost.driver_build import WAY_OUT
from llamarig.onhost.hostpaths import (
    APT_UPDATE_STAMP,
    DRIVER_BUILD_FAILURE_PATH,
    DRIVER_INSTALL_LOG,
    STATE_DIRECTORY,
)


@operation()
def driver_packages(packages: list[str], dkms_package: str | None = None):
    """
    Install NVIDIA driver packages with apt; when the DKMS module does not build, say why in one
    message and leave apt and dpkg consistent (the half-configured driver packages are purged).

    + packages: the driver packages (with the kernel headers)
    + dkms_package: the package whose DKMS build can fail, e.g. ``nvidia-open-kernel-dkms``

    **Example:**

    .. code:: python

        driver_packages(
            packages=["nvidia-open-kernel-dkms", "nvidia-driver", "linux-headers-amd64"],
            dkms_package="nvidia-open-kernel-dkms",
        )
    """
    installed = known(PackageVersions, packages=sorted(packages))
    missing = [package for package in packages if installed.get(package) is None]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    names = " ".join(shlex.quote(package) for package in packages)
    dkms = shlex.quote(dkms_package or "")
    dkms_name = shlex.quote(dkms_package or "the driver")
    record = shlex.quote(DRIVER_BUILD_FAILURE_PATH)
    # The record names a DKMS build that failed (a make.log written by this install, with a
    # compiler error), never a download or dpkg failure: the next deploy refuses that build.
    yield f"""
export DEBIAN_FRONTEND=noninteractive
log={shlex.quote(DRIVER_INSTALL_LOG)}
started=$(mktemp)
if ! apt-get install -y --no-install-recommends {names} > $log 2>&1; then
  make_log=$(find /var/lib/dkms -path '*/build/make.log' -newer "$started" 2>/dev/null | head -1)
  kernels=$(ls -d /lib/modules/*/build 2>/dev/null | cut -d/ -f4 | paste -sd' ')
  build_error=$(grep -m1 -E 'error:' "$make_log" 2>/dev/null)
  error=${{build_error:-$(grep -m1 -iE 'error' $log)}}
  version=$(dpkg-query -W -f='${{Version}}' {dkms} 2>/dev/null)
  # Remove what could not be configured, so apt and dpkg stay usable.
  apt-get purge -y {names} >> $log 2>&1 || true
  dpkg --configure -a >> $log 2>&1; apt-get -f install -y >> $log 2>&1
  remembered=""
  if [ -n "$build_error" ] && [ -n "$version" ]; then
    mkdir -p {shlex.quote(STATE_DIRECTORY)}
    printf '%s\\n' package={dkms} "version=$version" "kernel=$(uname -r)" \\
      "kernels=$kernels" "error=$build_error" > {record}
    remembered=" The next deploy refuses this build before installing anything until the \\
package's version or the running kernel changes (remove {record} to try it again)."
  fi
  rm -f "$started"
  printf 'llamarig: the NVIDIA driver did not install: %s ' {dkms_name} >&2
  echo "$version" \\
    "failed to build its kernel module for kernel(s) $kernels: $error." \\
    "The driver packages were removed again (apt and dpkg are consistent; full log: $log)." \\
    {shlex.quote(WAY_OUT)}".$remembered" >&2
  exit 1
fi
rm -f "$started" {record}
""".strip()


@operation()
def apt_packages(packages: list[str], no_recommends: bool = False):
    """
    Install the packages of ``packages`` that are missing, with apt-get as pyinfra's
    ``apt.packages`` runs it (non-interactive, keeping changed configuration files); reads only
    these packages' state (``dpkg-query``), never a listing of every installed package.

    + packages: names, or ``name=version`` to pin a version
    + no_recommends: don't install recommended packages

    **Example:**

    .. code:: python

        apt_packages(packages=["cmake", "ninja-build"], no_recommends=True)
    """
    wanted = [package.partition("=") for package in packages]
    installed = known(PackageVersions, packages=sorted({name for name, _, _ in wanted}))
    missing = [
        package
        for package, (name, pinned, version) in zip(packages, wanted, strict=True)
        if installed.get(name) is None or (pinned and installed[name] != version)
    ]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    install = "install --no-install-recommends" if no_recommends else "install"
    yield f"{noninteractive_apt(install)} {' '.join(shlex.quote(p) for p in missing)}"


@operation()
def apt_lists_fresh(max_age: int = 3600):
    """
    ``apt-get update`` when the lists are older than ``max_age`` seconds (or were never
    updated through the stamp), as pyinfra's ``apt.update(cache_time=max_age)`` does, from one
    fact rather than two.

    + max_age: seconds the lists stay fresh

    **Example:**

    .. code:: python

        apt_lists_fresh(max_age=3600)
    """
    age = known(AptListsAge)
    if age is not None and age < max_age:
        host.noop("apt is already up to date")
        return
    yield "apt-get update"
    yield f"touch {APT_UPDATE_STAMP}"
