"""The drain before a restart (operations.drain): /slots is asked on the host the server runs
on, what it waits for is said on the host that restarts, and the bound cuts what is left."""

from importlib import import_module
from types import SimpleNamespace

import pytest

from llamarig import operations
from tests.conftest import default_http_timeouts

BOUNDS = default_http_timeouts()


class Host:
    """A host that answers the slot count command with the next of ``busy`` (of 2 slots)."""

    def __init__(self, busy: list[int] | None = None) -> None:
        self.busy = list(busy or [])
        self.commands: list[str] = []
        self.said: list[str] = []

    def run_shell_command(self, command):
        self.commands.append(str(command))
        busy = self.busy.pop(0) if len(self.busy) > 1 else self.busy[0]
        return True, SimpleNamespace(stdout_lines=[f"slots 2 {busy}"])

    def log(self, message, log_func=None):
        self.said.append(message)

    def log_styled(self, message, **_):
        self.said.append(message)


def local_server(timeout: int) -> operations.Drain:
    return operations.Drain(
        url="http://127.0.0.1:8080", timeout=timeout, bounds=BOUNDS, service="llama-server.service"
    )


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    # `operations.drain` is the function: the module is reached by its import path.
    monkeypatch.setattr(import_module("llamarig.operations.drain"), "DRAIN_POLL_S", 0.01)


def test_a_worker_restart_waits_for_the_head_requests_asked_on_the_head():
    worker, head = Host(), Host(busy=[2, 1, 0])
    operations.drain(
        worker,
        operations.Drain(
            url="http://127.0.0.1:8086",
            timeout=60,
            bounds=BOUNDS,
            host="rpc-head",
            service="llama-server.service",
        ),
        server_host=head,
        restarting="ggml-rpc-server.service",
    )
    assert worker.commands == [], "the worker cannot see the head's loopback"
    assert len(head.commands) == 3
    assert all("http://127.0.0.1:8086/slots" in command for command in head.commands)
    # Each look is bounded by the head's server.http_timeouts: a hung head holds no restart.
    assert all("--connect-timeout 5 --max-time 15 " in command for command in head.commands)
    assert worker.said[0].startswith(
        "llamarig: waiting for 2 of 2 slots of llama-server.service on rpc-head to finish their "
        "requests before restarting ggml-rpc-server.service ("
    )
    assert worker.said[-1].startswith(
        "llamarig: the requests in flight on llama-server.service on rpc-head finished after"
    )
    assert worker.said[-1].endswith("restarting ggml-rpc-server.service")
    assert head.said == []


def test_the_bound_restarts_anyway_and_counts_what_it_cuts():
    server = Host(busy=[2])
    operations.drain(server, local_server(timeout=1))
    assert server.said[-1] == (
        "llamarig: 2 of 2 slots of llama-server.service still busy after 1 s "
        "(server.drain_timeout): restarting it anyway, cutting 2 request(s)"
    )
    assert len(server.commands) > 2  # it polled until the bound


@pytest.mark.parametrize("busy", [[0], None])
def test_nothing_to_wait_for(busy):
    server = Host(busy=busy or [2])
    operations.drain(server, local_server(timeout=0 if not busy else 5))
    assert server.said == []
    assert len(server.commands) == (1 if busy else 0)


def reload_commands(unloading: tuple[str, ...], drain_timeout: int) -> list:
    """What reload_presets yields for a router at 8100 unloading ``unloading``."""
    return list(
        operations.reload_presets._inner(
            base_url="http://127.0.0.1:8100",
            service="llama-server.service",
            timeout=120,
            http_timeouts=BOUNDS,
            unloading=unloading,
            drain_timeout=drain_timeout,
        )
    )


def test_a_presets_reload_waits_for_the_requests_of_the_models_it_unloads():
    server = Host(busy=[1, 0])
    drained, reload = reload_commands(("smollm2",), 60)
    drained.function(None, server)
    # Only the unloaded model's slots are asked for, never loading it to ask.
    assert len(server.commands) == 2
    assert all("/slots?model=smollm2&autoload=false" in c for c in server.commands)
    assert not any("tiny" in c for c in server.commands)
    assert server.said[0].startswith(
        "llamarig: waiting for 1 of 2 slots of llama-server.service to finish their requests "
        "before restarting the model(s) whose presets changed (smollm2) ("
    )
    assert "/models?reload=1" in reload and "--connect-timeout 5 --max-time 120 " in reload


@pytest.mark.parametrize("unloading, bound", [((), 60), (("smollm2",), 0)])
def test_a_reload_that_unloads_nothing_or_may_not_wait_reloads_at_once(unloading, bound):
    commands = reload_commands(unloading, bound)
    assert len(commands) == 1 and "/models?reload=1" in commands[0]
