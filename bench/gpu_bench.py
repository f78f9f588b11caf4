"""The GPU benchmark of issue 5, run on the two-H200 machine by bench/run.sh.

In one run: random-weight models (bench/models.py), the real deploy as pyinfra's @local
(inventory/gpu-h200x2.yml) and its idempotence, the deployed server (`llamarig run`) per rig
(planned split, mixed-card caps, 8B), `llamarig verify`, per-GPU memory against the plan, a
`llama-bench` sweep of split modes and ratios with NCCL built in and not, the memory-bandwidth
roofline, the build time and the binary's architectures. Everything lands in
$OUT/results.json (written after each phase, so a cut-off run still reports), logs beside it;
bench/report.py turns it into bench/RESULTS.md and bench/decode.png.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llamarig.config import load_inventory  # noqa: E402
from llamarig.model.gguf import read_gguf_header  # noqa: E402
from llamarig.planner.plan import plan_host  # noqa: E402

WORK = Path("/srv/llamarig")
MODELS = WORK / "models"
OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
RIG = ROOT / "inventory" / "gpu-h200x2.yml"
MIXED = ROOT / "inventory" / "gpu-h200x2-mixed.yml"
PROMPT = "Write a long story about a llama who learns to build servers. Once upon a time,"
N_PREDICT = 128
REPETITIONS = 5
BENCH_FLAGS = ["-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0", "-b", "2048", "-ub", "512"]
BENCH_FLAGS += ["-p", "0", "-n", str(N_PREDICT), "-r", "3"]
MEMORY_QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


results: dict = {"started": now()}


def save() -> None:
    (OUT / "results.json").write_text(json.dumps(results, indent=2, default=str))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], log_name: str, env: dict | None = None, check: bool = True) -> float:
    """Run a command with its output in $OUT/logs/LOG_NAME; returns its wall time."""
    start = time.monotonic()
    with open(OUT / "logs" / log_name, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.monotonic() - start
    if check and code:
        tail = (OUT / "logs" / log_name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(command[:4])} failed ({code}); {log_name}:\n{tail}")
    return seconds


def env_for(inventory: Path) -> dict:
    return {**os.environ, "RIG_INVENTORY": str(inventory), "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class DeployRun:
    """One `pyinfra -y --json inventory.py deploy.py`: its exit status, wall time, the
    operations that changed something (None when its JSON cannot be read) and its output."""

    rc: int
    seconds: float
    changed_ops: list[str] | None
    output: str


def run_deploy(inventory: Path, log_path: Path) -> DeployRun:
    """The real deploy of ``inventory`` (RIG_INVENTORY), its output kept in ``log_path``; the
    one deploy helper of the benchmarks and the GPU tests, which never raises for a failed run."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "--json", "inventory.py", "deploy.py"],
        cwd=ROOT,
        env=env_for(inventory),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    seconds = round(time.monotonic() - start, 1)
    output = result.stderr + "\n" + result.stdout
    log_path.write_text(
        f"$ RIG_INVENTORY={inventory} python3 -m pyinfra -y --json inventory.py deploy.py\n"
        + output
    )
    changed = None
    with contextlib.suppress(ValueError, KeyError):
        operations = json.loads(result.stdout)["results"]["operations"]
        changed = [op["name"].split(" | ", 1)[-1] for op in operations if op["success"]]
    return DeployRun(result.returncode, seconds, changed, output)


def deploy(inventory: Path, log_name: str) -> dict:
    """A deploy that must succeed (as the benchmark's @local rig); its wall time and the
    changed operations."""
    run = run_deploy(inventory, OUT / "logs" / log_name)
    if run.rc or run.changed_ops is None:
        raise RuntimeError(f"deploy {inventory.name} failed:\n{run.output[-4000:]}")
    return {"seconds": run.seconds, "changed": len(run.changed_ops), "changed_ops": run.changed_ops}


def derived_inventory(base: Path, name: str, overrides: dict) -> Path:
    """A copy of a rig file with some host keys replaced (same host, another model): a mapping
    updates the section's keys, anything else (the `gpus` list) replaces the section."""
    text = yaml.safe_load(base.read_text())
    hosts = text["all"]["children"]["gpu"]["hosts"]
    ((host_name, host),) = hosts.items()
    merged = copy.deepcopy(host)
    for section, values in overrides.items():
        if isinstance(values, dict):
            merged.setdefault(section, {}).update(values)
        else:
            merged[section] = values
    hosts[host_name] = merged
    path = WORK / f"{name}.yml"
    path.write_text(yaml.safe_dump(text, sort_keys=False))
    return path


