"""Serving: the shell check that a (re)started server serves (which ``rollback`` shares), a
router's presets reloaded, the GPU overheads recorded; the port and endpoint checks; RPC workers
and the head that uses them; the server's flags checked against the built binary."""

from __future__ import annotations

import json
import re
import shlex

from pyinfra import host, logger
from pyinfra.api import (
    FunctionCommand,
    StringCommand,
    operation,
)

from llamarig.facts.cache import known
from llamarig.facts.gpu import MeasuredOverheads
from llamarig.facts.server import PROBE_COMPLETION, ServerProbe
from llamarig.facts.systemd import UnitState
from llamarig.onhost.hostpaths import CURL_AUTH
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.operations.drain import Drain, drain
from llamarig.operations.host import connected_host, fail
from llamarig.operations.rotation import Rotation, out_of_rotation
from llamarig.operations.rotation import callback as rotation_callback
from llamarig.operations.systemd import journal_tail_command, restart_command
from llamarig.serving.answers import Answer, verdict
from llamarig.serving.answers import check_command as answer_check_command
from llamarig.serving.answers import parse_output as parse_answer_output
from llamarig.tables.llama_args import option_name


def serving_check(
    base_url: str,
    service: str,
    timeout: int,
    timeouts: HttpTimeouts,
    presets: str | None = None,
) -> str:
    """Shell function ``serving``: waits until the unit answers /health with 200 and serves a
    4-token completion; returns 1 (with why in $why) when it crashes, on timeout or a failed
    completion. A router (``presets``): a completion of each model of the presets file installed
    when it runs (the new version's, or the one a rollback put back), in the file's order, which
    loads each; a failure names the model. Each look at /health is bounded by ``timeouts``'
    probe bound; a completion (which may load a router's model) by what is left of
    ``timeout``, at least the probe bound."""
    q_service = shlex.quote(service)
    health, completion = shlex.quote(f"{base_url}/health"), shlex.quote(f"{base_url}/completion")
    crashed = shlex.quote(f"{service} exited while starting")
    not_ready = shlex.quote(f"{base_url}/health not ready after {int(timeout)} s")
    failed = shlex.quote(f"{base_url}/completion failed: ")
    ask = (
        "left=$(( deadline - $(date +%s) )); "
        f'[ "$left" -ge {timeouts.probe} ] || left={timeouts.probe}; '
        f'answer=$(curl -sS --connect-timeout {timeouts.connect} --max-time "$left" '
        f"{CURL_AUTH} -H 'Content-Type: application/json' -d \"$body\" -- {completion} 2>&1)"
    )
    judge = (
        """case "$answer" in *'"content"'*) ;; *) why="$failed$(printf %s "$answer" | """
        'head -c 300)"; return 1 ;; esac'
    )
    body = shlex.quote(json.dumps(PROBE_COMPLETION))
    asks = f"  body={body}; failed={failed}\n  {ask}\n  {judge}"
    if presets:
        # The names are llamarig's own (letters, digits, ._-), safe inside the JSON string.
        # A version kept from before the rig had several models has no presets file.
        template = json.dumps({"model": "%s", **PROBE_COMPLETION})
        q_presets = shlex.quote(presets)
        asks = f"""  if [ -f {q_presets} ]; then
  for model in $(sed -n 's/^\\[\\(.*\\)\\]$/\\1/p' {q_presets}); do
    body=$(printf {shlex.quote(template)} "$model")
    failed={shlex.quote(f"{base_url}/completion of model ")}"$model failed: "
    {ask}
    {judge}
  done
  else
{asks}
  fi"""
    return f"""
serving() {{
  deadline=$(( $(date +%s) + {int(timeout)} ))
  until [ "$({timeouts.curl("probe")} -o /dev/null -w '%{{http_code}}' -- {health})" = 200 ]; do
    # A crash shows as `failed`, or as `auto-restart` while Restart= tries again.
    state="$(systemctl show -P ActiveState -- {q_service})"
    case "$state/$(systemctl show -P SubState -- {q_service})" in
      failed/*|*/auto-restart) why={crashed}; return 1 ;;
    esac
    if [ $(date +%s) -ge $deadline ]; then
      why={not_ready}; return 1
    fi
    sleep 1
  done
{asks}
}}
"""


