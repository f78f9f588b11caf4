"""Shared helpers of the deploy stages in tasks/: the host's rig data and plan, the host's
state read in two round trips, a refusal, a service kept running, the builds pruned.

pyinfra prepares each host by running deploy.py for it; the rig data and plan are kept per host
so that every stage reads the one validated copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pyinfra import host, logger, state
from pyinfra.api.exceptions import DeployError
from pyinfra.api.operation import OperationMeta
from pyinfra.connectors.local import LocalConnector
from pyinfra.facts.files import Directory, File, FileContents, Link
from pyinfra.facts.git import GitLocalCommit
from pyinfra.facts.server import Arch, KernelVersion, LinuxDistribution

from llamarig import operations
from llamarig.config import ConfigError, rig_data
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.gateways import runs_gateway
from llamarig.config.lock import LockError, lock_path, resolved
from llamarig.converge import boot
from llamarig.facts.apt import AptListsAge, PackageVersions
from llamarig.facts.build import BuildDirectories, CpuFlags, MissingCommands
from llamarig.facts.cache import known, prefetch
from llamarig.facts.driver import DriverBuildFailure, FirmwareBoot
from llamarig.facts.files import FileIdentity, FileState, JsonFile, RecordedSha256
from llamarig.facts.gpu import MeasuredOverheads, NvidiaPciDevices, NvidiaSmiGpus
from llamarig.facts.server import RunningService
from llamarig.facts.systemd import UnitState
from llamarig.model.catalog import is_router, served_data
from llamarig.model.files import model_files
from llamarig.model.reference import HubError, hub_token_file
from llamarig.onhost import checksums, deploy_record, hostpaths
from llamarig.operations.rotation import Rotation
from llamarig.planner import fleet, gateway, render
from llamarig.planner.gather import plan_for
from llamarig.planner.host_plan import HostPlan
from llamarig.tables.packages import BUILD_DEPENDENCIES, DKMS_SOURCES, build_tools
from llamarig.tables.text import printable

_rigs: dict[str, dict] = {}
_plans: dict[str, HostPlan] = {}
# The headers each host's plan read from the model's files: (key, header), and the declared
# records they replace.
_headers_read: dict[str, tuple[list, list]] = {}


def rig() -> dict:
    """The validated rig data of the host being prepared, a Hugging Face reference resolved
    (on this machine, through models.lock.yml) into the URL and sha256 the download uses."""
    if host.name not in _rigs:
        deploy_record.register(state)
        try:
            data = rig_data(host.data.dict())
        except ConfigError as error:
            refuse(error.problems)
        try:
            unresolved = data["role"] in ("rpc-worker", *SERVES_NO_MODEL)  # no model to resolve
            _rigs[host.name] = data if unresolved else resolved(data)
        except HubError as error:
            refuse([f"{'.'.join(error.key_path)}: {error.message}"])
    return _rigs[host.name]


def gateway_only() -> bool:
    """True for a host that serves no model, only the team endpoint (`role: gateway`): the
    stages of a rig (driver, build, model, server) leave it alone."""
    return rig()["role"] == "gateway"


def builder_only() -> bool:
    """True for a host of the `builders` group (`role: builder`): it builds llama.cpp for the
    rigs of the run and serves nothing; the stages of a rig but the build leave it alone."""
    return rig()["role"] == "builder"


def builds_only() -> bool:
    """True in a run that makes and keeps the builds and changes nothing that serves
    (LLAMARIG_BUILDS_ONLY=1: `llamarig rollout`'s first step); the stages after the build
    leave every host alone."""
    value = os.environ.get(fleet.BUILDS_ONLY_ENV, "")
    if value not in ("", "0", "1"):  # a full deploy where builds only were meant changes rigs
        refuse(
            [
                f"{fleet.BUILDS_ONLY_ENV} is {printable(repr(value))}: set it to 1 to make and "
                "keep the builds only, or unset it (or 0) for the whole deploy"
            ]
        )
    return value == "1"


def serves_no_model() -> bool:
    """True for a gateway alone or a builder: no driver, model, server or verify here."""
    return rig()["role"] in SERVES_NO_MODEL


def plan() -> HostPlan:
    """The plan of the host being prepared: its GPUs (nvidia-smi, else PCI ids) and the model's
    GGUF header (read from the model's URL, else from the file on the host)."""
    if host.name not in _plans:
        try:
            _plans[host.name], gathered = plan_for(host.name, rig(), known)
        except LockError as error:  # models.lock.yml: its message names the entry and the fix
            refuse([error.message])
        for warning in gathered.warnings:
            host.noop(printable(warning))
        _headers_read[host.name] = gathered.read, gathered.superseded
        if _plans[host.name].provisional:  # shown without -v: the unit may change later
            host.log_styled(_plans[host.name].provisional, fg="yellow", log_func=logger.warning)
    return _plans[host.name]


def record_headers() -> OperationMeta:
    """Record in models.lock.yml the model headers this host's plan read from the files, once
    the model stage has checked them (an operation after the downloads: a file that fails its
    sha256 leaves no record, and a dry run writes none)."""
    read, superseded = _headers_read.get(host.name, ([], []))
    return operations.record_headers(
        name="Record the model's GGUF header(s) in models.lock.yml (for plans made elsewhere)",
        lock=str(lock_path()),
        read=read,
        superseded=superseded,
    )


def read_system() -> None:
    """The facts preflight and the plan read (operating system, kernel, firmware, GPUs, the
    identity of a model file without a sha256, the key of its kept header), in one round trip."""
    data = rig()
    requests = [
        (LinuxDistribution, {}),
        (Arch, {}),
        (CpuFlags, {}),
        (KernelVersion, {}),
        (FirmwareBoot, {}),
        (NvidiaPciDevices, {}),
        (NvidiaSmiGpus, {}),
    ]
    if data["driver"]["source"] in DKMS_SOURCES:
        requests.append((DriverBuildFailure, {}))
    if data["llama_cpp"]["backend"] == "cuda":
        requests.append((MeasuredOverheads, {"path": hostpaths.OVERHEADS_DIR}))
        if data["role"] != "rpc-worker":
            files = [file for served in served_data(data) for file in model_files(served)]
            unchecked = [file.dest for file in files if not file.sha256]
            requests += [(FileIdentity, {"path": path}) for path in unchecked]
    prefetch(requests)


def read_managed_state() -> None:
    """What the stages' operations read of the files, packages, units and builds llamarig
    manages, in one round trip; on a run that changes nothing they read no more."""
    data = plan().resolved
    paths = render.layout(data)
    service = f"{data['server']['service']}.service"
    small_files = [paths["unit"], paths["env_file"], paths["launcher"], paths["rpc_unit"]]
    if is_router(data):  # the presets, and those that last served (what a reload unloads)
        small_files += [paths["presets"], f"{paths['last_good']}/presets"]
    if data["driver"]["source"] != "none" and data["kernel_modules"]["manage"]:
        small_files += [boot.BLACKLIST_PATH, boot.MODULES_LOAD_PATH]
    requests = [(FileState, {"path": path}) for path in small_files] + [
        (AptListsAge, {}),
        (Link, {"path": paths["current"]}),
        (JsonFile, {"path": paths["build_marker"]}),
        (File, {"path": f"{paths['build']}/CMakeCache.txt"}),  # compiled here, not shipped
        (GitLocalCommit, {"repo": paths["source"]}),
        (BuildDirectories, {"path": paths["builds"]}),
        (FileContents, {"path": f"{paths['last_good']}/current"}),
        *([(FileContents, {"path": f"{paths['last_good']}/presets"})] if is_router(data) else []),
        (RunningService, {"service": service, "model": paths["model"]}),
        (UnitState, {"unit": service}),
        (UnitState, {"unit": f"{data['rpc']['service']}.service"}),
    ]
    if data["llama_cpp"]["build_dependencies"] == "apt":
        requests.append((PackageVersions, {"packages": sorted(BUILD_DEPENDENCIES)}))
    else:
        tools = build_tools(data["llama_cpp"]["ccache"])
        requests.append((MissingCommands, {"commands": tools}))
    if data["cuda"]["source"] == "preinstalled":
        requests.append((File, {"path": render.nvcc_path(data)}))
    served = served_data(rig()) if data["role"] != "rpc-worker" else []
    if data["role"] != "rpc-worker":
        records = checksums.RECORD_DIRECTORY
        requests += [
            (RecordedSha256, {"path": shard.dest, "records": records})
            for model in served
            for shard in model_files(model)
        ]
        if any(not model["model"]["path"] for model in served):
            requests.append((Directory, {"path": data["paths"]["models"]}))
    # The key is copied when one is given (its mode and digest), else removed (it exists?).
    key_fact = FileState if data["server"]["api_key_file"] else File
    requests += [
        (key_fact, {"path": hostpaths.API_KEY_PATH}),
        (File, {"path": hostpaths.API_KEY_HEADER_PATH}),
    ]
    # The Hub token likewise: written while a model needs it, else removed (tasks/model.py).
    hub_token = any(hub_token_file(model["model"]) for model in served)
    requests.append((FileState if hub_token else File, {"path": hostpaths.HUB_TOKEN_HEADER_PATH}))
    if not is_router(data) and data["role"] != "rpc-worker":
        requests.append((File, {"path": paths["presets"]}))  # removed, if a router left it
    prefetch(requests)
    read_gateway_state()


def read_gateway_state() -> None:
    """What the gateway stage reads (its files, packages and unit), in one round trip."""
    if not runs_gateway(rig()):
        return
    paths = [
        hostpaths.HAPROXY_CONFIG,
        hostpaths.GATEWAY_USERS_MAP,
        hostpaths.GATEWAY_RIG_KEY_MAP,
        hostpaths.GATEWAY_MODELS_JSON,
        hostpaths.GATEWAY_TLS_PEM,
        hostpaths.GATEWAY_TLS_CERT,
    ]
    prefetch(
        [(FileState, {"path": path}) for path in paths]
        + [
            (PackageVersions, {"packages": sorted(gateway.PACKAGES)}),
            (UnitState, {"unit": gateway.SERVICE}),
        ]
    )


def refuse(problems: list[str]) -> None:
    """Stop before anything is changed, with every problem on its own line."""
    raise DeployError("\n".join(f"{host.name}: {problem}" for problem in problems))


def is_local() -> bool:
    """True for pyinfra's @local host, which llamarig never reboots."""
    return issubclass(host.connector_cls, LocalConnector)


def service_running(
    service: str,
    out_of_date: Callable[[], bool],
    why: str,
    drain_first: operations.Drain | None = None,
    rotation: Rotation | None = None,
) -> tuple[OperationMeta, OperationMeta]:
    """The unit enabled and running, restarted when ``out_of_date()`` (``why`` names the
    inputs) unless this run just started it, after the requests in flight on ``drain_first``
    (``operations.Drain``; None: no wait) finished, out of its gateways' ``rotation`` first
    (None: no gateway); returns the start and the restart."""
    started = operations.unit_running(name=f"{service} enabled and running", unit=service)
    restarted = operations.restart_service(
        name=f"Restart {service} ({why})",
        service=service,
        drain_first=drain_first,
        rotation=rotation,
        _if=lambda: out_of_date() and not started.did_change(),
    )
    return started, restarted


def prune_builds(data: dict) -> OperationMeta:
    """Delete the builds beyond ``keep_builds``, never the current one or the last that served."""
    paths = render.layout(data)
    return operations.prune_builds(
        name=f"Keep the newest {data['llama_cpp']['keep_builds']} builds",
        builds=paths["builds"],
        keep=data["llama_cpp"]["keep_builds"],
        current=paths["build"],
        last_good=(known(FileContents, path=f"{paths['last_good']}/current") or [None])[0],
    )