# Peak memory bandwidth (GB/s, NVIDIA's data sheets) of the cards the device machines lend. A
# decoded token reads every weight once, so a speed floor set for one card scales by this.
CARD_BANDWIDTH_GBS = {"NVIDIA H200": 4800, "NVIDIA H100 80GB HBM3": 3350}


def this_card_rig(shipped: dict) -> dict:
    """Overrides that make the one-GPU rig ``shipped`` (a host's data as written) this machine's:
    its GPU 0 as nvidia-smi names it, the CUDA architecture of its compute capability, and
    the decode floor scaled from the shipped card's by memory bandwidth (dropped, so verify
    says it did not check the speed, for a card whose bandwidth is not listed here)."""
    query = "--query-gpu=name,memory.total,compute_cap"
    line = subprocess.check_output(
        ["nvidia-smi", query, "--format=csv,noheader,nounits", "-i", "0"], text=True
    )
    name, vram_mib, capability = (field.strip() for field in line.split(","))
    (card,) = shipped["gpus"]
    floor = shipped.get("expect", {}).get("min_tokens_per_second")
    if name != card["name"] and floor is not None:
        ratio = CARD_BANDWIDTH_GBS.get(name, 0) / CARD_BANDWIDTH_GBS[card["name"]]
        floor = int(floor * ratio) or None
    return {
        "gpus": [{"name": name, "vram_mib": int(vram_mib), "compute_capability": capability}],
        "llama_cpp": {"cuda_architectures": capability.replace(".", "") + "-real"},
        "expect": {"min_tokens_per_second": floor},
    }


def host_data(inventory: Path) -> dict:
    os.environ["RIG_INVENTORY"] = str(inventory)
    (config,) = load_inventory().hosts.values()
    return config.data


def plan_for(data: dict, model: Path, **server: object):
    """The planner's plan for this rig and model (with server settings overridden)."""
    data = copy.deepcopy(data)
    data["server"].update(server)
    with open(model, "rb") as handle:
        header = read_gguf_header(handle, name=str(model))
    return plan_host("bench", data, header)


def memory_used() -> list[int]:
    return [int(v) for v in subprocess.check_output(MEMORY_QUERY, text=True).split()]


