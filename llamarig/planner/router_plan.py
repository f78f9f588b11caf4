"""A rig of several models (`models:`, llama-server's router mode): each model is planned as a
one-model rig (``plan.plan_host``), then the models that may be loaded at once are planned
together, each child process with its own reserve (CUDA context, workspaces).
"""

from llamarig.model.catalog import with_views
from llamarig.planner.host_plan import AtOnce, HostPlan, PlannedModel


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


def plan_router(name: str, data: dict, planned: list[PlannedModel]) -> HostPlan:
    """The plan of a rig of several models from each model's own plan (``planned``, in the
    order of `models:`): their problems named by model, and those loaded at once together."""
    at_once = loaded_at_once(planned, data["server"]["models_max"])

    def named(model: PlannedModel, lines: list[str]) -> list[str]:
        return [f"models[{model.view.index}] ({model.view.name}): {line}" for line in lines]

    first = planned[0].plan
    return HostPlan(
        host=name,
        resolved=with_views(data, [model.view for model in planned]),
        gpus=first.gpus,
        gpu_source=first.gpu_source,
        cuda_architectures=first.cuda_architectures,
        memory=None,
        errors=[e for m in planned for e in named(m, m.plan.errors)] + at_once.problems,
        warnings=[w for m in planned for w in named(m, m.plan.warnings)],
        notes=[n for m in planned for n in named(m, m.plan.notes)],
        blind=[line for model in planned for line in named(model, model.plan.blind)],
        blind_reason=next((m.plan.blind_reason for m in planned if m.plan.blind), ""),
        models=planned,
        at_once=at_once,
    )