@operation()
def record_gpu_overheads(
    directory: str, build: str, split_mode: str, gpu_indices: list[int], buffers_mib: list[int]
):
    """
    Record, once per build and split mode, what nvidia-smi shows on each used GPU beyond the
    plan's buffers (CUDA context, cuBLAS and NCCL workspaces), for the planner's next reserve.

    + directory: where the records live (one file ``BUILD.MODE`` each, read by the
      ``MeasuredOverheads`` fact)
    + build, split_mode: what the record is for
    + gpu_indices: nvidia-smi's index of each used GPU, in the plan's device order
    + buffers_mib: llama.cpp's buffers the plan put on each of them (weights, KV, compute)

    A record is never rewritten, so a later start of the same build (a few MiB apart) leaves the
    plan as it is. Call it after a start that served (guard it with ``_if=``).

    **Example:**

    .. code:: python

        record_gpu_overheads(
            directory="/var/lib/llamarig/gpu-overheads",
            build="0c1e57098bba-1a2b3c4d5e",
            split_mode="tensor",
            gpu_indices=[0, 1],
            buffers_mib=[18167, 18167],
        )
    """
    if (build, split_mode) in known(MeasuredOverheads, path=directory):
        host.noop(f"the GPU overhead of {build} in {split_mode} mode is recorded")
        return
    q_dir = shlex.quote(directory)
    record = shlex.quote(f"{directory}/{build}.{split_mode}")
    indices = shlex.quote(" ".join(str(index) for index in gpu_indices))
    buffers = shlex.quote(" ".join(str(mib) for mib in buffers_mib))
    yield (
        f"[ -e {record} ] || {{ mkdir -p {q_dir} && "
        "used=$(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits) && "
        f"printf '%s\\n' \"$used\" | awk -F', *' -v indices={indices} -v buffers={buffers} "
        '\'{ used[$1] = $2 } END { n = split(indices, i, " "); split(buffers, b, " "); '
        'for (k = 1; k <= n; k++) printf "%s%d", (k > 1 ? " " : ""), used[i[k]] - b[k]; '
        f'print "" }}\' > {record}.new && mv {record}.new {record}; }}'
    )


@operation(is_idempotent=False)
def reload_presets(
    base_url: str,
    service: str,
    timeout: int,
    http_timeouts: HttpTimeouts,
    unloading: tuple[str, ...] = (),
    drain_timeout: int = 0,
    rotation: Rotation | None = None,
):
    """
    Make a running llama-server router read its presets file again (``GET /models?reload=1``):
    a model whose options changed, or that is gone, is unloaded; a new one is listed; the
    others keep running and serving. The requests in flight on the models it unloads are
    waited for first, as a restart waits for the server's. Guard it with ``_if=``: it always
    reloads; check what it serves after it (``serve_or_roll_back``).

    + base_url: e.g. ``http://127.0.0.1:8080``
    + service: the router's unit, as the drain names it
    + timeout: seconds the router may take (it answers once the changed models have exited)
    + http_timeouts: the server's server.http_timeouts (the connect bound; each look at /slots)
    + unloading: the models the reload unloads (``render.unloaded_by_reload``)
    + drain_timeout: seconds to wait for their requests in flight (server.drain_timeout)
    + rotation: the gateways in front of this rig: when the reload unloads a model, the rig is
      taken out of their rotation first (``serve_or_roll_back`` puts it back once checked)

    **Example:**

    .. code:: python

        reload_presets(
            base_url="http://127.0.0.1:8080",
            service="llama-server.service",
            timeout=600,
            http_timeouts=HttpTimeouts.of(rig),
            unloading=("chat",),
            drain_timeout=120,
        )
    """
    if unloading and rotation:
        yield rotation_callback(out_of_rotation, rotation)
    if unloading and drain_timeout > 0:
        server = Drain(base_url, drain_timeout, http_timeouts, service=service, models=unloading)

        def drained(state, host) -> bool:
            changed = f"the model(s) whose presets changed ({', '.join(unloading)})"
            drain(host, server, restarting=changed)
            return True

        yield FunctionCommand(drained, (), {})
    url = shlex.quote(f"{base_url}/models?reload=1")
    yield (
        f"curl -sS -f --connect-timeout {int(http_timeouts.connect)} --max-time {int(timeout)} "
        f"{CURL_AUTH} -o /dev/null "
        f"-- {url}"
    )


