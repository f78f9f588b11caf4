"""The `llamarig` command: the sandbox rig, and what the deploy would write for each host."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from llamarig import render
from llamarig.config import ConfigError, inventory_path, load_inventory


def _render(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    names = [args.host] if args.host else list(inventory.hosts)
    for name in names:
        if name not in inventory.hosts:
            print(f"llamarig: no host {name!r} in {inventory.path}", file=sys.stderr)
            return 2
        data = inventory.hosts[name].data
        print(f"# {name} ({inventory.path})")
        print(f"build directory: {render.layout(data)['build']}")
        print("cmake:", render.shell_join(render.cmake_configure_command(data)))
        print("      ", render.shell_join(render.cmake_build_command(data)))
        print("server:", render.shell_join(render.server_args(data)))
        if args.unit:
            print(render.render_unit(data))
            print(render.render_env_file(data))
    return 0


def ssh_command(data: dict) -> list[str]:
    """An ssh command line for a host, with the same strict host-key checking as the deploy."""
    ssh = data["ssh"]
    command = ["ssh", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    if "known_hosts" in ssh:
        command += ["-o", f"UserKnownHostsFile={os.path.expanduser(ssh['known_hosts'])}"]
    if "key" in ssh:
        command += ["-i", os.path.expanduser(ssh["key"])]
    command += ["-p", str(ssh.get("port", 22))]
    user = f"{ssh['user']}@" if "user" in ssh else ""
    return [*command, f"{user}{ssh['host']}"]


def _complete(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    status = 0
    for name, host_config in inventory.hosts.items():
        if args.host and name != args.host:
            continue
        data = host_config.data
        body = json.dumps({"prompt": args.prompt, "n_predict": args.tokens, "temperature": 0})
        curl = (
            "curl -sS -f -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} {render.base_url(data)}/completion"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamarig", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    render_parser = commands.add_parser(
        "render",
        help=f"validate RIG_INVENTORY (now {inventory_path()}) and print the cmake and "
        "llama-server commands the deploy would use",
    )
    render_parser.add_argument("--host", help="only this host")
    render_parser.add_argument("--unit", action="store_true", help="also print unit and env file")

    complete_parser = commands.add_parser(
        "complete", help="send a completion to each host's server (over SSH) and print it"
    )
    complete_parser.add_argument("--host", help="only this host")
    complete_parser.add_argument("--prompt", default="The llama is an animal that")
    complete_parser.add_argument("--tokens", type=int, default=16)

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
        return {"render": _render, "complete": _complete}[args.command](args)
    except ConfigError as error:
        print("llamarig: the rig configuration is not valid:", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
