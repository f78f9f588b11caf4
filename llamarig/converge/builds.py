"""Which host of a build key builds, and which rigs get the build shipped (planner/fleet.py).

pyinfra prepares the hosts at once (one greenlet each) before it runs any operation; each rig
of this run tells its key (and each builder what it can make), then waits until every other
has told, so all agree: the first builder that makes a key, else the first rig of the key in
the inventory's order, builds it (as `llamarig plan` shows), unless the control machine's cache
already holds a sound copy, and every other rig of the key that lacks it gets it shipped.
Whether the builder's packing is needed is known only once the others have decided, so it asks
when it runs (`Share.needed`)."""

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

# The key each rig of this run told and its planned data, what each builder told, the rigs that
# are to get each key's build shipped, each rig's share, and whether the cache held a sound
# build of a key when the run was prepared.
_keys: dict[str, fleet.BuildKey] = {}
_rig_data: dict[str, dict] = {}
_builders: dict[str, fleet.Builder] = {}
_receivers: dict[str, list[str]] = {}
_shares: dict[str, Share] = {}
_cache_verdicts: dict[str, bool] = {}


@dataclass(frozen=True)
class Share:
    """How a rig gets its build: ``build`` (compiles it here, or compiled it before) or
    ``receive`` (shipped from ``source``: the cache or the host that has it; also a rig whose
    build was shipped before), and whether it is its key's ``source_rig`` (a rig or a builder),
    which keeps its build in the cache when another rig of the key needs it. A builder's share
    carries ``data``: the planned data of the first rig of the key, which its build follows."""

    key: fleet.BuildKey
    how: str
    source: str = ""
    source_rig: bool = False
    data: dict | None = None

    def needed(self) -> bool:
        """Whether another rig of the key is to get this rig's build (asked at run time)."""
        return bool(_receivers.get(self.key.key))


def share(data: dict) -> Share:
    """The build share of the host being prepared; ``data``: its planned rig data."""
    if host.name in _shares:
        return _shares[host.name]
    key = fleet.build_key(data, known(LinuxDistribution), known(Arch), known(CpuFlags), host.name)
    paths = render.layout(data)
    complete = _complete(data)
    # A build compiled here leaves CMake's tree beside bin/; a shipped one is bin/ alone.
    shipped_before = complete and not known(File, path=f"{paths['build']}/CMakeCache.txt")
    _keys[host.name], _rig_data[host.name] = key, data
    first = _sources()[host.name] or host.name  # the rule `llamarig plan` shows
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
    result = Share(key, how, source, source_rig, data)
    _shares[host.name] = result
    return result


def builder_shares(data: dict) -> list[Share]:
    """The builds the builder being prepared (``data``: its validated data) makes for this run's
    rigs, a share each: to build (or built before), or nothing to do when the cache holds a
    sound copy it lacks."""
    _builders[host.name] = fleet.builder(
        host.name, data, known(LinuxDistribution), known(Arch), known(CpuFlags)
    )
    found = _sources()
    made = fleet.builds_of(host.name, _keys, found)
    shares = []
    for key_name, rigs in made.items():
        key, rig_data = _keys[rigs[0]], _rig_data[rigs[0]]
        if not _complete(rig_data) and _cache_holds(key_name):
            shares.append(Share(key, "receive", "the control machine's cache", data=rig_data))
        else:
            shares.append(Share(key, "build", source_rig=True, data=rig_data))
    return shares


def _complete(data: dict) -> bool:
    """Whether the host being prepared has the build of ``data`` (a rig's planned data) whole:
    its completion marker records the build's manifest."""
    return known(JsonFile, path=render.layout(data)["build_marker"]) == render.build_manifest(data)


def _sources() -> dict[str, str]:
    """Where each rig's build comes from (fleet.sources), once every host of this run told."""
    hosts = _every_host_told()
    rigs = [name for name in hosts if name in _keys]
    builders = [_builders[name] for name in hosts if name in _builders]
    told = {name: _keys[name] for name in rigs}
    return fleet.sources(told, {name: _rig_data[name] for name in rigs}, builders)


# How long a host waits for the others to tell: they read a few facts first.
TELL_TIMEOUT_S = 600


def _every_host_told() -> list[str]:
    """The rigs and builders of this run in the inventory's order, once each has told its key
    or what it makes (a gateway alone builds nothing and tells none)."""
    deadline = time.monotonic() + TELL_TIMEOUT_S
    while True:
        hosts = [
            other.name
            for other in state.inventory
            if other in state.active_hosts and other.data.get("role") != "gateway"
        ]
        waiting = [name for name in hosts if name not in _keys and name not in _builders]
        if not waiting:
            return hosts
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
