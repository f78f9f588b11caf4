"""The rig plan: from rig data, the GPUs (declared or probed) and the model's GGUF header, work
out the CUDA architectures, the version checks, the per-GPU memory, the tensor split and the
context, and the final cmake and llama-server arguments.

The deploy (tasks/preflight.py refuses a plan with errors; the build and server stages write
its arguments) and `llamarig plan` use this one code path.
"""

from __future__ import annotations

import copy
import dataclasses

from llamarig.model.gguf import GgufHeader
from llamarig.planner import render
from llamarig.planner.host_plan import HostPlan
from llamarig.planner.memory import (
    TENSOR_SPLIT_UNSUPPORTED,
    Device,
    MemoryPlan,
    default_reserve_mib,
    plan_memory,
)
from llamarig.planner.placement import CTX_PAD, kv_cells
from llamarig.tables.hardware import (
    check_versions,
    chosen_versions,
    memory_bandwidth_gbs,
    pci_sort_key,
    same_gpu_name,
)
from llamarig.tables.llama_args import CUDA_FA_KV_TYPES
from llamarig.tables.text import printable

# llama.cpp's default --spec-draft-n-max at the pinned commit (common/common.h).
DEFAULT_DRAFT_MAX = 3

TENSOR_MODE_LIMITS = (
    "tensor mode rounds each split point to a block, so the real split drifts from the ratio; "
    "keep the per-GPU margin (planner.margin_mib) and test with a long-context request",
    "the MTP draft context is allocated last: a card that is nearly full fails at the very "
    "end of loading",
    "three or more GPUs crashed in ggml-backend-meta at some builds (llama.cpp #26837)",
)

VRAM_TOLERANCE = 0.05


def choose_split_mode(data: dict, n_gpus: int | None, header: GgufHeader | None) -> tuple[str, str]:
    """The split mode llama-server gets and why: ``server.split_mode`` unless it is ``auto``,
    then the fastest mode this rig can run. ``n_gpus``: the GPUs the model is split over (None:
    not known yet)."""
    server = data["server"]
    if server["split_mode"] != "auto":
        return server["split_mode"], "set in server.split_mode"
    if data["role"] == "rpc-worker":
        return "none", "an rpc-worker lends its devices; the head splits the model"
    if data["role"] == "rpc-head":
        return "layer", "an rpc-head: RPC devices take whole layers"
    if data["llama_cpp"]["backend"] != "cuda":
        return "none", "a cpu build: no GPUs to split over"
    if n_gpus is None:
        return "layer", "the GPUs are not known (declare `gpus` or plan with --probe)"
    if n_gpus == 1:
        return "none", "one GPU"
    if header is None:
        return "layer", "the model's architecture is not known yet (no GGUF header)"
    if header.architecture in TENSOR_SPLIT_UNSUPPORTED:
        return "layer", (
            f"{header.architecture} is refused by -sm tensor at the pinned llama.cpp "
            "(llm_arch_supports_sm_tensor)"
        )
    if server["flash_attn"] == "off":
        return "layer", "flash_attn is off, and tensor mode forces flash attention on"
    no_kernel = [
        t for t in (server["cache_type_k"], server["cache_type_v"]) if t not in CUDA_FA_KV_TYPES
    ]
    if no_kernel:
        return "layer", (
            f"KV type {no_kernel[0]} has no CUDA flash-attention kernel, which tensor mode needs"
        )
    if n_gpus > 2:
        return "layer", (
            f"{n_gpus} GPUs: tensor mode on three or more crashed in ggml-backend-meta at some "
            "builds (llama.cpp #26837) and is not verified at the pinned commit; set "
            "`split_mode: tensor` to try it"
        )
    reason = (
        "two GPUs: tensor splits every layer, so both cards work on each token (decode at "
        "batch 1 measured +33% over layer mode on two H200s)"
    )
    if not builds_with_nccl(data):
        reason += "; built without NCCL, the all-reduce is slower (mostly prefill)"
    return "tensor", reason


def builds_with_nccl(data: dict) -> bool:
    """Whether the CUDA build links NCCL (GGML_CUDA_NCCL; llamarig's default turns it off,
    since NCCL is not part of the toolkit)."""
    return data["llama_cpp"]["cmake_options"].get("GGML_CUDA_NCCL") in (True, "ON", "on")