class PeakMemory:
    """Samples nvidia-smi while a command runs; keeps each GPU's peak."""

    def __init__(self) -> None:
        self.peak = [0, 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = [max(a, b) for a, b in zip(self.peak, memory_used(), strict=False)]
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_gpus_idle(limit_mib: int = 1024, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while max(memory_used()) > limit_mib and time.monotonic() < deadline:
        time.sleep(1)


# The server's default sampler chain at temperature 0, and the cheapest one (top-k 1, i.e.
# greedy): llama-bench samples nothing, so the second is the like-for-like comparison.
SAMPLING = {
    "default": {"temperature": 0},
    "greedy": {"samplers": ["top_k"], "top_k": 1},
}


def completion(base: str, sampling: str = "default", api_key: str | None = None) -> dict:
    body = json.dumps(
        {
            "prompt": PROMPT,
            "n_predict": N_PREDICT,
            "ignore_eos": True,
            "cache_prompt": False,
            **SAMPLING[sampling],
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{base}/completion", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


@contextlib.contextmanager
def running_server(inventory: Path, log_path: Path, extra: Sequence[str] = ()):
    """The last deploy's launcher (`llamarig run`, with ``extra`` llama-server flags) until it
    serves; yields its base URL and load seconds, and stops it afterwards."""
    base = f"http://127.0.0.1:{host_data(inventory)['server']['port']}"
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(
            [sys.executable, "-m", "llamarig.cli", "run", "--", *extra],
            cwd=ROOT,
            env=env_for(inventory),
            stdout=server_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            start = time.monotonic()
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({server.returncode}); see its log")
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - start > 600:
                    raise RuntimeError("llama-server did not become healthy in 600 s")
                time.sleep(1)
            yield base, round(time.monotonic() - start, 1)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
            wait_gpus_idle()


def decode_speeds(base: str, api_key: str | None = None) -> dict[str, list[float]]:
    """After a warm-up, REPETITIONS completions per sampling: their predicted_per_second."""
    completion(base, api_key=api_key)
    return {
        sampling: [
            completion(base, sampling, api_key)["timings"]["predicted_per_second"]
            for _ in range(REPETITIONS)
        ]
        for sampling in SAMPLING
    }


def serve_and_measure(label: str, inventory: Path, model: Path) -> dict:
    """Deploy the rig, start its server with `llamarig run`, measure decode and memory,
    run `llamarig verify`, stop the server."""
    entry: dict = {"inventory": inventory.name, "model": model.name}
    entry["deploy"] = deploy(inventory, f"deploy-{label}.log")
    data = host_data(inventory)
    plan = plan_for(data, model)
    entry["plan"] = {
        "split_mode": plan.resolved["server"]["split_mode"],
        "tensor_split": plan.resolved["server"]["tensor_split"],
        "ctx": plan.resolved["server"]["ctx"],
        "planned_mib": [g.planned_mib for g in plan.memory.devices],
        "buffers_mib": [g.planned_mib - g.reserve_mib for g in plan.memory.devices],
        "caps_mib": [g.vram_mib for g in plan.memory.devices],
    }
    with running_server(inventory, OUT / "logs" / f"server-{label}.log") as (base, seconds):
        entry["load_seconds"] = seconds
        for sampling, speeds in decode_speeds(base).items():
            entry[f"decode_tps_{sampling}"] = speeds
            entry[f"decode_median_{sampling}"] = statistics.median(speeds)
        entry["decode_median"] = entry["decode_median_greedy"]
        used = memory_used()
        entry["memory_used_mib"] = used
        entry["memory_error_pct"] = [
            round(100 * (planned - measured) / measured, 2)
            for planned, measured in zip(entry["plan"]["planned_mib"], used, strict=False)
        ]
        entry["overhead_mib"] = [
            measured - buffers
            for measured, buffers in zip(used, entry["plan"]["buffers_mib"], strict=False)
        ]
        entry["under_caps"] = all(
            u <= cap for u, cap in zip(used, entry["plan"]["caps_mib"], strict=False)
        )
        verify = subprocess.run(
            [sys.executable, "-m", "llamarig.cli", "verify", "--", "-q"],
            cwd=ROOT,
            env=env_for(inventory),
            capture_output=True,
            text=True,
        )
        (OUT / "logs" / f"verify-{label}.log").write_text(verify.stdout + verify.stderr)
        entry["verify"] = {"rc": verify.returncode, "summary": verify.stdout.strip()[-600:]}
    log(
        f"{label}: {entry.get('decode_median_default', 0):.1f} t/s default sampling, "
        f"{entry.get('decode_median', 0):.1f} greedy, memory {entry.get('memory_used_mib')}"
    )
    return entry


def sweep_configs(mixed_ratio: list[float]) -> list[dict]:
    """The sweep, most telling rows first (a run cut short still answers the main question):
    tensor 1:1, one GPU, the mixed rig's planned ratio and its neighbour 3:2, pipeline, the
    other ratios; NCCL built in, and tensor 1:1 without it."""
    planned = "/".join(f"{share:g}" for share in mixed_ratio)
    configs = [
        {"label": "tensor 1:1", "sm": "tensor", "ts": "1/1"},
        {"label": "none (1 GPU)", "sm": "none", "ts": None},
    ]
    configs += [
        {"label": f"tensor {ts.replace('/', ':')}", "sm": "tensor", "ts": ts}
        for ts in (planned, "3/2")
    ]
    configs.append({"label": "layer 1:1", "sm": "layer", "ts": "1/1"})
    configs += [
        {"label": f"tensor {ts.replace('/', ':')}", "sm": "tensor", "ts": ts}
        for ts in ("2/3", "1/3")
    ]
    for config in configs:
        config["nccl"] = True
    configs.append({"label": "tensor 1:1 no NCCL", "sm": "tensor", "ts": "1/1", "nccl": False})
    return configs


def llama_bench(binary: str, model: Path, config: dict, log_name: str) -> dict:
    command = [binary, "-m", str(model), "-sm", config["sm"], *BENCH_FLAGS, "-o", "json"]
    if config["ts"]:
        command += ["-ts", config["ts"]]
    environment = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    with PeakMemory() as peak:
        result = subprocess.run(command, capture_output=True, text=True, env=environment)
    with open(OUT / "logs" / log_name, "a") as out:
        out.write(f"$ {' '.join(command)}\n{result.stderr[-4000:]}\n{result.stdout}\n")
    wait_gpus_idle()
    if result.returncode:
        return {"error": result.stderr.strip().splitlines()[-1:] or ["failed"]}
    (record,) = json.loads(result.stdout)
    return {
        "avg_ts": record["avg_ts"],
        "stddev_ts": record["stddev_ts"],
        "samples_ts": record.get("samples_ts"),
        "n_threads": record.get("n_threads"),
        "peak_mib": peak.peak,
    }


def device_bandwidth_gbs() -> list[float]:
    """Device-to-device copy bandwidth per GPU (bytes read + written), median of 20 copies."""
    import torch

    rates = []
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            source = torch.randint(0, 255, (4 << 30,), dtype=torch.uint8, device="cuda")
            target = torch.empty_like(source)
            times = []
            for _ in range(22):
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                target.copy_(source)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            rates.append(2 * source.numel() / statistics.median(times[2:]) / 1e9)
            del source, target
            torch.cuda.empty_cache()
    return [round(rate, 1) for rate in rates]


def decode_bytes(model: Path) -> int:
    """Weight bytes read per decoded token: every tensor but the token embedding, of which one
    row is read (llama.cpp keeps it in host memory)."""
    with open(model, "rb") as handle:
        header = read_gguf_header(handle, name=str(model))
    return sum(t.n_bytes for t in header.tensors if t.name != "token_embd.weight")


def vocab_file() -> Path:
    """Llama 3's tokenizer, from the carried llama.cpp mirror."""
    vocab = WORK / "vocab-llama-bpe.gguf"
    if not vocab.exists():
        git = ["git", f"--git-dir={WORK / 'llama.cpp.git'}"]
        show = git + ["show", "HEAD:models/ggml-vocab-llama-bpe.gguf"]
        vocab.write_bytes(subprocess.check_output(show))
    return vocab


def write_model(name: str) -> float:
    command = [sys.executable, "bench/models.py", str(MODELS), str(vocab_file()), name]
    return round(run(command, "models.log"), 1)


def write_model_beside(name: str, path: Path) -> Callable[[], float]:
    """Start writing model ``name`` (unless ``path`` exists) on a thread, beside other work;
    returns a function that waits for it and gives its seconds (0 when the file existed), or
    raises RuntimeError with why it failed."""
    outcome: dict = {}

    def write() -> None:
        try:
            outcome["seconds"] = write_model(name) if not path.exists() else 0
        except Exception as error:  # noqa: BLE001 - reported by the waiter
            outcome["error"] = str(error)

    thread = threading.Thread(target=write)
    thread.start()

    def written() -> float:
        thread.join()
        if "error" in outcome:
            raise RuntimeError(f"writing the model failed: {outcome['error']}")
        return outcome["seconds"]

    return written


def rig_files() -> dict[str, Path]:
    """The committed rig files, each with its model's path; BENCH_CUDA_ARCHITECTURES builds for
    fewer architectures when the device time is short (the RESULTS say so)."""
    architectures = os.environ.get("BENCH_CUDA_ARCHITECTURES")
    build = {"llama_cpp": {"cuda_architectures": architectures}} if architectures else {}
    model_8b = {"model": {"path": str(MODELS / "llama-8b-q8_0.gguf")}}
    return {
        "32b": derived_inventory(RIG, "rig-32b", build),
        "8b": derived_inventory(RIG, "rig-8b", {**model_8b, **build}),
        "mixed": derived_inventory(MIXED, "rig-mixed", build),
        # The 8B on one GPU too: the sweep may show one card beats a split for a model this small.
        "8b-single": derived_inventory(
            RIG, "rig-8b-single", {**model_8b, "server": {"split_mode": "none"}, **build}
        ),
    }


def main() -> int:
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    results["machine"] = {
        "gpus": subprocess.check_output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
            text=True,
        ).strip(),
        "topology": subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True
        ).stdout.strip(),
        "nvcc": subprocess.check_output(["/usr/local/cuda/bin/nvcc", "--version"], text=True)
        .strip()
        .splitlines()[-1],
        "cpus": os.cpu_count(),
    }
    data = host_data(RIG)
    results["commit"] = data["llama_cpp"]["commit"]
    save()

    model_32b, model_8b = MODELS / "llama-32b-q8_0.gguf", MODELS / "llama-8b-q8_0.gguf"
    rigs = rig_files()
    rig_32b, rig_8b, rig_mixed = rigs["32b"], rigs["8b"], rigs["mixed"]
    architectures = os.environ.get("BENCH_CUDA_ARCHITECTURES")
    results["cuda_architectures"] = architectures or data["llama_cpp"]["cuda_architectures"]

    log("writing the 8B model")
    results["model_write_seconds"] = {"llama-8b": write_model("llama-8b")}
    log("deploy of the 8B rig (the build) || 32.5B model || no-NCCL llama-bench build")
    nonccl_dir = WORK / "build-no-nccl"
    src = WORK / "src-no-nccl"
    parallel = {}

    def nonccl_build() -> None:
        if not src.exists():
            run(["git", "clone", "-q", str(WORK / "llama.cpp.git"), str(src)], "no-nccl.log")
        configure = [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(nonccl_dir),
            "-G",
            "Ninja",
            "-DGGML_CUDA=ON",
            "-DGGML_NATIVE=OFF",
            "-DCMAKE_CUDA_ARCHITECTURES=90-real",
            "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc",
            "-DGGML_CUDA_NCCL=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_BUILD_TESTS=OFF",
        ]
        seconds = run(configure, "no-nccl.log")
        seconds += run(
            ["cmake", "--build", str(nonccl_dir), "--target", "llama-bench", "-j", "16"],
            "no-nccl.log",
        )
        parallel["no_nccl_build_seconds"] = round(seconds, 1)

    def write_32b() -> None:
        parallel["llama-32b"] = write_model("llama-32b")

    # The no-NCCL build only feeds the sweep's last rows: nothing waits for it before those.
    nonccl_thread = threading.Thread(target=nonccl_build)
    model_thread = threading.Thread(target=write_32b)
    nonccl_thread.start()
    model_thread.start()
    try:
        results["deploy_first"] = deploy(rig_8b, "deploy-first.log")
    finally:
        model_thread.join()
    results["model_write_seconds"]["llama-32b"] = parallel.get("llama-32b")
    save()
    log(f"first deploy {results['deploy_first']['seconds']} s")
    results["deploy_second"] = deploy(rig_8b, "deploy-second.log")
    log(f"second deploy: {results['deploy_second']['changed']} changed")

    build = Path(os.path.realpath(f"{data['paths']['prefix']}/current"))
    library = str(build / "bin" / "libggml-cuda.so")
    elf = subprocess.run(
        ["/usr/local/cuda/bin/cuobjdump", "--list-elf", library], capture_output=True, text=True
    ).stdout
    linked = subprocess.run(["ldd", library], capture_output=True, text=True).stdout
    marker, cache = build / ".llamarig-build.json", build / "CMakeCache.txt"
    results["build"] = {
        "dir": str(build),
        "seconds": round(marker.stat().st_mtime - cache.stat().st_mtime, 1),
        "cuobjdump": elf.strip().splitlines(),
        "architectures": sorted(
            {line.split(".")[-2] for line in elf.splitlines() if ".sm_" in line}
        ),
        "nccl_linked": "libnccl" in linked,
    }
    save()

    results["bandwidth_gbs"] = device_bandwidth_gbs()
    save()
    log(f"bandwidth {results['bandwidth_gbs']} GB/s")

    results["servers"] = {}
    for label, inventory, model in (
        ("8b-planned", rig_8b, model_8b),
        ("32b-planned", rig_32b, model_32b),
        ("32b-mixed", rig_mixed, model_32b),
        ("8b-single", rigs["8b-single"], model_8b),
    ):
        try:
            results["servers"][label] = serve_and_measure(label, inventory, model)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            results["servers"][label] = {"error": str(error)[-2000:]}
            log(f"{label}: {error}")
        save()

    mixed_data = host_data(rig_mixed)
    mixed_plan = plan_for(mixed_data, model_32b)
    mixed_ratio = mixed_plan.resolved["server"]["tensor_split"]
    binaries = {
        True: str(build / "bin" / "llama-bench"),
        False: str(nonccl_dir / "bin/llama-bench"),
    }
    results["sweep"] = {}
    # The 8B first: its rows take seconds each, the 32.5B's most of a minute (the load).
    configs = {model: sweep_configs(mixed_ratio) for model in (model_8b, model_32b)}
    # Every row with NCCL first, both models; the no-NCCL rows last, once their build is done.
    for with_nccl in (True, False):
        if not with_nccl:
            nonccl_thread.join()
            results["no_nccl_build_seconds"] = parallel.get("no_nccl_build_seconds")
        for model, model_configs in configs.items():
            rows = results["sweep"].setdefault(model.stem, [])
            for config in (c for c in model_configs if c["nccl"] == with_nccl):
                row = dict(config)
                binary = binaries[config["nccl"]]
                row.update(llama_bench(binary, model, config, f"sweep-{model.stem}.log"))
                if model == model_32b:
                    # Would it fit the mixed caps at the mixed rig's planned context?
                    ts = [float(x) for x in config["ts"].split("/")] if config["ts"] else None
                    capped = plan_for(
                        mixed_data,
                        model,
                        split_mode=config["sm"],
                        tensor_split=ts,
                        ctx=mixed_plan.memory.ctx,
                    )
                    row["fits_mixed_caps"] = bool(capped.memory and capped.memory.fits)
                rows.append(row)
                log(f"{model.stem} {config['label']}: {row.get('avg_ts', row.get('error'))}")
                save()
            results.setdefault("decode_bytes", {})[model.stem] = decode_bytes(model)
            save()
    results["finished"] = now()
    save()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