def wrong_answers(host, base_url: str, answers: list[Answer], timeouts: HttpTimeouts) -> list[str]:
    """Ask each answer's question on the host; what each wrong one got (none: all right)."""
    wrong = []
    for answer in answers:
        command = answer_check_command(base_url, answer, timeouts)
        _, output = host.run_shell_command(StringCommand(command))
        status, body = parse_answer_output(output.stdout)
        problem = verdict(answer, status, body)
        if problem:
            wrong.append(problem)
    return wrong


def tcp_probe(endpoint: str) -> str:
    """A shell test that succeeds when ``endpoint`` (host:port, [v6]:port) accepts TCP."""
    address, _, port = endpoint.rpartition(":")
    if len(address) > 1 and address[0] == "[" and address[-1] == "]":
        address = address[1:-1]  # one pair: [v6]
    # Address and port reach bash as its arguments, never as part of its script.
    script = shlex.quote('exec 3<>"/dev/tcp/$1/$2"')
    return (
        f"timeout 3 bash -c {script} tcp-probe {shlex.quote(address)} {shlex.quote(port)} "
        "2>/dev/null"
    )


@operation(is_idempotent=False)
def wait_for_port(endpoint: str, service: str, timeout: int):
    """
    Wait until a (re)started service accepts TCP connections on ``endpoint``; else fail with its
    last journal lines and the sockets that hold its port. Servers that set SO_REUSEADDR
    (ggml-rpc-server, llama-server) still cannot bind a port an outgoing connection holds, even
    in TIME-WAIT, and a port in the kernel's ephemeral range is handed to those: the failure
    says so and names the fix.

    + endpoint: ``host:port`` the service listens on
    + service: systemd unit name (journal)
    + timeout: seconds to wait

    **Example:**

    .. code:: python

        wait_for_port(endpoint="10.0.0.12:50052", service="ggml-rpc-server", timeout=60)
    """
    quoted, q_endpoint = shlex.quote(service), shlex.quote(endpoint)
    port = shlex.quote(endpoint.rpartition(":")[2])
    yield f"""
deadline=$(( $(date +%s) + {int(timeout)} ))
until {tcp_probe(endpoint)}; do
  # A crash loop (auto-restart) or an exit (ggml-rpc-server exits 0 when it cannot bind) ends
  # the wait early.
  state=$(systemctl show --value -p ActiveState -p SubState -- {quoted} | tr '\\n' ' ')
  stopped=""
  case "$state" in *auto-restart*|*inactive*|*failed*) stopped=${{state% }} ;; esac
  if [ -n "$stopped" ] || [ $(date +%s) -ge $deadline ]; then
    if [ -n "$stopped" ]; then
      printf 'llamarig: %s stopped (%s) without accepting connections on %s; its journal:\\n' \\
        {quoted} "$stopped" {q_endpoint} >&2
    else
      printf 'llamarig: %s does not accept connections on %s after %s s; its journal:\\n' \\
        {quoted} {q_endpoint} {int(timeout)} >&2
    fi
    {journal_tail_command(service, 20)} >&2
    held=$(ss -Htanp "( sport = :"{port}" )" 2>/dev/null)
    if [ -n "$held" ]; then
      printf 'llamarig: sockets on port %s now (one bound elsewhere, or an outgoing' {port} >&2
      printf " connection's, even in TIME-WAIT, stops the bind):\\n%s\\n" "$held" >&2
      read -r low high < /proc/sys/net/ipv4/ip_local_port_range
      if [ {port} -ge "$low" ] && [ {port} -le "$high" ]; then
        printf 'llamarig: port %s lies in the kernel ephemeral range %s-%s, which outgoing' \\
          {port} "$low" "$high" >&2
        printf ' connections take: choose a port below %s, or reserve it' "$low" >&2
        printf ' (sysctl net.ipv4.ip_local_reserved_ports)\\n' >&2
      fi
    fi
    exit 1
  fi
  sleep 1
done
printf 'llamarig: %s listens on %s\\n' {quoted} {q_endpoint}
""".strip()


