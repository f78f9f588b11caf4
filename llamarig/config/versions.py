"""Toolkit and driver choices against the declared GPUs: `hardware` finds what falls short
(the floors live there alone), this module words it with the key path to fix."""

from __future__ import annotations

from llamarig.config.problems import Problem
from llamarig.tables import hardware
from llamarig.tables.hardware import Shortfall, VersionFinding


def version_problems(data: dict) -> list[Problem]:
    """Toolkit and driver choices that cannot serve the declared GPUs (the plan checks the
    probed GPUs and the installed driver against the same findings)."""
    chosen = hardware.chosen_versions(data)
    if data["driver"]["source"] == "none":
        chosen["open_modules"] = None  # no driver of llamarig's to check
    findings = hardware.version_findings(
        [gpu["compute_capability"] for gpu in data["gpus"]],
        driver_version=None,  # the installed driver is the plan's to check
        **chosen,
    )
    names = {gpu["compute_capability"]: gpu["name"] for gpu in data["gpus"]}
    problems = (_worded(finding, data, names) for finding in findings)
    return [problem for problem in problems if problem]


def _worded(finding: VersionFinding, data: dict, names: dict[str, str]) -> Problem | None:
    """The finding with its key path and fix, or None for one the settings cannot fix (a
    capability newer than the table is for the plan to report)."""
    cuda_version = data["cuda"]["version"]
    gpus = ", ".join(names[cc] for cc in finding.capabilities)
    match finding.kind:
        case Shortfall.CUDA_TOO_OLD:
            cc = finding.capabilities[0]
            return Problem(
                ("cuda", "version"),
                f'"{cuda_version}" cannot build for {gpus} (compute {cc}, {finding.what}): it '
                f'needs CUDA {finding.needed} or newer; set `cuda.version: "{finding.needed}"` '
                "or newer",
            )
        case Shortfall.CUDA_DROPPED:
            return Problem(
                ("cuda", "version"),
                f'"{cuda_version}" dropped compute capability below '
                f'{hardware.CUDA13_MIN_CAPABILITY} ({gpus}); set `cuda.version: "12.9"`',
            )
        case Shortfall.NEEDS_OPEN_MODULES:
            return Problem(
                ("driver", "open"),
                f"`false` cannot drive {gpus}: Blackwell works only with the open kernel "
                "modules; set `driver.open: true`",
            )
        case Shortfall.OPEN_NEEDS_TURING:
            return Problem(
                ("driver", "open"),
                f"`true` (the open kernel modules) needs Turing (7.5) or newer, not {gpus}; set "
                "`driver.open: false` (the proprietary modules)",
            )
        case Shortfall.DISTRO_DRIVER:
            return Problem(
                ("driver", "source"),
                f"{hardware.DISTRO_DRIVER_NOTE} cannot drive {gpus} (Blackwell needs >= 570.26 "
                "with open modules); set `driver.source: nvidia-repo`",
            )
        case Shortfall.DISTRO_TOOLKIT:
            return Problem(
                ("cuda", "source"),
                f"{hardware.DISTRO_TOOLKIT_NOTE} cannot build for {gpus} (Blackwell needs CUDA "
                ">= 12.8); set `cuda.source: nvidia-repo`",
            )
    return None


def driver_branch_problems(data: dict) -> list[Problem]:
    """The branch llamarig installs must run the toolkit and every declared GPU."""
    driver, cuda = data["driver"], data["cuda"]
    if driver["source"] not in ("nvidia-repo", "distro") or data["llama_cpp"]["backend"] != "cuda":
        return []
    capabilities = [gpu["compute_capability"] for gpu in data["gpus"]]
    toolkit = cuda["version"] if cuda["source"] != "none" else None
    problems: list[Problem] = []
    for needed, what, _ in hardware.driver_floors(capabilities, toolkit):
        branch = hardware.parse_version(needed)[0]
        if driver["branch"] < branch:
            problems.append(
                Problem(
                    ("driver", "branch"),
                    f"{driver['branch']} is below what {what} needs (driver {needed} or "
                    f"newer): set `driver.branch: {max(branch, 580)}` (R580 is the long-term "
                    "branch)",
                )
            )
    return problems
