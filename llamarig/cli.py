"""The `llamarig` command: plan the rigs, try a completion, run the sandbox rig."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from llamarig import render
from llamarig.config import ConfigError, inventory_path, load_inventory
from llamarig.gguf_header import GgufError
from llamarig.plan import HOST_HEADER_READ, gpus_from_pci, header_from_host, load_header, plan_host


def _probe(data: dict) -> tuple[list[dict] | None, str, str | None]:
    """GPUs of a host over SSH: nvidia-smi when the driver answers, else PCI ids from sysfs."""
    from llamarig.facts import NVIDIA_SMI_FIELDS, NvidiaPciDevices, parse_nvidia_smi_line

    query = f"nvidia-smi --query-gpu={','.join(NVIDIA_SMI_FIELDS)} --format=csv,noheader,nounits"
    result = _on_host(data, query)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode == 0 and lines:
        gpus = [parse_nvidia_smi_line(line) for line in lines]
        return gpus, "nvidia-smi", gpus[0]["driver_version"]
    result = _on_host(data, NvidiaPciDevices().command())
    devices = NvidiaPciDevices().process(result.stdout.splitlines())
    gpus, _ = gpus_from_pci(devices)
    return gpus or None, "PCI ids", None


def host_header(data: dict, model: str | None = None, contact: bool = False):
    """The model's GGUF header: ``model`` (a local copy), the model URL, else the file on the
    host (read in place on a local host; over SSH only when ``contact`` allows it)."""
    from llamarig.facts import FileHead

    header, note = load_header(data, model)
    if header is not None or not (contact or data["ssh"].get("local")):
        return header, note
    path = render.layout(data)["model"]
    head = FileHead().process(_on_host(data, FileHead().command(path, HOST_HEADER_READ)).stdout)
    return header_from_host(head, path, note)


def _on_host(data: dict, command: str) -> subprocess.CompletedProcess:
    argv = ["sh", "-c", command] if data["ssh"].get("local") else [*ssh_command(data), command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _plan(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    if args.host and args.host not in inventory.hosts:
        print(f"llamarig: no host {args.host!r} in {inventory.path}", file=sys.stderr)
        return 2
    plans = {}
    for name, host_config in inventory.hosts.items():
        if args.host and name != args.host:
            continue
        data = host_config.data
        probed, source, driver_version = _probe(data) if args.probe else (None, "probed", None)
        header, note = None, ""
        if data["llama_cpp"]["backend"] == "cuda":
            header, note = host_header(data, args.model, args.probe)
        plans[name] = plan_host(name, data, header, note, probed, source, driver_version)
    if args.json:
        print(json.dumps({"hosts": {n: p.to_json() for n, p in plans.items()}}, indent=2))
    else:
        for host_plan in plans.values():
            print(host_plan.report())
            if args.unit and host_plan.server_args_ready:
                print(render.render_unit(host_plan.resolved))
                print(render.render_env_file(host_plan.resolved))
    return 0 if all(p.fits for p in plans.values()) else 1


def ssh_command(data: dict, *options: str) -> list[str]:
    """An ssh command line for a host (``options`` added), with the same host-key checking as
    the deploy: strict, or accept-new where the user opted in (`ssh.host_key_checking`).

    `--` ends the options: the destination is never read as one (`-oProxyCommand=...` would run
    a command here), though the loader refuses such a host already."""
    from llamarig.config import expand_path, strict_host_key_checking

    ssh = data["ssh"]
    checking = f"StrictHostKeyChecking={strict_host_key_checking(ssh)}"
    command = ["ssh", "-o", checking, "-o", "BatchMode=yes"]
    if "known_hosts" in ssh:
        known_hosts = ssh_config_value(expand_path(ssh["known_hosts"]))
        command += ["-o", f"UserKnownHostsFile={known_hosts}"]
    if "key" in ssh:
        # As an option, not -i: ssh checks an -i path before it expands %-tokens in it, so no
        # spelling of a path with `%` would work there.
        command += ["-o", f"IdentityFile={ssh_config_value(expand_path(ssh['key']))}"]
    command += ["-p", str(ssh.get("port", 22)), *options]
    user = f"{ssh['user']}@" if "user" in ssh else ""
    return [*command, "--", f"{user}{ssh['host']}"]


def ssh_config_value(value: str) -> str:
    """``value`` as one argument of an ssh_config line (or ``ssh -o``): %-tokens escaped, and
    quoted (ssh splits arguments at spaces, honouring double quotes and backslashes)."""
    value = value.replace("%", "%%")
    if value and not any(ch in value for ch in " \t\"'\\#"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _complete(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    status = 0
    for name, host_config in inventory.hosts.items():
        if args.host and name != args.host:
            continue
        data = host_config.data
        body = json.dumps({"prompt": args.prompt, "n_predict": args.tokens, "temperature": 0})
        completion = shlex.quote(f"{render.base_url(data)}/completion")
        curl = (
            f"curl -sS -f {render.CURL_AUTH} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} -- {completion}"
        )
        command = ["sh", "-c", curl] if data["ssh"].get("local") else [*ssh_command(data), curl]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{name}: completion failed: {result.stderr.strip()}", file=sys.stderr)
            status = 1
            continue
        answer = json.loads(result.stdout)
        speed = answer.get("timings", {}).get("predicted_per_second", 0.0)
        print(f"{name}: endpoint {render.base_url(data)} (on the host)")
        print(f"  prompt:     {args.prompt!r}")
        print(f"  completion: {answer['content']!r}")
        print(f"  {answer.get('tokens_predicted')} tokens at {speed:.1f} tokens/s")
    return status


def _verify(args: argparse.Namespace) -> int:
    from llamarig.verify import verify_host

    inventory = load_inventory()
    if args.host and args.host not in inventory.hosts:
        print(f"llamarig: no host {args.host!r} in {inventory.path}", file=sys.stderr)
        return 2
    statuses = [
        verify_host(host_config, args.pytest_args)
        for name, host_config in inventory.hosts.items()
        if not args.host or name == args.host
    ]
    return max(statuses, default=0)


def _run(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    names = [args.host] if args.host else list(inventory.hosts)
    if len(names) != 1 or names[0] not in inventory.hosts:
        print(
            f"llamarig: name one host of {inventory.path} with --host "
            f"({', '.join(inventory.hosts)})",
            file=sys.stderr,
        )
        return 2
    data = inventory.hosts[names[0]].data
    launcher = [render.layout(data)["launcher"], *args.server_args]
    if data["server"]["supervisor"] == "systemd":
        print(
            f"llamarig: running {launcher[0]} in the foreground; it cannot bind while the "
            f"unit serves (systemctl stop {data['server']['service']} first)",
            file=sys.stderr,
        )
    sys.stdout.flush()
    if data["ssh"].get("local"):
        if not os.access(launcher[0], os.X_OK):
            print(f"llamarig: no launcher {launcher[0]}: run the deploy first", file=sys.stderr)
            return 1
        os.execv(launcher[0], launcher)
    # -t: a terminal, so Ctrl-C stops the remote server too.
    os.execvp("ssh", [*ssh_command(data, "-t"), shlex.join(launcher)])
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamarig", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    plan_parser = commands.add_parser(
        "plan",
        help=f"plan each host of RIG_INVENTORY (now {inventory_path()}) without changing "
        "anything: GPUs, architectures, version checks, per-GPU memory, cmake and llama-server "
        "arguments; exit 1 when a plan does not fit",
    )
    plan_parser.add_argument("--host", help="only this host")
    plan_parser.add_argument("--model", help="plan against this local GGUF file")
    plan_parser.add_argument(
        "--probe", action="store_true", help="read the GPUs from the host over SSH"
    )
    plan_parser.add_argument("--json", action="store_true", help="print one JSON object")
    plan_parser.add_argument("--unit", action="store_true", help="also print unit and env file")

    complete_parser = commands.add_parser(
        "complete", help="send a completion to each host's server (over SSH) and print it"
    )
    complete_parser.add_argument("--host", help="only this host")
    complete_parser.add_argument("--prompt", default="The llama is an animal that")
    complete_parser.add_argument("--tokens", type=int, default=16)

    verify_parser = commands.add_parser(
        "verify",
        help="check each host against its rig data with the testinfra suite in llamarig/checks "
        "(over ssh:// with strict host keys); exit non-zero when a check fails",
    )
    verify_parser.add_argument("--host", help="only this host")
    verify_parser.add_argument(
        "pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k service"
    )

    run_parser = commands.add_parser(
        "run",
        help="start a host's llama-server in the foreground with the command line the deploy "
        "planned (its launcher): for hosts without systemd (server.supervisor: none) and for "
        "debugging; over SSH for remote hosts",
    )
    run_parser.add_argument("--host", help="the host (required when the inventory has several)")
    run_parser.add_argument(
        "server_args", nargs="*", help="more llama-server arguments (after --), e.g. -lv 4"
    )

    commands.add_parser(
        "sandbox",
        help="the local sandbox rig: sandbox up|down|status (see `llamarig sandbox -h`)",
        add_help=False,
    )

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sandbox"]:
        from llamarig import sandbox

        return sandbox.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        commands_by_name = {"plan": _plan, "complete": _complete, "verify": _verify, "run": _run}
        return commands_by_name[args.command](args)
    except ConfigError as error:
        print("llamarig: the rig configuration is not valid:", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    except GgufError as error:  # the --model file; it names itself
        print(f"llamarig: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
