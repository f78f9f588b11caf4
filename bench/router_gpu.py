"""Several models behind one llama-server on one GPU (issue 30): the random-weight 8B and 32.5B
Q8_0 models of bench/models.py served by one router from the presets llamarig plans and renders
for an H200 rig (`models:`). Measures what nvidia-smi shows with both loaded against the
plan's worst case (each child process and the sum), the time each model takes to load through
the router, a request's time when both are loaded, and the time to switch between them when
only one fits (--models-max 1: the router unloads one, then loads the other). Run by
bench/router_h200.sh.

python3 bench/router_gpu.py BUILD_BIN MODELS_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_gpu import stop  # noqa: E402
from llamarig.config import load_inventory  # noqa: E402
from llamarig.model.catalog import model_views, with_views  # noqa: E402
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner import render
from llamarig.planner.host_plan import PlannedModel
from llamarig.planner.plan import plan_host
from llamarig.planner.router_plan import loaded_at_once

PORT = 8190
NAMES = ("llama-8b", "llama-32b")
RIG = """\
all:
  hosts:
    h200-router:
      ssh: {{local: true}}
      reboot: never
      kernel_modules: {{manage: false}}
      driver: {{source: preinstalled}}
      cuda: {{source: preinstalled, version: "13.0", nvcc: /usr/local/cuda/bin/nvcc}}
      gpus: [{{name: NVIDIA H200, vram_mib: 143771, compute_capability: "9.0"}}]
      llama_cpp: {{cuda_architectures: "90-real", build_dependencies: preinstalled, ccache: false}}
      server: {{ctx: 8192, flash_attn: "on", parallel: 1, load_mode: none, models_max: {most}}}
      models:
        - {{name: llama-8b, path: {models}/llama-8b-q8_0.gguf}}
        - {{name: llama-32b, path: {models}/llama-32b-q8_0.gguf}}
"""


def plan(models: Path, most: int) -> tuple[dict, list[PlannedModel]]:
    """The rig's data with each model planned on the H200 from its own header, as a deploy
    plans it (the header read from the file here, not over SSH)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "router.yml"
        path.write_text(RIG.format(models=models, most=most))
        data = load_inventory(path).hosts["h200-router"].data
    planned = []
    for view in model_views(data):
        header = read_gguf_header_file(Path(view.data["model"]["path"]))
        view_plan = plan_host("h200-router", view.data, header)
        assert view_plan.fits, view_plan.report()
        planned.append(PlannedModel(view.__class__(view.index, view.name, view_plan.resolved,
                                                   view.load_on_startup), view_plan))  # fmt: skip
    return with_views(data, [p.view for p in planned]), planned


def gpu_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


def apps_mib() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {int(p): int(m) for p, m in (line.split(",") for line in out.strip().splitlines())}


def request(path: str, body: dict | None = None, timeout: float = 900) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        return json.load(reply)


def ask(model: str) -> float:
    """Seconds for an 8-token greedy completion of ``model`` through the router (a load or a
    switch included)."""
    started = time.monotonic()
    reply = request("/completion", {"model": model, "prompt": "Hello", "n_predict": 8,
                                    "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert reply["tokens_predicted"] == 8, reply
    return time.monotonic() - started


def start(binary: Path, presets: Path, most: int, log: Path) -> subprocess.Popen:
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(PORT)]
    argv += ["--models-preset", str(presets), "--models-max", str(most), "--metrics"]
    env = {**os.environ, "LLAMA_CACHE": str(log.parent / "cache")}  # no cached models listed
    router = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if request("/health", timeout=5).get("status") == "ok":
                return router
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the router did not answer /health: see {log}")


def both_loaded(binary: Path, models: Path, out: Path) -> dict:
    data, planned = plan(models, 2)
    at_once = loaded_at_once(planned, 2)
    presets = out / "presets-both.ini"
    presets.write_text(render.render_presets(data))
    baseline = gpu_used_mib()
    router = start(binary, presets, 2, out / "router-both.log")
    try:
        router_only = gpu_used_mib() - baseline
        loads = {name: ask(name) for name in NAMES}
        time.sleep(2)
        apps = apps_mib()
        used = gpu_used_mib() - baseline
        listed = {m["id"]: m["status"]["value"] for m in request("/v1/models")["data"]}
        warm = {name: statistics.median(ask(name) for _ in range(5)) for name in NAMES}
        alternating = statistics.median(ask(NAMES[i % 2]) for i in range(8))
    finally:
        stop(router)
    planned_mib = {p.view.name: sum(p.device_mib.values()) for p in planned}
    (_, (total_planned, need, have)) = next(iter(at_once.devices.items()))
    return {
        "planned_mib": planned_mib,
        "planned_total_mib": total_planned,
        "planned_need_mib": need,
        "vram_mib": have,
        "measured_total_mib": used,
        "measured_per_process_mib": sorted(apps.values()),
        "router_alone_mib": router_only,
        "measured_over_planned": used / total_planned,
        "load_seconds": loads,
        "listed": listed,
        "warm_request_seconds": warm,
        "alternating_request_seconds": alternating,
        "plan": "\n".join(p.plan.memory.table() for p in planned),
    }


def switching(binary: Path, models: Path, out: Path) -> dict:
    data, _ = plan(models, 1)
    presets = out / "presets-one.ini"
    presets.write_text(render.render_presets(data))
    router = start(binary, presets, 1, out / "router-one.log")
    try:
        first = ask(NAMES[0])
        switches = []
        for turn in range(4):
            switches.append({"to": NAMES[(turn + 1) % 2], "seconds": ask(NAMES[(turn + 1) % 2])})
        warm = statistics.median(ask(NAMES[0]) for _ in range(3))
    finally:
        stop(router)
    return {"first_load_seconds": first, "switches": switches, "warm_8b_request_seconds": warm}


def main(argv: list[str]) -> int:
    binaries, models, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    binary = binaries / "llama-server"
    results = {"both": both_loaded(binary, models, out)}
    results["one_at_a_time"] = switching(binary, models, out)
    (out / "router.json").write_text(json.dumps(results, indent=2))
    both = results["both"]
    print(both["plan"])
    print(
        f"both loaded: nvidia-smi {both['measured_total_mib']} MiB (processes "
        f"{both['measured_per_process_mib']}), plan {both['planned_total_mib']} MiB "
        f"({both['planned_mib']}): measured/planned {both['measured_over_planned']:.3f}; "
        f"router alone {both['router_alone_mib']} MiB"
    )
    print(f"loads {both['load_seconds']}, warm {both['warm_request_seconds']}, "
          f"alternating {both['alternating_request_seconds']:.3f} s")  # fmt: skip
    print(json.dumps(results["one_at_a_time"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
