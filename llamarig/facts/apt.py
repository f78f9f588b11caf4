"""apt: candidate versions, installed versions, the age of the package lists."""

from __future__ import annotations

import re
import shlex

from pyinfra.api import FactBase

from llamarig.onhost.hostpaths import (
    APT_UPDATE_STAMP,
)


class AptCandidates(FactBase):
    """The version apt would install of each package, None where it has none (not in the
    lists, or only a virtual name).

    .. code:: python

        {"linux-modules-nvidia-580-open-generic": "6.8.0-50.51", "nvidia-utils-580": None}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, packages: list[str]) -> str:
        return "".join(
            f"printf '%s ' {shlex.quote(package)}; "
            f"apt-cache policy {shlex.quote(package)} 2>/dev/null "
            "| sed -n 's/^ *Candidate: //p' | head -1; echo; "
            for package in packages
        )

    def process(self, output):
        candidates = {}
        for line in output:
            name, _, version = line.strip().partition(" ")
            if name:
                version = version.strip()
                candidates[name] = None if version in ("", "(none)") else version
        return candidates


class PackageVersions(FactBase):
    """The installed version of each of ``packages`` (``dpkg-query`` of those names only, not a
    listing of the whole system), None where it is not installed (or only its configuration
    files are left).

    + packages: the package names

    .. code:: python

        {"cmake": "3.31.6-2", "ninja-build": None}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return {}

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(package) for package in packages)
        # Unknown names make dpkg-query exit 1 after printing the known ones.
        show = "'${Package} ${db:Status-Abbrev} ${Version}\\n'"
        return f"dpkg-query -W -f={show} -- {names} 2>/dev/null; true"

    def process(self, output: list[str]) -> dict[str, str | None]:
        versions: dict[str, str | None] = {}
        for line in output:
            fields = line.split()
            if len(fields) == 3 and fields[1] in ("ii", "hi"):
                versions[fields[0].split(":", 1)[0]] = fields[2]
            elif fields:
                versions.setdefault(fields[0].split(":", 1)[0], None)
        return versions


class AptListsAge(FactBase):
    """Seconds since the last ``apt-get update`` that touched the stamp pyinfra's
    ``apt.update(cache_time=...)`` keeps, by the host's clock; None when there is no stamp.

    .. code:: python

        1234
    """

    def command(self) -> str:
        return (
            f"if [ -e {APT_UPDATE_STAMP} ]; then "
            f"echo $(( $(date +%s) - $(stat -c %Y {APT_UPDATE_STAMP}) )); fi"
        )

    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if re.fullmatch(r"-?\d+", text) else None
