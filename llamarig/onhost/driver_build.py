"""A DKMS build of the NVIDIA driver that failed, remembered on the host: the next deploy that
would install the same package version for the same running kernel refuses before it installs
anything, instead of spending minutes on a build that fails the same way. A new package version
(the distribution fixed it) or another running kernel tries the build again by itself."""

from __future__ import annotations

from dataclasses import dataclass

from llamarig.onhost.hostpaths import DRIVER_BUILD_FAILURE_PATH, DRIVER_INSTALL_LOG

# The record's keys, one `key=value` line each (written by operations.driver_packages).
RECORD_KEYS = ("package", "version", "kernel", "kernels", "error")
# What a user can do about a packaged driver that does not build, said on failure and refusal.
WAY_OUT = "Use driver.source nvidia-repo, or a kernel this packaged driver supports"


@dataclass(frozen=True)
class BuildFailure:
    """What failed: the DKMS package and its version, the running kernel, the kernels whose
    headers it was built against, and the compiler's first error line."""

    package: str
    version: str
    kernel: str
    kernels: str
    error: str


def parse_record(lines: list[str]) -> BuildFailure | None:
    """The record's lines as a BuildFailure; None for no record, or one missing a key that
    identifies the build (a file llamarig did not write is never trusted)."""
    values = {}
    for line in lines:
        key, separator, value = line.partition("=")
        if separator and key in RECORD_KEYS:
            values.setdefault(key, value.strip())
    if not all(values.get(key) for key in ("package", "version", "kernel")):
        return None
    return BuildFailure(**{key: values.get(key, "") for key in RECORD_KEYS})


def refusal(
    failure: BuildFailure | None, package: str | None, candidate: str | None, kernel: str
) -> str | None:
    """Why this deploy does not try ``package`` (apt's ``candidate`` version) again on the
    running ``kernel``: the recorded failure of that very build; None when nothing recorded
    matches it."""
    if failure is None or package is None:
        return None
    if (failure.package, failure.version, failure.kernel) != (package, candidate, kernel):
        return None
    error = failure.error or f"see {DRIVER_INSTALL_LOG}"
    return (
        f"the last deploy's DKMS build of {package} {candidate} failed for kernel(s) "
        f"{failure.kernels or kernel}: {error}. Not tried again, nothing was installed: it "
        "fails the same way until the package's version or the running kernel changes "
        f"(either tries the build again by itself). {WAY_OUT}; to try this build again "
        f"anyway, remove {DRIVER_BUILD_FAILURE_PATH} on the host."
    )
