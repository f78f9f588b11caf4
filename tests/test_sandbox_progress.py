"""What a person sees during a plain `pyinfra -y inventory.py deploy.py` (no -v, no --json) of a
fresh sandbox: the llama.cpp build's ninja steps and the model download's bytes, rate and ETA
every few seconds, then how long each took.

Stand-ins, stated plainly: the model comes from a loopback server that trickles it at 6 MiB/s
(so the download of its 94 MiB outlasts several of the 3 s prints), llama.cpp from the
sandbox's `git daemon` mirror; the build is a real ninja build in a fresh build directory, one
compiler at a time (through the shared ccache, warm after the first run: cold, the build takes
9 minutes)."""

from __future__ import annotations

import os
import re
import threading

import pytest
import yaml

from tests.conftest import PROJECT
from tests.sandboxes import (
    changed_operations,
    converge,
    deploy,
    fresh_sandbox,
    lane_rig,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

INVENTORY = PROJECT / "inventory" / "hosts.yml"
BUILD_LINE = re.compile(r"^    \[sandbox\] build: \[(\d+)/(\d+)\] \d+%, (\w+) elapsed$", re.M)
DOWNLOAD_LINE = re.compile(
    r"^    \[sandbox\] download: ([\d.]+) (B|KiB|MiB) of ([\d.]+ MiB) \(\d+%\), "
    r"[\d.]+ (?:KiB|MiB)/s, ETA \w+, \w+ elapsed$",
    re.M,
)


def seconds(duration: str) -> int:
    """``1m05s`` -> 65 (progress.format_duration's form)."""
    hours, minutes, secs = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s", duration).groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + int(secs)


@pytest.fixture(scope="module")
def sandbox_info():
    yield from fresh_sandbox("sandbox-trixie", "trixie", 2222)


@pytest.fixture
def trickled_model():
    """The sandbox's model file served at 6 MiB/s on a free loopback port."""
    from llamarig_sandbox import layout, services
    from llamarig_sandbox.fileserver import make_server

    server = make_server(layout.WWW_DIR, 0)
    server.RequestHandlerClass.chunk_bytes = 256 << 10
    server.RequestHandlerClass.chunk_pause = 0.04
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{services.MODEL_NAME}"
    server.shutdown()


def test_a_plain_deploy_shows_build_and_download_progress(sandbox_info, tmp_path, trickled_model):
    document = yaml.safe_load(INVENTORY.read_text())
    host = document["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    host["model"] = {"url": trickled_model, "sha256": sandbox_info.model_sha256}
    # One compiler at a time: from a warm ccache (every object a cache hit) the build takes
    # seconds; this makes it last a few polls.
    host["llama_cpp"]["jobs"] = 1
    lane_rig(host)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump(document))

    result = deploy(inventory)
    assert result.returncode == 0, result.stderr[-6000:]
    output = result.stderr
    print(
        "\n".join(line for line in output.splitlines() if "build:" in line or "download:" in line)
    )

    steps = [(int(done), int(total)) for done, total, _ in BUILD_LINE.findall(output)]
    assert re.search(r"\[sandbox\] build: configuring, \d+s elapsed", output), output[-6000:]
    built = re.search(r"\[sandbox\] build: built in (\w+) \((\d+) steps\)", output)
    assert built, output[-6000:]
    # Each step line counts towards the total the build reports at its end.
    assert all(total == int(built.group(2)) for _, total in steps), output[-6000:]
    # A line every 3 s (the configure line, then ninja's steps) however long the build took:
    # from a warm ccache, 3 to 10 s here (in 3 s, the configure line alone is due).
    assert 1 + len(steps) >= seconds(built.group(1)) // 3, output[-6000:]
    assert [done for done, _ in steps] == sorted(done for done, _ in steps)

    downloads = DOWNLOAD_LINE.findall(output)
    assert len(downloads) >= 3, output[-6000:]
    factor = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    sizes = [float(number) * factor[unit] for number, unit, _ in downloads]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    assert re.search(r"\[sandbox\] download: downloaded [\d.]+ MiB in \w+ \(", output)

    # Up to date: nothing runs, so no progress either.
    results = converge(inventory)
    assert results["totals"]["success"] == 0, changed_operations(results)