# Added to what was measured on the rig: the overhead moves by tens of MiB between starts.
MEASURED_MARGIN_MIB = 128


def reserve_mib(
    data: dict, split_mode: str, n_devices: int, measured: dict | None = None
) -> tuple[int, str]:
    """The per-GPU reserve the plan uses and where it comes from: ``planner.reserve_mib``, else
    what the deploy measured on this rig for this build and mode (``measured``: the
    MeasuredOverheads fact), else the default measured on H200s."""
    reserve = data["planner"]["reserve_mib"]
    nccl = builds_with_nccl(data)
    default = default_reserve_mib(split_mode, nccl)
    on_rig = (measured or {}).get((render.build_id(data), split_mode))
    if not on_rig or len(on_rig) != n_devices or min(on_rig) < 0:
        on_rig = None
    seen = f"{max(on_rig)} MiB measured on this rig after a start of this build" if on_rig else ""
    if reserve != "auto":
        return reserve, "planner.reserve_mib" + (f" ({seen})" if seen else "")
    if on_rig:
        return max(on_rig) + MEASURED_MARGIN_MIB, (
            f"{seen} in {split_mode} mode, plus {MEASURED_MARGIN_MIB} (the default would be "
            f"{default})"
        )
    return default, (
        f"measured on H200s for {split_mode} mode {'with' if nccl else 'without'} NCCL "
        "(planner.reserve_mib: auto; the deploy measures this rig after its first start)"
    )


def compare_gpus(declared: list[dict], found: list[dict], where: str) -> list[str]:
    """Differences between the declared GPUs and those found, in PCI bus order; what the host
    printed is shown escaped."""
    if len(declared) != len(found):
        names = printable(", ".join(gpu["name"] for gpu in found) or "none")
        return [f"`gpus` declares {len(declared)} GPUs but {where} shows {len(found)}: {names}"]
    problems = []
    by_bus = (
        sorted(declared, key=lambda gpu: pci_sort_key(gpu["pci_bus_id"]))
        if all(gpu.get("pci_bus_id") for gpu in declared)
        else list(declared)
    )
    if not all(gpu.get("pci_bus_id") for gpu in declared):
        by_bus = declared
    found_by_bus = sorted(found, key=lambda gpu: pci_sort_key(gpu.get("bus_id", "")))
    for want, have in zip(by_bus, found_by_bus, strict=True):
        label = have.get("bus_id") or want["name"]
        if not same_gpu_name(want["name"], have["name"]):
            problems.append(f"GPU at {label} is {have['name']!r}, declared {want['name']!r}")
        if want["compute_capability"] != have["compute_capability"]:
            problems.append(
                f"GPU at {label} has compute capability {have['compute_capability']}, "
                f"declared {want['compute_capability']}"
            )
        if abs(want["vram_mib"] - have["vram_mib"]) > VRAM_TOLERANCE * have["vram_mib"]:
            problems.append(
                f"GPU at {label} has {have['vram_mib']} MiB, declared {want['vram_mib']} MiB"
            )
        if want.get("pci_bus_id") and have.get("bus_id"):
            if pci_sort_key(want["pci_bus_id"]) != pci_sort_key(have["bus_id"]):
                problems.append(f"declared bus id {want['pci_bus_id']} is not present")
    return [printable(problem) for problem in problems]


def roofline_tps(plan: HostPlan) -> float | None:
    """Decode ceiling: the weights each GPU reads per token over its memory bandwidth (layer
    mode reads the cards one after the other, tensor mode at once); None on a CPU rig or an
    unknown card."""
    if not plan.memory or not plan.used_gpus:
        return None
    seconds = []
    for gpu, device in zip(plan.used_gpus, plan.memory.devices, strict=False):
        bandwidth = memory_bandwidth_gbs(gpu["name"])
        if not bandwidth:
            return None
        seconds.append(device.weights_mib * (1 << 20) / (bandwidth * 1e9))
    mode = plan.resolved["server"]["split_mode"]
    per_token = max(seconds) if mode == "tensor" else sum(seconds)
    return 1 / per_token if per_token else None


