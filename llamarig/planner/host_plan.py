"""What the planner decided for one host (``HostPlan``): the rig data with the context and the
split resolved, the GPUs, the memory plan, what the deploy would refuse and why, and the plan as
a person reads it (``report``) and as JSON. For a rig of several models it also holds each
model's own plan (``PlannedModel``) and the worst case of those loaded at once (``AtOnce``),
which router_plan.py works out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamarig.model.catalog import ModelView
from llamarig.planner import render
from llamarig.planner.memory import MemoryPlan
from llamarig.tables.text import printable


@dataclass
class HostPlan:
    """Everything llamarig decided for one host, and why it would refuse."""

    host: str
    resolved: dict  # the rig data with ctx and tensor_split resolved
    gpus: list[dict]
    gpu_source: str  # declared | probed | pci | none
    cuda_architectures: str | None
    memory: MemoryPlan | None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The GPUs llama-server is given (--device), in the order of the memory plan's devices.
    used_gpus: list[dict] = field(default_factory=list)
    split_mode_reason: str = ""
    # The choices made without the model's GGUF header (split mode, memory per GPU, ...), and
    # why it could not be had: a plan that may change once the header is read.
    blind: list[str] = field(default_factory=list)
    blind_reason: str = ""
    # A rig of several models (`models:`): each model's own plan, and the worst case of the
    # models loaded at once (their problems are in ``errors``).
    models: list[PlannedModel] = field(default_factory=list)
    at_once: AtOnce | None = None

    @property
    def provisional(self) -> str:
        """One line saying which choices were made blind, or "" for a plan that is final."""
        if not self.blind:
            return ""
        return (
            f"provisional: {', '.join(self.blind)} chosen without the model's GGUF header "
            f"({self.blind_reason}); record it with `llamarig lock` (models.lock.yml)"
        )

    @property
    def fits(self) -> bool:
        return not self.errors and (self.memory is None or self.memory.fits)

    @property
    def planned_gpu_indices(self) -> list[int] | None:
        """nvidia-smi's index of each GPU the memory plan fills, in the plan's device order;
        None when the plan has no memory for the GPUs llama-server is given (a CPU build, an
        RPC head's remote devices)."""
        devices, _ = render.server_devices(self.resolved)
        if not self.memory or not devices or len(devices) != len(self.memory.devices):
            return None
        return [int(name.removeprefix("CUDA")) for name in devices]

    @property
    def server_args(self) -> list[str]:
        return render.server_args(self.resolved)

    @property
    def cmake_args(self) -> list[str]:
        return render.cmake_configure_command(self.resolved)

    def to_json(self) -> dict[str, Any]:
        server = self.resolved["server"]
        devices = []
        for index, gpu in enumerate(self.used_gpus or self.gpus):
            row = {"index": index, "name": gpu["name"], "vram_total_mib": gpu["vram_mib"]}
            if self.memory:
                device = self.memory.devices[index]
                row.update(
                    weights_mib=device.weights_mib,
                    kv_mib=device.kv_mib + device.state_mib,
                    compute_mib=device.compute_mib,
                    reserve_mib=device.reserve_mib,
                    planned_mib=device.planned_mib,
                )
            devices.append(row)
        return {
            "fits": self.fits,
            "provisional": self.blind,
            "errors": self.errors,
            "warnings": self.warnings,
            "cuda_architectures": self.cuda_architectures or "",
            "split_mode": server["split_mode"],
            "split_mode_reason": self.split_mode_reason,
            # a list of shares; "auto" where the split is not planned yet (no header)
            "tensor_split": server["tensor_split"]
            if isinstance(server["tensor_split"], str)
            else list(server["tensor_split"] or []),
            "ctx": server["ctx"],
            "devices": devices,
            "server_args": self.server_args if self.server_args_ready else [],
            "cmake_args": self.cmake_args,
        }

    @property
    def server_args_ready(self) -> bool:
        server = self.resolved["server"]
        return "auto" not in (server["ctx"], server["tensor_split"])

    def _models_report(self) -> list[str]:
        """A rig of several models: each model's plan, then the worst case loaded at once."""
        lines = []
        for model in self.models:
            server, memory = model.plan.resolved["server"], model.plan.memory
            loads = "at startup" if model.view.load_on_startup else "at its first request"
            lines.append(
                f"  model {model.view.name} (loaded {loads}): split mode {server['split_mode']}, "
                f"ctx {server['ctx']}, {server['parallel']} slot(s)"
            )
            if memory:
                lines.extend("    " + line for line in memory.table().splitlines())
        if self.at_once and self.at_once.devices:
            lines.extend("  " + line for line in self.at_once.table().splitlines())
        elif self.at_once:
            lines.append(f"  {self.at_once.table()} (no GPU memory planned)")
        for model in self.models:
            if model.plan.server_args_ready:
                options = render.model_options(model.plan.resolved)
                flat = [part for option in options for part in option if part is not None]
                model_file = render.layout(model.plan.resolved)["model"]
                joined = render.shell_join(["-m", model_file, *flat])
                lines.append(f"  preset [{model.view.name}]: {printable(joined)}")
        return lines

    def report(self) -> str:
        """The plan as a person reads it: every line shown with control and format
        characters escaped (``text.printable``), since its values come from the rig data, the
        lock and a probed box (a GPU's name, a file name decoded from a URL); a multi-line
        error (the memory table) keeps its own lines."""
        return "\n".join(
            printable(line) for entry in self._report_lines() for line in entry.split("\n")
        )

    def _report_lines(self) -> list[str]:
        server = self.resolved["server"]
        verdict = "REFUSED" if not self.fits else "PROVISIONAL" if self.blind else "fits"
        lines = [f"== {self.host}: {verdict}"]
        if self.provisional:
            lines.append(f"  {self.provisional}")
        for index, gpu in enumerate(self.gpus):
            # A probed GPU's fields are what the box printed: escaped, a line break too.
            lines.append(
                f"  GPU {index} ({self.gpu_source}): {printable(gpu['name'])}, "
                f"{printable(gpu['vram_mib'])} MiB, compute {printable(gpu['compute_capability'])}"
                + (f", {printable(gpu['bus_id'])}" if gpu.get("bus_id") else "")
            )
        if self.cuda_architectures:
            lines.append(f"  CUDA architectures: {self.cuda_architectures}")
        if self.models:
            lines.extend(self._models_report())
        elif self.resolved["role"] != "rpc-worker":
            lines.append(f"  split mode {server['split_mode']}: {self.split_mode_reason}")
        if self.memory:
            ratio = ", ".join(f"{share:.3f}" for share in self.memory.ratio)
            lines.append(
                f"  split {server['split_mode']} ratio [{ratio}], ctx {self.memory.ctx}, "
                f"KV {self.memory.type_k}/{self.memory.type_v}; "
                f"{self.memory.host_weights_mib} MiB of weights stay in host memory"
            )
            if self.memory.fits:  # otherwise the table is part of the error below
                lines.extend("  " + line for line in self.memory.table().splitlines())
        lines.extend(f"  error: {error}" for error in self.errors)
        lines.extend(f"  warning: {warning}" for warning in self.warnings)
        lines.extend(f"  note: {note}" for note in self.notes)
        if self.resolved["role"] == "rpc-worker":
            rpc_args = render.shell_join(render.rpc_server_args(self.resolved))
            lines.append(f"  ggml-rpc-server: {printable(rpc_args)}")
        elif self.server_args_ready:
            lines.append(f"  llama-server: {printable(render.shell_join(self.server_args))}")
        lines.append(f"  cmake: {printable(render.shell_join(self.cmake_args))}")
        return lines


@dataclass(frozen=True)
class PlannedModel:
    """One model of the rig with its own plan."""

    view: ModelView
    plan: HostPlan

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
