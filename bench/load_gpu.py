"""bench/load.py on one GPU: the 8B Q8_0 model (bench/models.py) served by llama-server of the
pinned build with 16 slots, K = 1, 2, 4, 8, 16 clients against llama-batched-bench of the same
build at the same batches, for the server flags that change throughput under load: the
defaults, backend sampling (-bs) and a unified KV cache (-kvu). Run by bench/load_h200.sh.

python3 bench/load_gpu.py BUILD_BIN MODEL OUT_DIR [VARIANT ...]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import load  # noqa: E402

SLOTS = 16
CTX = SLOTS * 512  # each slot holds a ~130-token prompt and 128 tokens with room to spare
PORT = 8181
COMMON = ["-ngl", "99", "-fa", "on", "-c", str(CTX)]
VARIANTS = {
    "default": [],
    "backend-sampling": ["-bs"],
    "kv-unified": ["-kvu"],
    # The physical batch, which `tune --for throughput` sweeps: 16 clients' prompts at once.
    "bs-ub256": ["-bs", "-ub", "256"],
    "bs-ub1024": ["-bs", "-ub", "1024"],
    "bs-ub2048": ["-bs", "-b", "4096", "-ub", "2048"],
}
# Measured unless named on the command line (LOAD_VARIANTS in bench/load_h200.sh).
DEFAULT_VARIANTS = ("default", "backend-sampling", "kv-unified")
CLIENTS = "1,2,4,8,16"


def serve(binary: Path, model: Path, flags: list[str], log: Path) -> subprocess.Popen:
    argv = [str(binary), "-m", str(model), *COMMON, "-np", str(SLOTS), "--metrics"]
    argv += ["--host", "127.0.0.1", "--port", str(PORT), "--alias", "llama-8b", *flags]
    server = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited {server.returncode}: see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("llama-server did not serve in 600 s")


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main(argv: list[str]) -> int:
    binaries, model, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in argv[3:] or DEFAULT_VARIANTS:
        flags = VARIANTS[name]
        server = serve(binaries / "llama-server", model, flags, out / f"server-{name}.log")
        try:
            ceiling = [str(binaries / "llama-batched-bench"), "-m", str(model), *COMMON]
            # The engine with the same cache and batch flags (sampling is not the engine's).
            ceiling += [flag for flag in flags if flag != "-bs"]
            # The batched bench runs after the clients, with the server idle but loaded: both
            # fit the H200's memory many times over.
            code = load.main(
                ["--url", f"http://127.0.0.1:{PORT}", "--model", "llama-8b"]
                + ["--clients", CLIENTS, "--tokens", "128", "--rounds", "5", "--bound", "300"]
                + ["--out", str(out / f"load-{name}.json"), "--plot", str(out / f"{name}.png")]
                + ["--batched-bench", " ".join(ceiling), "--title", f"8B Q8_0, H200, {name}"]
            )
        finally:
            stop(server)
        summary[name] = {"exit": code, **json.loads((out / f"load-{name}.json").read_text())}
        (out / "load-summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
