"""Where the deployed server's decode time goes next to llama-bench's, on the GPU machine (the
models and the deploy are made first unless bench/run.sh left them in /srv/llamarig): the
deployed server as planned and with llama-server flags added through `llamarig run -- FLAGS`
(CPU threads, context size, backend sampling), and llama-bench at two thread counts, in one run.

python3 bench/server_overhead.py  ->  $OUT/overhead.json
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_bench import (  # noqa: E402
    BENCH_FLAGS,
    MODELS,
    ROOT,
    SAMPLING,
    completion,
    deploy,
    env_for,
    rig_files,
    write_model,
)

OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
BENCH = "/opt/llamarig/current/bin/llama-bench"
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


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def save() -> None:
    (OUT / "overhead.json").write_text(json.dumps(results, indent=2))


def served(rig: Path, extra: list[str]) -> dict:
    log = open(OUT / "logs" / f"server-{rig.stem}-{'_'.join(extra) or 'planned'}.log", "w")
    # The launcher `llamarig run` execs is the last deploy's: deploy this rig first (no build).
    deploy(rig, f"deploy-{rig.stem}.log")
    server = subprocess.Popen(
        [sys.executable, "-m", "llamarig.cli", "run", "--", *extra],
        cwd=ROOT, env=env_for(rig), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        while True:
            if server.poll() is not None:
                return {"error": f"exited {server.returncode}"}
            try:
                with urllib.request.urlopen("http://127.0.0.1:8090/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        base = "http://127.0.0.1:8090"
        completion(base)
        entry = {}
        for sampling in SAMPLING:
            runs = [completion(base, sampling) for _ in range(5)]
            speeds = [run["timings"]["predicted_per_second"] for run in runs]
            entry[sampling] = round(statistics.median(speeds), 1)
        return entry
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        return {"error": str(error)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        log.close()


def bench(rig: str, threads: str) -> float | str:
    command = [BENCH, "-m", str(MODEL_8B), *BENCH_SPLITS[rig], *BENCH_FLAGS, "-t", threads,
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
    for rig in BENCH_SPLITS:
        results["bench"][rig] = {threads: bench(rig, threads) for threads in ("1", "32")}
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
