"""Where the deployed server's decode time goes next to llama-bench's, on the GPU machine (the
models and the deploy are made first unless bench/run.sh left them in /srv/llamarig): the
deployed server as planned and with llama-server flags added through `llamarig run -- FLAGS`
(CPU threads, context size, priority, backend sampling), and llama-bench at two thread
counts, in one run.

python3 bench/server_overhead.py  ->  $OUT/overhead.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_bench import (  # noqa: E402
    BENCH_FLAGS,
    MODELS,
    OUT,
    RIG,
    decode_speeds,
    deploy,
    host_data,
    now,
    rig_files,
    running_server,
    write_model,
)
from llamarig.planner.render import layout

MODEL_8B = MODELS / "llama-8b-q8_0.gguf"
# (rig, llama-server flags added to the planned command line): the planned 8B tensor 1:1 rig,
# at llama-bench's small context too, at high and realtime priority (the server's main thread
# waits on a worker thread's wake-up at every token), and on one GPU with and without backend
# sampling (which llama.cpp does not support in tensor mode: it logs so and samples on the CPU).
VARIANTS = [
    ("8b", []),
    ("8b", ["-t", "1"]),
    ("8b", ["-c", "512"]),
    ("8b", ["-c", "4096"]),
    ("8b", ["--prio", "2"]),
    ("8b", ["--prio", "3"]),
    ("8b-single", []),
    ("8b-single", ["-bs"]),
]
BENCH_SPLITS = {"8b": ["-sm", "tensor", "-ts", "1/1"], "8b-single": ["-sm", "none"]}
results: dict = {"server": {}, "bench": {}}


def save() -> None:
    (OUT / "overhead.json").write_text(json.dumps(results, indent=2))


def served(rig: Path, extra: list[str]) -> dict:
    # The launcher `llamarig run` execs is the last deploy's: deploy this rig first (no build).
    deploy(rig, f"deploy-{rig.stem}.log")
    log = OUT / "logs" / f"server-{rig.stem}-{'_'.join(extra) or 'planned'}.log"
    try:
        with running_server(rig, log, extra) as (base, _):
            speeds = decode_speeds(base)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        return {"error": str(error)}
    return {sampling: round(statistics.median(values), 1) for sampling, values in speeds.items()}


def bench(binary: str, rig: str, threads: str) -> float | str:
    command = [binary, "-m", str(MODEL_8B), *BENCH_SPLITS[rig], *BENCH_FLAGS, "-t", threads,
               "-o", "json"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        return result.stderr.strip()[-300:]
    return round(json.loads(result.stdout)[0]["avg_ts"], 1)


def prepare() -> dict[str, Path]:
    """The 8B model and its rig's deploy (the build), unless an earlier run left them."""
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    rigs = rig_files()
    if not MODEL_8B.exists():
        write_model("llama-8b")
    results["deploy"] = deploy(rigs["8b"], "deploy-overhead.log")
    print("deploy", results["deploy"]["seconds"], "s", flush=True)
    return rigs


def main() -> int:
    results["started"] = now()
    OUT.mkdir(parents=True, exist_ok=True)
    rigs = prepare()
    binary = f"{layout(host_data(RIG))['current']}/bin/llama-bench"
    for rig in BENCH_SPLITS:
        results["bench"][rig] = {t: bench(binary, rig, t) for t in ("1", "32")}
        save()
    for rig, extra in VARIANTS:
        label = f"{rig} {' '.join(extra) or 'as planned'}"
        results["server"][label] = served(rigs[rig], extra)
        print(label, results["server"][label], flush=True)
        save()
    results["finished"] = now()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