def trained_context_problem(server: dict, header: GgufHeader) -> str | None:
    """Why an explicit ``server.ctx`` gives a slot more than the model's trained context
    (llama-server caps each slot there, so the KV cache beyond it holds nothing), or None."""
    trained = header.arch_value("context_length")
    if server["ctx"] == "auto" or not isinstance(trained, int) or trained <= 0:
        return None
    per_slot, _ = kv_cells(server["ctx"], server["parallel"], server["kv_unified"])
    if per_slot <= trained:
        return None
    slots = 1 if server["kv_unified"] else server["parallel"]
    largest = trained * slots // CTX_PAD * CTX_PAD
    each = "the slot" if slots == 1 else f"each of the {slots} slots"
    return (
        f"server.ctx {server['ctx']} gives {each} {per_slot} tokens, above the model's trained "
        f"context of {trained} ({header.architecture}.context_length): llama-server caps a "
        "slot there, and the KV cache beyond it is memory spent for nothing; set "
        f"`server.ctx: {largest}` or less (or auto), or `server.allow_ctx_beyond_trained: "
        "true` to plan it anyway"
    )


def _mtp_draft(server: dict) -> int:
    if "draft-mtp" not in server["spec"]["type"]:
        return 0
    return server["spec"]["draft_max"] or DEFAULT_DRAFT_MAX


def plan_host(
    name: str,
    data: dict,
    header: GgufHeader | None,
    header_note: str = "",
    probed_gpus: list[dict] | None = None,
    gpu_source: str = "probed",
    driver_version: str | None = None,
    measured_overheads: dict | None = None,
    header_declared: str = "",
) -> HostPlan:
    """Plan one host, in steps: the GPUs (``probed_gpus``, nvidia-smi or PCI records, win over
    the declaration, which is then checked against them) and the toolkit for them; the split
    mode and what the plan could not see; the role (an RPC worker or head, a CPU rig stop
    there); then the devices the model is spread over and the memory plan on them."""
    resolved = copy.deepcopy(data)
    server = resolved["server"]
    server["extra_args"], warnings = render.translate_renamed(server["extra_args"])
    gpus, source, errors = _plan_gpus(resolved, probed_gpus, gpu_source)
    gpu = data["llama_cpp"]["backend"] == "cuda"
    architectures = None
    if gpu:
        if resolved["gpus"] or data["llama_cpp"]["cuda_architectures"] != "auto":
            architectures = render.cuda_arch_list(resolved)
        errors += check_versions(
            [g["compute_capability"] for g in gpus],
            driver_version=driver_version,
            **chosen_versions(data),
        )
    plan = HostPlan(name, resolved, gpus, source, architectures, None, errors, warnings)
    if header_declared:
        plan.notes.append(
            f"the model's header is declared, not read: {header_declared}; the first deploy "
            "that reads the file checks it"
        )
    _plan_split_and_blind_spots(plan, data, header, header_note)
    if not _memory_is_planned(plan, data, header, header_note):
        return plan
    _plan_memory(plan, data, header, measured_overheads)
    return plan


def _plan_gpus(
    resolved: dict, probed_gpus: list[dict] | None, gpu_source: str
) -> tuple[list[dict], str, list[str]]:
    """The GPUs to plan for, where they come from, and how the declaration differs from the
    probed ones; undeclared probed GPUs become ``resolved["gpus"]``."""
    declared = resolved["gpus"]
    gpus = [
        {
            "name": d["name"],
            "vram_mib": d["vram_mib"],
            "compute_capability": d["compute_capability"],
            "bus_id": d.get("pci_bus_id"),
        }
        for d in declared
    ]
    if not probed_gpus:
        return gpus, "declared" if declared else "none", []
    if declared:
        return gpus, "declared", compare_gpus(declared, probed_gpus, gpu_source)
    resolved["gpus"] = [
        {
            "name": g["name"],
            "vram_mib": g["vram_mib"],
            "compute_capability": g["compute_capability"],
            **({"pci_bus_id": g["bus_id"]} if g.get("bus_id") else {}),
        }
        for g in probed_gpus
    ]
    return probed_gpus, gpu_source, []