@operation(is_idempotent=False)
def check_rpc_workers(endpoints: list[str]):
    """
    Fail unless every RPC worker accepts connections from this host: a head restarted without
    its workers cannot load the model, so the run stops before the restart.

    + endpoints: the workers' ``host:port``

    **Example:**

    .. code:: python

        check_rpc_workers(endpoints=["10.0.0.12:50052", "10.0.0.13:50052"])
    """
    checks = "\n".join(
        f'{tcp_probe(endpoint)} || down="$down "{shlex.quote(endpoint)}' for endpoint in endpoints
    )
    yield f"""
down=""
{checks}
if [ -n "$down" ]; then
  echo "llamarig: RPC worker(s) not reachable from this head:$down - converge the workers" \\
    "(their ggml-rpc-server unit) and check the network; the running server was left as it is" >&2
  exit 1
fi
""".strip()


def server_flags(args: list[str]) -> list[str]:
    """The option names in a llama-server command line, as llama.cpp looks them up (``--top_k``
    is ``--top-k``; values such as ``-1`` excluded)."""
    return sorted({option_name(arg) for arg in args[1:] if re.match(r"^--?[A-Za-z]", arg)})


@operation(is_idempotent=False)
def check_server_flags(binary: str, args: list[str]):
    """
    Fail unless the built llama-server knows every option of ``args`` (from its ``--help``).

    + binary: the llama-server of the build about to be used
    + args: the command line the unit will run

    Runs before the `current` link and the unit change, so a flag the binary does not know
    stops the run while the old server keeps serving. Guard it to run only when the build or
    the command line changes.

    **Example:**

    .. code:: python

        check_server_flags(
            binary="/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e/bin/llama-server",
            args=["llama-server", "-m", "/opt/llamarig/models/m.gguf", "-lm", "none"],
        )
    """
    flags = " ".join(shlex.quote(flag) for flag in server_flags(args))
    q_binary = shlex.quote(binary)
    yield f"""
help=$({q_binary} --help 2>&1) || {{ printf 'llamarig: %s --help failed:\\n' {q_binary} >&2; \\
printf '%s\\n' "$help" | tail -5 >&2; exit 1; }}
unknown=""
for flag in {flags}; do
  printf '%s\\n' "$help" | grep -qE -- "(^|[ ,])$flag([ ,=]|$)" || unknown="$unknown $flag"
done
if [ -n "$unknown" ]; then
  printf 'llamarig: %s does not know:%s - fix server.extra_args (or the setting that adds' \\
    {q_binary} "$unknown" >&2
  echo " it); the unit and the running server were left unchanged" >&2
  exit 1
fi
""".strip()


