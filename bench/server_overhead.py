"""Where the deployed server's decode time goes next to llama-bench's, on the GPU machine (the
models and the deploy are made first unless bench/run.sh left them in /srv/llamarig): the
deployed server as planned and with llama-server flags added through `llamarig run -- FLAGS`
(CPU threads, backend sampling), and llama-bench at the same thread counts, in one run.

python3 bench/server_overhead.py  ->  $OUT/overhead.json
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_bench import (  # noqa: E402
    BENCH_FLAGS,
    MODELS,
    ROOT,
    SAMPLING,
    WORK,
    completion,
    deploy,
    env_for,
    rig_files,
    write_model,
)

OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
BENCH = "/opt/llamarig/current/bin/llama-bench"
VARIANTS = {
    "llama-8b-q8_0": [[], ["-t", "1"], ["-bs"], ["-t", "1", "-bs"]],
    "llama-32b-q8_0": [[], ["-t", "1", "-bs"]],
}
RIGS = {"llama-8b-q8_0": WORK / "rig-8b.yml", "llama-32b-q8_0": WORK / "rig-32b.yml"}
results: dict = {"server": {}, "bench": {}}


def save() -> None:
    (OUT / "overhead.json").write_text(json.dumps(results, indent=2))


def served(model: str, extra: list[str]) -> dict:
    log = open(OUT / f"server-{model}-{'_'.join(extra) or 'planned'}.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "llamarig.cli", "run", "--", *extra],
        cwd=ROOT, env=env_for(RIGS[model]), stdout=log, stderr=subprocess.STDOUT,
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


def bench(model: str, threads: str) -> float | str:
    command = [BENCH, "-m", str(WORK / "models" / f"{model}.gguf"), "-sm", "tensor", "-ts", "1/1",
               *BENCH_FLAGS, "-t", threads, "-o", "json"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        return result.stderr.strip()[-300:]
    return round(json.loads(result.stdout)[0]["avg_ts"], 1)


def prepare() -> None:
    """The models and the 8B rig's deploy (the build), unless an earlier run left them."""
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    rigs = rig_files()
    if not (MODELS / "llama-8b-q8_0.gguf").exists():
        write_model("llama-8b")
    if not (MODELS / "llama-32b-q8_0.gguf").exists():
        writer = threading.Thread(target=write_model, args=("llama-32b",))
        writer.start()
        results["deploy"] = deploy(rigs["8b"], "deploy-overhead.log")
        writer.join()
    else:
        results["deploy"] = deploy(rigs["8b"], "deploy-overhead.log")
    print("deploy", results["deploy"]["seconds"], "s", flush=True)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    prepare()
    for model, variants in VARIANTS.items():
        results["bench"][model] = {t: bench(model, t) for t in ("1", "32")}
        save()
        for extra in variants:
            label = " ".join(extra) or "as planned"
            results["server"].setdefault(model, {})[label] = served(model, extra)
            print(model, label, results["server"][model][label], flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