def _plan_split_and_blind_spots(
    plan: HostPlan, data: dict, header: GgufHeader | None, header_note: str
) -> None:
    """The split mode, what a plan without the model's header cannot see, and the context
    against the model's trained one."""
    server, gpus = plan.resolved["server"], plan.gpus
    gpu = data["llama_cpp"]["backend"] == "cuda"
    shares = server["tensor_split"]
    n_gpus = sum(1 for share in shares if share) if isinstance(shares, list) else len(gpus)
    server["split_mode"], plan.split_mode_reason = choose_split_mode(
        data, n_gpus if gpus else None, header
    )
    if header is None and gpu and data["role"] != "rpc-worker":
        plan.blind_reason = header_note or "no header read"
        if data["server"]["split_mode"] == "auto" and gpus and n_gpus > 1:
            plan.blind.append("split mode")
        if gpus:
            plan.blind.append("memory per GPU")
        if _mtp_draft(server):
            plan.blind.append("MTP drafting (the model's MTP layers)")
    if header is not None and data["role"] != "rpc-worker":
        problem = trained_context_problem(server, header)
        if problem:
            (plan.warnings if server["allow_ctx_beyond_trained"] else plan.errors).append(problem)


def _memory_is_planned(
    plan: HostPlan, data: dict, header: GgufHeader | None, header_note: str
) -> bool:
    """Whether this host's GPU memory is planned: not on an RPC worker (its head plans the
    model), a head whose workers' GPUs are unknown, a CPU rig, or without the GPUs or the
    header; the notes, warnings and errors that say so."""
    server = plan.resolved["server"]
    gpu = data["llama_cpp"]["backend"] == "cuda"
    wants_auto = "auto" in (server["ctx"], server["tensor_split"])
    if data["role"] == "rpc-worker":
        rpc = data["rpc"]
        plan.notes.append(
            f"rpc-worker: lends its devices to a head on {rpc['host']}:{rpc['port']}; the head "
            "plans the model"
        )
        return False
    if data["role"] == "rpc-head":
        workers = data["rpc"].get("endpoints") or data["rpc"]["workers"]
        planned_across = gpu and data["rpc"].get("worker_gpus")
        plan.notes.append(
            f"rpc-head with workers {', '.join(workers)}: "
            "layers on the workers exchange activations over the network at every host boundary "
            "and the weights travel once at load - the network between hosts is the bottleneck"
            + (
                "; -ts lists the workers' GPUs first (llama.cpp's order), then this host's"
                if planned_across
                else " (memory across hosts not planned: -ngl and -ts are taken as given)"
            )
        )
        if not planned_across:
            return False
    if not gpu:
        if wants_auto:
            plan.errors.append("ctx/tensor_split `auto` plan GPU memory; a cpu rig needs numbers")
        plan.notes.append("cpu build: no GPU memory to plan")
        return False
    if not plan.gpus or header is None:
        missing = "the GPUs (declare `gpus` or pass --probe)" if not plan.gpus else header_note
        (plan.errors if wants_auto else plan.warnings).append(f"memory not planned: {missing}")
        return False
    return True


def _plan_memory(
    plan: HostPlan, data: dict, header: GgufHeader, measured_overheads: dict | None
) -> None:
    """The devices the model is spread over and the memory plan on them, which sets the
    context and the split; a tensor-mode split that does not fit falls back to layer mode
    when the split mode was `auto`."""
    devices, requested = _planned_devices(plan, data)
    try:
        memory = _fitting_memory(plan, data, header, devices, requested, measured_overheads)
    except ValueError as error:
        plan.errors.append(str(error))
        return
    _apply_memory(plan, header, memory, len(devices), measured_overheads)


def _planned_devices(plan: HostPlan, data: dict) -> tuple[list[Device], list[float] | str]:
    """The devices the model is spread over (an RPC head's workers' GPUs first, as llama.cpp
    orders them; those with a zero share left out; one in split mode none) and the tensor
    split asked for over them; sets ``plan.used_gpus``, the GPUs llama-server is given."""
    gpus, server, declared = plan.gpus, plan.resolved["server"], data["gpus"]
    worker_gpus = data["rpc"].get("worker_gpus") or [] if data["role"] == "rpc-head" else []
    # llama.cpp puts RPC devices first: the workers' GPUs, in rpc.workers order, then ours.
    local_caps = [(declared[i].get("usable_mib") if declared else None) for i in range(len(gpus))]
    used = [{**g, "name": f"{g['name']} ({g['worker']})"} for g in worker_gpus] + list(gpus)
    caps = [g.get("usable_mib") for g in worker_gpus] + local_caps
    devices = [
        Device(g["name"], min(g["vram_mib"], cap or 1 << 30))
        for g, cap in zip(used, caps, strict=True)
    ]
    requested = server["tensor_split"] if server["tensor_split"] is not None else "auto"
    if isinstance(requested, list) and 0 in requested:
        left_out = [g["name"] for g, share in zip(used, requested, strict=True) if not share]
        plan.notes.append(f"left out of --device (zero share): {', '.join(left_out)}")
        devices = [d for d, share in zip(devices, requested, strict=True) if share]
        used = [g for g, share in zip(used, requested, strict=True) if share]
        requested = [share for share in requested if share]
    if server["split_mode"] == "none" and len(devices) > 1:
        devices, used = devices[:1], used[:1]
    plan.used_gpus = used
    return devices, requested


