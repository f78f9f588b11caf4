"""Which rig of a build key builds, and which get the build shipped (planner/fleet.py).

pyinfra prepares the hosts at once (one greenlet each) before it runs any operation; each rig
of this run tells its key, then waits until every other has told its own, so all agree: the
first rig of a key in the inventory's order builds it (as `llamarig plan` shows), unless the
control machine's cache already holds a sound copy, and every other rig of the key that lacks
it gets it shipped. Whether the builder's packing is needed is known only once the others have
decided, so it asks when it runs (`Share.needed`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import gevent
from pyinfra import host, logger, state
from pyinfra.api.exceptions import DeployError
from pyinfra.facts.files import File
from pyinfra.facts.server import Arch, LinuxDistribution

from llamarig.facts.build import CpuFlags
from llamarig.facts.cache import known
from llamarig.facts.files import JsonFile
from llamarig.onhost import build_archive
from llamarig.onhost.build_archive import CachedBuildError
from llamarig.planner import fleet, render
from llamarig.tables.text import printable

# The key each rig of this run told, the rigs that are to get each key's build shipped, each
# rig's share, and whether the cache held a sound build of a key when the run was prepared.
_keys: dict[str, fleet.BuildKey] = {}
_receivers: dict[str, list[str]] = {}
_shares: dict[str, Share] = {}
_cache_verdicts: dict[str, bool] = {}


@dataclass(frozen=True)
class Share:
    """How a rig gets its build: ``build`` (compiles it here, or compiled it before) or
    ``receive`` (shipped from ``source``: the cache or the rig that has it; also a rig whose
    build was shipped before), and whether it is its key's ``source_rig``, which keeps its
    build in the cache when another rig of the key needs it."""

    key: fleet.BuildKey
    how: str
    source: str = ""
    source_rig: bool = False

    def needed(self) -> bool:
        """Whether another rig of the key is to get this rig's build (asked at run time)."""
        return bool(_receivers.get(self.key.key))


def share(data: dict) -> Share:
    """The build share of the host being prepared; ``data``: its planned rig data."""
    if host.name in _shares:
        return _shares[host.name]
    key = fleet.build_key(data, known(LinuxDistribution), known(Arch), known(CpuFlags), host.name)
    paths = render.layout(data)
    complete = known(JsonFile, path=paths["build_marker"]) == render.build_manifest(data)
    # A build compiled here leaves CMake's tree beside bin/; a shipped one is bin/ alone.
    shipped_before = complete and not known(File, path=f"{paths['build']}/CMakeCache.txt")
    _keys[host.name] = key
    told = {name: _keys[name] for name in _every_rig_told()}
    first = fleet.sources(told)[host.name] or host.name  # the rule `llamarig plan` shows
    if not key.shared or complete:
        how, source = ("receive", "") if shipped_before else ("build", "")
    elif _cache_holds(key.key):
        how, source = "receive", "the control machine's cache"
    elif first != host.name:
        how, source = "receive", first
    else:
        how, source = "build", ""
    if how == "receive" and not complete:
        _receivers.setdefault(key.key, []).append(host.name)
    source_rig = key.shared and first == host.name and (complete or how == "build")
    result = Share(key, how, source, source_rig)
    _shares[host.name] = result
    return result


# How long a rig waits for the others to tell their keys: they read a few facts first.
TELL_TIMEOUT_S = 600


def _every_rig_told() -> list[str]:
    """The rigs of this run in the inventory's order, once each has told its key (a gateway
    alone builds nothing and tells none)."""
    deadline = time.monotonic() + TELL_TIMEOUT_S
    while True:
        rigs = [
            other.name
            for other in state.inventory
            if other in state.active_hosts and other.data.get("role") != "gateway"
        ]
        waiting = [name for name in rigs if name not in _keys]
        if not waiting:
            return rigs
        if time.monotonic() > deadline:
            late = ", ".join(waiting)
            raise DeployError(f"{host.name}: {late} told no build key in {TELL_TIMEOUT_S} s")
        gevent.sleep(0.05)


def _cache_holds(key: str) -> bool:
    """Whether the cache holds a sound build of ``key`` as the run is prepared, checked once
    per key (every file hashed); one that is there but not sound is named (it is replaced by a
    fresh one). Each rig's build is checked again before it is sent."""
    if key not in _cache_verdicts:
        _cache_verdicts[key] = _check_cache(key)
    return _cache_verdicts[key]


def _check_cache(key: str) -> bool:
    try:
        build_archive.verified(key)
    except CachedBuildError as error:
        if build_archive.entry(key).exists():
            host.log_styled(
                f"llamarig: the cached build {key} is refused: {printable(str(error))}; "
                "it is packed again from the rig that has it",
                fg="yellow",
                log_func=logger.warning,
            )
        return False
    return True
