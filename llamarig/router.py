"""The plan of a rig of several models (`models:`, llama-server's router mode): each model
planned on the rig's GPUs as a one-model rig, then the models that may be loaded at once
planned together, each child process with its own reserve (CUDA context, workspaces)."""

from __future__ import annotations

from dataclasses import dataclass

from llamarig.model.catalog import ModelView


@dataclass(frozen=True)
class PlannedModel:
    """One model of the rig with its own plan (a ``plan.HostPlan``)."""

    view: ModelView
    plan: object

    @property
    def device_mib(self) -> dict[str, int]:
        """MiB this model's process holds per GPU (its buffers and its reserve)."""
        memory = self.plan.memory
        return {d.name: d.planned_mib for d in memory.devices} if memory else {}


@dataclass(frozen=True)
class AtOnce:
    """The models that may be loaded at once and what they need together, per GPU."""

    names: list[str]
    # name -> (planned MiB of all of them, with the margin, of how many the GPU has)
    devices: dict[str, tuple[int, int, int]]
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems and all(need <= have for _, need, have in self.devices.values())

    def table(self) -> str:
        lines = [f"loaded at once (worst case): {', '.join(self.names)}"]
        if self.devices:
            width = max(len("GPU"), *(len(name) for name in self.devices)) + 2
            lines.append(f"{'GPU':<{width}}{'planned':>9}{'need':>8}{'have':>8}{'deficit':>9}")
            for name, (planned, need, have) in self.devices.items():
                deficit = max(0, need - have)
                lines.append(f"{name:<{width}}{planned:>9}{need:>8}{have:>8}{deficit:>9}")
        return "\n".join(lines)


def loaded_at_once(models: list[PlannedModel], models_max: int | None) -> AtOnce:
    """The worst case the router may reach: the models loaded at startup, then the largest of
    the others, up to ``models_max`` (None: all); their GPU memory summed per GPU, the safety
    margin counted once."""
    most = models_max or len(models)
    startup = [m for m in models if m.view.load_on_startup]
    problems = []
    if len(startup) > most:
        problems.append(
            f"server.models_max is {most}, but {len(startup)} models load at startup "
            f"({', '.join(m.view.name for m in startup)}): raise models_max or set "
            "load_on_startup: false on some"
        )
    others = sorted(
        (m for m in models if not m.view.load_on_startup),
        key=lambda m: sum(m.device_mib.values()),
        reverse=True,
    )
    chosen = (startup + others)[: max(most, len(startup))]
    devices: dict[str, tuple[int, int, int]] = {}
    for model in chosen:
        memory = model.plan.memory
        for device in memory.devices if memory else []:
            planned, _, _ = devices.get(device.name, (0, 0, device.vram_mib))
            planned += device.planned_mib
            devices[device.name] = (planned, planned + device.margin_mib, device.vram_mib)
    at_once = AtOnce([m.view.name for m in chosen], devices, problems)
    short = [
        f"{name} lacks {need - have} MiB ({need} needed, {have} there)"
        for name, (_, need, have) in devices.items()
        if need > have
    ]
    if short:
        problems.append(
            f"the models that may be loaded at once ({', '.join(at_once.names)}) do not fit "
            f"together: {'; '.join(short)}; lower server.models_max, a model's ctx or "
            "parallel, or serve fewer models"
        )
    return at_once


def preset_sections_of(lines: list[str]) -> dict[str, list[str]]:
    """The sections of a presets file llamarig wrote (``render.render_presets``), each model's
    name with its option lines as written."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in (line.strip() for line in lines):
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is not None and line and not line.startswith(";"):
            current.append(line)
    return sections


def unloaded_by_reload(served: list[str] | None, new: str) -> list[str]:
    """The models a router unloads when it reads the presets ``new`` in place of ``served``
    (the lines of the presets it serves; None: not known, so every one of them may be): those
    whose section changed or is gone, as llama-server's reload decides (server-models.cpp)."""
    wanted = preset_sections_of(new.splitlines())
    if served is None:
        return list(wanted)
    return [
        name for name, options in preset_sections_of(served).items() if wanted.get(name) != options
    ]