@operation(is_idempotent=False)
def restart_rpc_head(
    head: str,
    service: str,
    base_url: str,
    timeout: int,
    http_timeouts: HttpTimeouts,
    worker: str,
):
    """
    Restart the head whose RPC worker restarted, over the head's own connection, and wait until
    it serves: the head's llama-server holds its model buffers on the worker, which a restart
    empties, so its next request would abort it (ggml-rpc: "Remote RPC server crashed or
    returned malformed response") and systemd would restart it under the users' requests. A
    head that is not running (stopped, or not deployed yet) is left as it is. Run it after the
    worker's restart, whose drain already waited for the head's requests in flight.

    + head: the inventory host the head runs on
    + service: its llama-server unit, e.g. ``llama-server.service``
    + base_url: where the head reaches its own server, e.g. ``http://127.0.0.1:8080``
    + timeout: seconds the head gets to serve again (its ``server.start_timeout``)
    + http_timeouts: the head's ``server.http_timeouts``
    + worker: what restarted, for the messages, e.g. ``ggml-rpc-server.service``

    **Example:**

    .. code:: python

        restart_rpc_head(
            head="gpu-head",
            service="llama-server.service",
            base_url="http://127.0.0.1:8080",
            timeout=600,
            http_timeouts=HttpTimeouts(connect=5, probe=15, answer=120, generation=600),
            worker="ggml-rpc-server.service",
        )
    """
    label = f"{service} on {head}"
    quoted = shlex.quote(service)
    not_running = shlex.quote(f"llamarig: {label} is not running: left as it is")
    serves = shlex.quote(f"llamarig: {label}, restarted after {worker}, serves again")
    broken = shlex.quote(f"llamarig: {label}, restarted after {worker}, does not serve: ")
    script = (
        serving_check(base_url, service, timeout, http_timeouts)
        + f"""
if [ "$(systemctl show -P ActiveState -- {quoted})" = inactive ]; then
  echo {not_running}; exit 0
fi
{restart_command(service)}
if serving; then echo {serves}; exit 0; fi
echo {broken}"$why; its journal:"
{journal_tail_command(service, 20)}
exit 1
"""
    )

    def restarted(state, host) -> bool:
        server_host = connected_host(state, head, f"to restart it after {worker}")
        if not server_host:
            host.log_styled(
                f"llamarig: {head} is not reachable, so {service} there was not restarted after "
                f"{worker}: its next request would abort it; converge {head} or run "
                f"`systemctl restart {service}` there",
                fg="red",
                log_func=logger.error,
            )
            return False
        succeeded, output = server_host.run_shell_command(StringCommand(script))
        for line in output.output_lines:
            host.log(line, log_func=logger.info if succeeded else logger.error)
        return succeeded

    yield FunctionCommand(restarted, (), {})


@operation(is_idempotent=False)
def check_serving(
    unit: str, base_url: str, http_timeouts: HttpTimeouts, models: tuple[str, ...] = ()
):
    """
    Fail unless the unit is active, ``/health`` answers 200 and a 4-token completion succeeds
    (the ``ServerProbe`` fact, from the host itself, every request bounded; with every slot
    busy the completion is not sent and the check passes); changes nothing. Guard it with ``_if=``
    to skip it after a (re)start whose wait checked the same.

    + unit: the server's unit, e.g. ``llama-server.service``
    + base_url: e.g. ``http://127.0.0.1:8080``
    + http_timeouts: the rig's server.http_timeouts (connect and probe bound each request)
    + models: a router's model names: the slots of the loaded ones are counted, the completion
      asks one with an idle slot, and none loaded passes (each loads at its first request)

    **Example:**

    .. code:: python

        check_serving(
            unit="llama-server.service",
            base_url="http://127.0.0.1:8080",
            http_timeouts=HttpTimeouts.of(rig),
        )
    """
    active = known(UnitState, unit=unit)["active"]
    probe = host.get_fact(
        ServerProbe, base_url=base_url, timeouts=http_timeouts, models=tuple(models)
    )
    problems = []
    if not active:
        problems.append(f"{unit} is not active (systemctl status {unit})")
    if probe["health"] == 0:
        problems.append(
            f"{base_url}/health gave no answer within {http_timeouts.said('probe')}: the "
            "server is hung or not listening"
        )
    elif probe["health"] != 200:
        problems.append(f"{base_url}/health answered {probe['health']}, not 200")
    elif probe["completion_ok"] is False:
        problems.append(
            f"a 4-token {base_url}/completion did not succeed within {http_timeouts.said('probe')}"
        )
    if problems:
        yield from fail._inner("; ".join(problems))
        return
    if not probe["loaded"]:
        host.noop(
            f"{unit} active, /health 200, no model loaded ({', '.join(models)}: each loads at "
            "its first request)"
        )
        return
    if probe["completion_ok"] is None:
        host.noop(
            f"{unit} active, /health 200, serving: {probe['busy']} of {probe['slots']} slots "
            "busy (no probe completion sent, it would wait behind them)"
        )
        return
    speed = probe["tokens_per_second"]
    host.noop(
        f"{unit} active, /health 200, completion at "
        + (f"{speed:.1f} tokens/s" if speed is not None else "an unreported speed")
    )