def _fitting_memory(
    plan: HostPlan,
    data: dict,
    header: GgufHeader,
    devices: list[Device],
    requested: list[float] | str,
    measured_overheads: dict | None,
) -> MemoryPlan:
    """The memory plan in the split mode chosen, or in layer mode where tensor mode does not
    fit and layer mode does while the split mode was `auto` (then ``server.split_mode`` and its
    reason say so); ValueError for settings the memory model refuses."""
    server = plan.resolved["server"]

    def planned(mode: str) -> MemoryPlan:
        reserve, _ = reserve_mib(plan.resolved, mode, len(devices), measured_overheads)
        return plan_memory(
            header,
            [dataclasses.replace(device, reserve_mib=reserve) for device in devices],
            split_mode=mode,
            tensor_split=requested,
            ctx=server["ctx"],
            n_parallel=server["parallel"],
            kv_unified=server["kv_unified"],
            type_k=server["cache_type_k"],
            type_v=server["cache_type_v"],
            n_ubatch=server["ubatch"],
            margin_mib=data["planner"]["margin_mib"],
            mtp_draft_n_max=_mtp_draft(server),
            # a count plans a partial offload; all and auto offload every layer
            n_gpu_layers=server["gpu_layers"] if isinstance(server["gpu_layers"], int) else None,
        )

    memory = planned(server["split_mode"])
    auto_chose_tensor = data["server"]["split_mode"] == "auto" and server["split_mode"] == "tensor"
    if auto_chose_tensor and not memory.fits:
        # Tensor mode holds more per card (the all-reduce's buffers): layer may still fit.
        layered = planned("layer")
        if layered.fits:
            memory = layered
            server["split_mode"] = "layer"
            plan.split_mode_reason = (
                "tensor mode does not fit these GPUs' memory and layer mode does"
            )
    return memory


def _apply_memory(
    plan: HostPlan,
    header: GgufHeader,
    memory: MemoryPlan,
    n_devices: int,
    measured_overheads: dict | None,
) -> None:
    """What the memory plan settles: the reserve it used (a note), the context and the split
    llama-server gets, and the errors of a plan that does not fit or drafts without MTP
    layers."""
    server = plan.resolved["server"]
    split_mode = server["split_mode"]
    plan.memory = memory
    reserve, origin = reserve_mib(plan.resolved, split_mode, n_devices, measured_overheads)
    plan.notes.append(f"reserve {reserve} MiB per GPU beyond llama.cpp's buffers: {origin}")
    server["ctx"] = memory.ctx
    if split_mode == "none":
        # One card: llama.cpp ignores -ts there, so the plan has no split to pass.
        server["tensor_split"] = None
    elif server["tensor_split"] in ("auto", None):
        if server["tensor_split"] == "auto" or split_mode == "tensor":
            # Tensor mode without -ts splits evenly, which over-fills the smaller card.
            server["tensor_split"] = list(memory.ratio)
    if not memory.fits:
        plan.errors.append(
            "the configuration does not fit in GPU memory (need = planned + margin):\n"
            + memory.table()
            + "".join(f"\n  would fit: {s}" for s in memory.suggestions)
        )
    if _mtp_draft(server) and header.nextn_predict_layers == 0:
        plan.errors.append(
            "spec.type has draft-mtp but the model has no MTP layers "
            f"({header.architecture}.nextn_predict_layers is 0): llama-server exits at load"
        )
    if split_mode == "tensor":
        plan.notes.extend(TENSOR_MODE_LIMITS)
