"""The hosts of the `builders` group (`role: builder`): boxes that build llama.cpp for the rigs
of their distribution and serve nothing (planner/fleet.py decides which keys each makes). A
builder's compilers and CUDA toolkit must be llamarig's, or its builds could not be shared."""

from __future__ import annotations

from llamarig.config.hosts import HostConfig
from llamarig.config.problems import Problem, located

BUILDERS_GROUP = "builders"
# The roles with no model, server or driver of their own.
SERVES_NO_MODEL = ("gateway", "builder")


def builder_problems(hosts: dict[str, HostConfig], groups: dict[str, list[str]]) -> list[str]:
    """`role: builder` exactly for the hosts of the `builders` group; each problem located."""
    members = set(groups.get(BUILDERS_GROUP, []))
    problems = []
    for name, host_config in hosts.items():
        role = host_config.data["role"]
        if role == "builder" and name not in members:
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("role",),
                        f"is `builder`, but the host is not in the `{BUILDERS_GROUP}` group; "
                        f"list it under `all: children: {BUILDERS_GROUP}: hosts:`",
                        in_inventory=True,
                    ),
                )
            )
        elif name in members and role != "builder":
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("role",),
                        f"is `{role}`, but the host is in the `{BUILDERS_GROUP}` group, whose "
                        "hosts build for the rigs and serve nothing; set `role: builder` (a rig "
                        "that builds for the others of its key needs no group: the first rig "
                        "of a key builds it)",
                        in_inventory=True,
                    ),
                )
            )
    return problems


def settings_problems(data: dict) -> list[Problem]:
    """A builder's build settings that would key every build it makes to itself."""
    llama_cpp, problems = data["llama_cpp"], []
    if not llama_cpp["share_builds"]:
        problems.append(
            Problem(
                ("llama_cpp", "share_builds"),
                "is false on a builder, which builds only for other rigs; remove it (or the "
                "host from the `builders` group)",
            )
        )
    if llama_cpp["build_dependencies"] == "preinstalled":
        problems.append(
            Problem(
                ("llama_cpp", "build_dependencies"),
                "is `preinstalled` on a builder: builds made with compilers llamarig did not "
                "install are not shared; set build_dependencies: apt",
            )
        )
    if llama_cpp["backend"] == "cuda" and data["cuda"]["source"] in ("preinstalled", "none"):
        problems.append(
            Problem(
                ("cuda", "source"),
                f"is `{data['cuda']['source']}` on a builder whose llama_cpp.backend is cuda: "
                "it builds with a toolkit llamarig installs; set cuda.source: nvidia-repo or "
                "distro (the rigs' own), or llama_cpp.backend: cpu for a builder of CPU builds",
            )
        )
    return problems
