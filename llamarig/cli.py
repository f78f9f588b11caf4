"""The `llamarig` command: plan the rigs, try a completion, run the sandbox rig."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from llamarig import render
from llamarig.config import ConfigError, inventory_path, load_inventory
from llamarig.gguf_header import GgufError
from llamarig.plan import plan_host
from llamarig.remote import SshTarget, gather, run_on_host, shell_reader
from llamarig.verify import verify_host


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
        # The host is contacted only with --probe; a local host's model file is read in place.
        contact = args.probe or data["ssh"].get("local")
        reader = shell_reader(data) if contact else None
        gathered = gather(data, reader, gpus=args.probe, model=args.model)
        plans[name] = plan_host(name, data, **gathered.plan_inputs())
    if args.json:
        print(json.dumps({"hosts": {n: p.to_json() for n, p in plans.items()}}, indent=2))
    else:
        for host_plan in plans.values():
            print(host_plan.report())
            if args.unit and host_plan.server_args_ready:
                print(render.render_unit(host_plan.resolved))
                print(render.render_env_file(host_plan.resolved))
    return 0 if all(p.fits for p in plans.values()) else 1


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
        result = run_on_host(data, curl, timeout=None)
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
    os.execvp("ssh", [*SshTarget.of(data["ssh"]).argv("-t"), shlex.join(launcher)])
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
