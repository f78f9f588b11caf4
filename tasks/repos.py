"""Package repositories: NVIDIA's CUDA repository (keyring + deb822 source + branch pin) or the
distribution's non-free components, then one apt update when needed."""

from io import StringIO

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.server import LinuxDistribution
from pyinfra.operations import server
from pyinfra.operations.apt import APT_UPDATE_FILENAME

from llamarig import operations
from llamarig.config.gateways import runs_gateway
from llamarig.converge import stage
from llamarig.facts.apt import PackageVersions
from llamarig.facts.cache import known
from llamarig.planner import render
from llamarig.tables.platform import codename, is_debian, nvidia_repo_dir


@api.deploy("tasks/repos.py")
def deploy() -> None:
    rig = stage.rig()
    distribution = known(LinuxDistribution)
    # A gateway alone installs only HAProxy, from the distribution's own components; a builder
    # no driver, only the toolkit it builds with.
    gateway_only = stage.gateway_only()
    if gateway_only:
        sources = []
    elif stage.builder_only():
        sources = [rig["cuda"]["source"]]
    else:
        sources = [rig["driver"]["source"], rig["cuda"]["source"]]
    source_ops = []
    if "nvidia-repo" in sources:
        source_ops += _nvidia_repo(rig, distribution)
    if "distro" in sources and is_debian(distribution):
        source_ops.append(_debian_nonfree(distribution))
    _apt_lists(rig, sources, source_ops, gateway_only)


def _nvidia_repo(rig: dict, distribution: dict) -> list[OperationMeta]:
    """NVIDIA's CUDA repository: its keyring package, its deb822 source and the driver's
    branch pinned."""
    repo_dir = nvidia_repo_dir(distribution)
    keyring = rig["nvidia_repo"]["keyring_package"]
    installed = known(PackageVersions, packages=[keyring]).get(keyring)
    source_ops = []
    if installed != rig["nvidia_repo"]["keyring_version"]:
        source_ops.append(
            server.shell(
                name=f"Install {keyring} {rig['nvidia_repo']['keyring_version']}",
                commands=[render.keyring_install_command(rig, repo_dir)],
            )
        )
    # The keyring package also drops a one-line .list; the deb822 file below replaces it.
    source_ops.append(
        operations.absent(
            name="Remove the keyring package's duplicate source list",
            path=f"/etc/apt/sources.list.d/cuda-{repo_dir}-x86_64.list",
        )
    )
    source_ops.append(
        operations.atomic_file(
            name="NVIDIA CUDA repository (deb822, Signed-By its keyring)",
            src=StringIO(
                render.render_file(
                    "nvidia-cuda.sources.j2",
                    url=rig["nvidia_repo"]["url"],
                    distribution_dir=repo_dir,
                    keyring=render.NVIDIA_KEYRING,
                )
            ),
            dest="/etc/apt/sources.list.d/llamarig-nvidia-cuda.sources",
            mode="644",
        )
    )
    source_ops.append(
        operations.atomic_file(
            name=f"Pin the NVIDIA driver to branch {rig['driver']['branch']}",
            src=StringIO(render.render_file("apt-preferences.j2", branch=rig["driver"]["branch"])),
            dest="/etc/apt/preferences.d/llamarig-nvidia-driver",
            mode="644",
        )
    )
    return source_ops


def _debian_nonfree(distribution: dict) -> OperationMeta:
    """Debian's contrib and non-free components, which the distribution's NVIDIA packages come
    from."""
    return operations.atomic_file(
        name="Debian contrib and non-free components",
        src=StringIO(
            render.render_file(
                "debian-nonfree.sources.j2",
                mirror="http://deb.debian.org/debian",
                suite=codename(distribution),
            )
        ),
        dest="/etc/apt/sources.list.d/llamarig-debian-nonfree.sources",
        mode="644",
    )


def _apt_lists(
    rig: dict, sources: list[str], source_ops: list[OperationMeta], gateway_only: bool
) -> None:
    """The apt lists updated when a source changed, else when older than an hour; nothing when
    nothing is installed with apt."""
    apt_needed = (
        gateway_only
        or runs_gateway(rig)
        or "nvidia-repo" in sources
        or "distro" in sources
        or rig["llama_cpp"]["build_dependencies"] == "apt"
    )
    if not apt_needed:
        host.noop("nothing to install with apt (preinstalled driver, toolkit and build tools)")
    elif any(operation.will_change for operation in source_ops):
        server.shell(
            name="Update apt lists (repositories changed)",
            # The stamp lets the next run's cache_time check see this update.
            commands=[
                "apt-get update",
                f"mkdir -p /var/lib/apt/periodic && touch {APT_UPDATE_FILENAME}",
            ],
        )
    else:
        operations.apt_lists_fresh(name="Update apt lists (older than an hour)", max_age=3600)
