"""The `llamarig` command: plan the rigs, try a completion, run the sandbox rig."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from pyinfra.facts.server import Arch, LinuxDistribution

from llamarig.checks.runner import verify_host
from llamarig.config import ConfigError, HostConfig, inventory_path, load_inventory
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.hosts import Inventory
from llamarig.config.lock import lock_path, record_header, resolved
from llamarig.config.problems import Problem, located
from llamarig.config.shapes import host_name_problem
from llamarig.config.ssh import SshTarget
from llamarig.facts.build import CpuFlags
from llamarig.model.catalog import MODEL_NAME, model_views
from llamarig.model.gguf import GgufError
from llamarig.model.reference import HubError
from llamarig.onhost import hostpaths
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.planner import fleet, gateway, render
from llamarig.planner.enroll import (
    ProbeError,
    argument_problems,
    host_entry,
    inventory_document,
    probe,
    render_entry,
)
from llamarig.planner.gather import Gathered, plan_for, run_on_host, shell_reader
from llamarig.planner.host_plan import HostPlan
from llamarig.serving import answers, rollout, status
from llamarig.serving.tune import TuneError, tune_host
from llamarig.tables.text import printable


class _Refusal(Exception):
    """Why a verb stops short: `main` says it on stderr, as it is, and exits with ``status``."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def _chosen_hosts(args: argparse.Namespace) -> dict[str, HostConfig]:
    """The hosts of RIG_INVENTORY a command acts on: all, or the one ``--host`` names; refused
    when the inventory has no host of that name."""
    inventory = load_inventory()
    if args.host and args.host not in inventory.hosts:
        raise _Refusal(f"llamarig: no host {args.host!r} in {inventory.path}")
    return {n: h for n, h in inventory.hosts.items() if not args.host or n == args.host}


# `llamarig plan`'s exit status when a plan fits but chose something without the model's
# GGUF header (docs/operations.md): a CI check that the plan it shows is the deploy's.
PROVISIONAL_STATUS = 3


def _planned(args: argparse.Namespace) -> dict[str, tuple[HostPlan, Gathered] | None]:
    """Each chosen host's plan (a Hugging Face reference resolved) and what it read; None for
    a gateway alone or a builder, which have no model to plan. Refused when a reference cannot
    be resolved. The host is contacted only with --probe; a local host's model file is read in
    place."""
    found = {}
    for name, host_config in _chosen_hosts(args).items():
        if host_config.data["role"] in SERVES_NO_MODEL:
            found[name] = None
            continue
        try:
            data = resolved(host_config.data, update=args.update_models or None)
        except HubError as error:
            problem = located(host_config, Problem(error.key_path, error.message))
            raise _Refusal(f"llamarig: {problem}") from error
        contact = args.probe or data["ssh"].get("local")
        reader = shell_reader(data) if contact else None
        found[name] = plan_for(name, data, reader, gpus=args.probe, model=args.model)
    return found


def _plan(args: argparse.Namespace) -> int:
    planned = _planned(args)
    plans = {name: found[0] for name, found in planned.items() if found}
    for name, found in planned.items():  # what the host told that the plan set aside
        for warning in found[1].warnings if found else []:
            print(f"{name}: {printable(warning)}", file=sys.stderr)
    inventory = load_inventory()
    views = gateway.plan_views(inventory, plans, list(planned))
    keys, builders = _build_keys(args, plans, inventory)
    known_keys = {name: key for name, key in keys.items() if key}
    rig_data = {name: plans[name].resolved for name in known_keys}
    sources = fleet.sources(known_keys, rig_data, list(builders.values()))
    if args.json:
        documents = {name: gateway.plan_document(*view) for name, view in views.items()}
        for name, key in keys.items():
            documents[name]["build"] = {
                "build_id": render.build_id(plans[name].resolved),
                **({"key": key.key, "platform": key.platform, "shared": key.shared,
                    "shipped_from": sources.get(name) or None} if key else {}),
            }  # fmt: skip
        for name in set(builders) & set(documents):
            made = fleet.builds_of(name, known_keys, sources)
            documents[name] = {"role": "builder", "fits": True, "builds": made}
        print(json.dumps({"hosts": documents}, indent=2))
    else:
        for name, view in views.items():
            if view[0]["role"] == "builder":
                made = fleet.builds_of(name, known_keys, sources) if name in builders else None
                print("\n".join(fleet.builder_lines(name, made)))
                continue
            lines = gateway.plan_lines(name, *view, unit=args.unit)
            if name in keys:
                build_id = render.build_id(plans[name].resolved)
                lines.insert(1, fleet.build_line(keys[name], build_id, sources.get(name, "")))
            print("\n".join(lines))
    if not all(p.fits for p in plans.values()):
        return 1
    if any(p.blind for p in plans.values()) and not args.allow_provisional:
        return PROVISIONAL_STATUS
    return 0


def _build_keys(
    args: argparse.Namespace, plans: dict[str, HostPlan], inventory: Inventory
) -> tuple[dict, dict]:
    """Each rig's build key (planner/fleet.py), read from the host with --probe (or a local
    one), None where the host is not contacted; and every builder of the inventory read so
    (whichever hosts --host chose: a builder decides where a rig's build comes from)."""
    keys = {}
    for name, plan in plans.items():
        data = plan.resolved
        if not (args.probe or data["ssh"].get("local")):
            keys[name] = None
            continue
        read = shell_reader(data)
        keys[name] = fleet.build_key(
            data, read(LinuxDistribution), read(Arch), read(CpuFlags), name
        )
    builders = {}
    for name, host_config in inventory.hosts.items():
        data = host_config.data
        if data["role"] == "builder" and (args.probe or data["ssh"].get("local")):
            read = shell_reader(data)
            builders[name] = fleet.builder(
                name, data, read(LinuxDistribution), read(Arch), read(CpuFlags)
            )
    return keys, builders


def _lock(args: argparse.Namespace) -> int:
    """Record in models.lock.yml the GGUF header of each model file the planner reads."""
    lock, status = lock_path(), 0
    for name, found in _planned(args).items():
        data = found[0].resolved if found else None  # None: a gateway alone
        if not data or data["llama_cpp"]["backend"] != "cuda" or data["role"] == "rpc-worker":
            print(f"{name}: nothing to record (only a CUDA rig's plan reads the model's header)")
            continue
        gathered = found[1]
        if gathered.header is None:
            print(f"{name}: no header to record: {gathered.header_note}", file=sys.stderr)
            status = 1
            continue
        for warning in gathered.warnings:
            print(f"{name}: {warning}", file=sys.stderr)
        for key, header in gathered.read:
            record_header(lock, key, header, gathered.superseded)
            print(f"{name}: recorded the header of {next(iter(key.values()))} in {lock}")
        if not gathered.read:
            print(f"{name}: {lock} holds the header of every model file already")
    return status


# Hosts `complete` does not ask: neither runs a llama-server that takes llamarig's key.
NOT_ASKED = {
    "rpc-worker": "an rpc-worker: ask its head, which serves the model",
    "gateway": "a gateway: ask through it with a user's key (README 'A team endpoint')",
}


def _complete(args: argparse.Namespace) -> int:
    status = 0
    for name, host_config in _chosen_hosts(args).items():
        data = host_config.data
        if data["role"] in NOT_ASKED:
            print(f"{name} is {NOT_ASKED[data['role']]}", file=sys.stderr)
            status = 2
            continue
        path, body = answers.greedy_request(args.prompt, args.chat, args.tokens)
        names = [view.name for view in model_views(data)]
        if args.model and args.model not in names:
            served = f"serves {', '.join(names)}" if names else "serves one model (`model:`)"
            print(f"{name}: --model {args.model}: the host {served}", file=sys.stderr)
            status = 2
            continue
        if names:  # a router routes by the request's model: the one asked, else the first
            body = {"model": args.model or names[0], **body}
        url = shlex.quote(render.base_url(data) + path)
        # A completion of up to MAX_COMPLETION_TOKENS on a slow rig; a hung server fails.
        bounds = HttpTimeouts.of(data)
        curl = (
            f"curl -sS -f {bounds.options('generation')} "
            f"{hostpaths.CURL_AUTH} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))} -- {url}"
        )
        result = run_on_host(data, curl, timeout=bounds.connect + bounds.generation + 60)
        if result.returncode != 0:
            print(
                f"{name}: completion at {render.base_url(data)}{path} failed (bounded at "
                f"{bounds.said('generation')}): {printable(result.stderr.strip())}",
                file=sys.stderr,
            )
            status = 1
            continue
        try:
            text = answers.reply_text(args.chat, result.stdout)
        except ValueError as error:
            print(f"{name}: completion at {render.base_url(data)}{path}: {error}", file=sys.stderr)
            status = 1
            continue
        speed, tokens = answers.reply_speed(args.chat, result.stdout)
        asked, said = ("question:", "answer:") if args.chat else ("prompt:", "completion:")
        print(f"{name}: endpoint {render.base_url(data)} (on the host)")
        print(f"  {asked:<12}{args.prompt!r}")
        print(f"  {said:<12}{text!r}")
        print(f"  {tokens} tokens at {speed:.1f} tokens/s (greedy)")
    return status


def _verify(args: argparse.Namespace) -> int:
    hosts = _chosen_hosts(args).values()
    return max((verify_host(h, args.pytest_args, args.rehash) for h in hosts), default=0)


def _status(args: argparse.Namespace) -> int:
    hosts = _chosen_hosts(args)
    window = args.watch or args.window
    while True:
        started = time.monotonic()
        try:
            rows = status.statuses(hosts, window)
        except KeyboardInterrupt:  # the way out of --watch
            return 130
        if args.json:
            print(status.as_json(rows), flush=True)
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            print(f"llamarig status at {when}\n" + "\n".join(map(status.report, rows)), flush=True)
        if not args.watch:
            return 0 if all(map(status.healthy, rows)) else 1
        print(flush=True)
        # A host that answers sleeps through the window itself; one that does not answers at
        # once, and is asked again only when the interval is up (not in a tight loop).
        try:
            status.wait_out(started, args.watch)
        except KeyboardInterrupt:
            return 130


def _run(args: argparse.Namespace) -> int:
    inventory = load_inventory()
    names = [args.host] if args.host else list(inventory.hosts)
    if len(names) != 1 or names[0] not in inventory.hosts:
        raise _Refusal(
            f"llamarig: name one host of {inventory.path} with --host "
            f"({', '.join(inventory.hosts)})"
        )
    data = inventory.hosts[names[0]].data
    if data["role"] in SERVES_NO_MODEL:
        raise _Refusal(
            f"llamarig: {names[0]} is a {data['role']}: no llama-server to start; run a rig"
        )
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
            raise _Refusal(f"llamarig: no launcher {launcher[0]}: run the deploy first", status=1)
        os.execv(launcher[0], launcher)
    # -t: a terminal, so Ctrl-C stops the remote server too.
    os.execvp("ssh", [*SshTarget.of(data["ssh"]).argv("-t"), shlex.join(launcher)])
    return 1


MODEL_HINT = (
    "# Add the model under the host (docs/inventory.md): model: {url: URL, sha256: HEX}, "
    "{path: /srv/models/NAME.gguf}\n# or {hf: ORG/REPO, quant: Q8_0}; `llamarig init --model URL "
    "--sha256 HEX` also plans the split.\n"
)

INIT_REACH_TIMEOUT_S = 60


def _init(args: argparse.Namespace) -> int:
    problems = argument_problems(args)
    if problems:
        raise _Refusal("\n".join(f"llamarig init: {problem}" for problem in problems))
    if args.local:
        ssh: dict = {"local": True}
    else:
        ssh = {"host": args.address, "user": args.user, "port": args.port}
        ssh.update({k: v for k, v in (("key", args.key), ("known_hosts", args.known_hosts)) if v})
    box = f"{args.name} ({args.address or 'this machine'})"
    # A box that does not answer would read as one without GPUs: say so instead.
    try:
        reached = run_on_host({"ssh": ssh}, "true", timeout=INIT_REACH_TIMEOUT_S)
        said = (reached.stderr.strip().splitlines() or ["no message"])[-1]
        failure = None if reached.returncode == 0 else f"exit {reached.returncode}: {said}"
    except subprocess.TimeoutExpired:
        failure = f"no answer within {INIT_REACH_TIMEOUT_S} s"
    if failure:
        raise _Refusal(
            f"llamarig init: cannot run a command on {args.address or 'this machine'} "
            f"({printable(failure)}); nothing was written",
            status=1,
        )
    # What the box prints is untrusted: a value the entry cannot hold is refused by name.
    try:
        found = probe(shell_reader({"ssh": ssh}))
    except ProbeError as error:
        raise _Refusal(f"llamarig init: {box}: {error}; nothing was written") from error
    except subprocess.TimeoutExpired as error:
        raise _Refusal(
            f"llamarig init: {box}: no answer within {error.timeout:g} s while it was probed; "
            "nothing was written",
            status=1,
        ) from error
    settings = host_entry(ssh, found)
    if args.model:
        settings["model"] = {"url": args.model, "sha256": args.sha256}
    document = inventory_document(args.name, settings)
    text = render_entry(args.name, found, document)
    if not args.model:
        text += MODEL_HINT
    with tempfile.TemporaryDirectory() as scratch:
        written = Path(scratch) / "inventory.yml"
        # Without --model the entry is checked with a stand-in model file, which is not written.
        checked = copy.deepcopy(document)
        checked["all"]["children"]["rigs"]["hosts"][args.name].setdefault(
            "model", {"path": "/srv/models/model.gguf"}
        )
        written.write_text(yaml.safe_dump(checked))
        try:
            host = load_inventory(written).hosts[args.name]
        except ConfigError as error:
            entry = "\n".join(f"  {problem}" for problem in error.problems)
            raise _Refusal(f"llamarig init: the entry is not valid:\n{entry}") from error
        if args.model:
            plan, _ = plan_for(args.name, host.data, None, gpus=False)
            server = plan.resolved["server"]
            settings["server"] = {"split_mode": server["split_mode"]}
            if server["tensor_split"]:
                settings["server"]["tensor_split"] = [round(s, 3) for s in server["tensor_split"]]
            text = render_entry(args.name, found, document) + "".join(
                f"# plan: {line}\n" for line in plan.report().splitlines()[1:4]
            )
    if args.output:
        target = Path(args.output)
        target.write_text(text)
        print(f"llamarig init: wrote {target}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _tune(args: argparse.Namespace) -> int:
    inventory = inventory_path()
    status = 0
    for host_config in _chosen_hosts(args).values():
        try:
            tune_host(host_config, inventory, args.minutes, args.force, goal=args.goal)
        except TuneError as error:
            print(f"llamarig tune: {error}", file=sys.stderr)
            status = 1
    return status


# A sweep that resumes is bounded by the user; a day is beyond any that helps.
MAX_TUNE_MINUTES = 24 * 60
MAX_COMPLETION_TOKENS = 4096
# The prompt travels in one ssh command line (curl -d), which Linux bounds at 128 KiB per word.
MAX_PROMPT_CHARACTERS = 16384
MAX_STATUS_SECONDS = 3600


def _above_zero(text: str, maximum: float, refusal: str) -> float:
    """``text`` as a number above 0 and at most ``maximum``; else "'text' is not ``refusal``"."""
    try:
        value = float(text)
    except ValueError:
        value = 0  # no number: refused below, as 0 and nan are (nan fails both comparisons)
    if not 0 < value <= maximum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {refusal}")
    return value


def _seconds(text: str) -> float:
    """--window, --watch: seconds above 0, at most an hour."""
    bound = f"a number of seconds above 0 and at most {MAX_STATUS_SECONDS} (e.g. 10)"
    return _above_zero(text, MAX_STATUS_SECONDS, bound)


def _minutes(text: str) -> float:
    """--minutes: a finite number of minutes above 0, at most a day."""
    bound = f"a time bound: minutes above 0, at most {MAX_TUNE_MINUTES} (e.g. --minutes 10)"
    return _above_zero(text, MAX_TUNE_MINUTES, bound)


def _tokens(text: str) -> int:
    """--tokens: a whole number of tokens from 1 to MAX_COMPLETION_TOKENS."""
    if not text.isdigit() or not 0 < int(text) <= MAX_COMPLETION_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of tokens: 1 to {MAX_COMPLETION_TOKENS} (e.g. --tokens 16)"
        )
    return int(text)


def _gguf_file(text: str) -> str:
    """plan --model: an existing regular file (a FIFO or a device would be read forever)."""
    path = Path(os.path.expanduser(text))
    if path.is_file():
        return str(path)
    why = " (a directory)" if path.is_dir() else "" if path.exists() else " (no such file)"
    raise argparse.ArgumentTypeError(f"{text!r} is not a GGUF file on this machine{why}")


def _prompt(text: str) -> str:
    """--prompt: text a completion can take, bounded so it fits one command line."""
    if not text or len(text) > MAX_PROMPT_CHARACTERS:
        raise argparse.ArgumentTypeError(
            f"a prompt is 1 to {MAX_PROMPT_CHARACTERS} characters, not {len(text)}"
        )
    return text


def _host_name(text: str) -> str:
    """--host: a name as the inventory's hosts are named (refused before the inventory)."""
    problem = host_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _model_name(text: str) -> str:
    """--model: a name as `models:` entries are named (refused before the inventory)."""
    if not MODEL_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a model's name: a letter or digit, then letters, digits and ._-"
        )
    return text


def _verb_parser(commands: argparse._SubParsersAction, name: str, summary: str):
    """A verb that works on the inventory's hosts, or on the one `--host` names."""
    parser = commands.add_parser(name, help=summary)
    parser.add_argument("--host", type=_host_name, help="only this host")
    return parser


def _plan_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = _verb_parser(
        commands,
        "plan",
        summary=f"plan each host of RIG_INVENTORY (now {inventory_path()}) without changing "
        "anything: GPUs, architectures, version checks, per-GPU memory, cmake and llama-server "
        f"arguments; exit 1 when a plan does not fit, {PROVISIONAL_STATUS} when it is "
        "provisional",
    )
    parser.add_argument("--model", type=_gguf_file, help="plan against this local GGUF file")
    parser.add_argument("--probe", action="store_true", help="read the GPUs from the host over SSH")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--update-models",
        action="store_true",
        help="resolve Hugging Face references again and rewrite their entries in "
        "models.lock.yml (else the recorded commits are used)",
    )
    parser.add_argument("--unit", action="store_true", help="also print unit and env file")
    parser.add_argument(
        "--allow-provisional",
        action="store_true",
        help=f"exit 0, not {PROVISIONAL_STATUS}, when a plan is provisional (made without the "
        "model's GGUF header: no models.lock.yml record and no readable file)",
    )
    return parser


def _lock_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = _verb_parser(
        commands,
        "lock",
        summary="record in models.lock.yml (beside RIG_INVENTORY) the GGUF header of each model "
        "file, read from its URL or the Hub (or, with --probe, from the host), so that a plan "
        "made where the model cannot be read is the deploy's",
    )
    parser.add_argument(
        "--probe", action="store_true", help="read a model file from the host over SSH"
    )
    parser.add_argument(
        "--update-models",
        action="store_true",
        help="resolve Hugging Face references again before reading the headers",
    )
    parser.set_defaults(model=None)  # the model's own files, never a local copy
    return parser


def _complete_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "complete", help="send a completion to each host's server (over SSH) and print it"
    )
    parser.add_argument("--host", type=_host_name, help="only this host")
    parser.add_argument("--prompt", type=_prompt, default="The llama is an animal that")
    parser.add_argument("--tokens", type=_tokens, default=16)
    parser.add_argument(
        "--model",
        type=_model_name,
        help="on a rig of several models (`models:`), the one to ask (default: the first)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="ask the prompt as a user's message through the model's chat template "
        "(/v1/chat/completions)",
    )
    return parser


def _verify_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = _verb_parser(
        commands,
        "verify",
        summary="check each host against its rig data with the testinfra suite in llamarig/checks "
        "(over ssh:// with strict host keys); exit non-zero when a check fails",
    )
    parser.add_argument(
        "--rehash",
        action="store_true",
        help="hash every model file, even one that a checksum record says is unchanged since "
        "the deploy hashed it",
    )
    parser.add_argument(
        "pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k service"
    )
    return parser


def _init_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "init",
        help="probe a box over SSH (nvidia-smi, else PCI ids) and write its inventory entry: "
        "the GPUs in bus order with bus ids, suggested driver and CUDA sources",
    )
    parser.add_argument("name", type=_host_name, help="the host's name in the inventory")
    parser.add_argument("--address", help="the box's address (ssh.host)")
    parser.add_argument("--user", default="root")
    parser.add_argument("--port", type=int, default=22)
    parser.add_argument("--key", help="ssh private key file")
    parser.add_argument("--known-hosts", help="known_hosts file holding the box's key")
    parser.add_argument("--local", action="store_true", help="this machine, no ssh")
    parser.add_argument("--model", help="the model's URL (with --sha256): plans the split")
    parser.add_argument("--sha256", help="the model's sha256")
    parser.add_argument("--output", help="write the inventory here (default stdout)")
    parser.add_argument("--force", action="store_true", help="replace --output")
    return parser


def _tune_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = _verb_parser(
        commands,
        "tune",
        summary="measure the configurations that fit on each host with its deployed llama-bench "
        "(split mode and ratio, micro-batch, threads) and write the fastest to "
        "inventory/tuned/HOST.yml, which the next deploy serves; stops the service meanwhile",
    )
    parser.add_argument(
        "--minutes",
        type=_minutes,
        default=10,
        help="time bound of the sweep (default 10); a later run resumes it",
    )
    parser.add_argument(
        "--force", action="store_true", help="stop the service even while it serves a request"
    )
    parser.add_argument(
        "--for",
        dest="goal",
        choices=("decode", "throughput"),
        default="decode",
        help="decode (default): one stream's speed, with llama-bench (split, micro-batch, "
        "threads, draft length); throughput: as many clients at once as slots, through "
        "llama-server (parallel, backend sampling, unified KV cache), the most tokens/s whose "
        "p95 gap between tokens stays under tune.max_p95_ms",
    )
    return parser


def _status_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = _verb_parser(
        commands,
        "status",
        summary="what each host serves now, over SSH: unit and uptime, build, model, slots busy, "
        "tokens/s over a window, GPU memory against the plan, the last deploy; exit 1 when a "
        "host does not answer or its service is not active",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument(
        "--window",
        type=_seconds,
        default=status.DEFAULT_WINDOW_S,
        help=f"seconds over which tokens/s is measured (default {status.DEFAULT_WINDOW_S})",
    )
    parser.add_argument(
        "--watch",
        type=_seconds,
        metavar="SECONDS",
        help="ask again and again, each time over a window of SECONDS, until interrupted",
    )
    return parser


def _run_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "run",
        help="start a host's llama-server in the foreground with the command line the deploy "
        "planned (its launcher): for hosts without systemd (server.supervisor: none) and for "
        "debugging; over SSH for remote hosts",
    )
    parser.add_argument(
        "--host", type=_host_name, help="the host (required when the inventory has several)"
    )
    parser.add_argument(
        "server_args", nargs="*", help="more llama-server arguments (after --), e.g. -lv 4"
    )
    return parser


def _rollout_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "rollout",
        help="the deploy, run through the rigs a gateway fronts a few at a time "
        "(gateway.max_unavailable), each out of rotation while it changes: no request fails",
    )
    parser.add_argument("pyinfra_args", nargs="*", help="more pyinfra arguments (after --)")
    return parser


def _parser() -> argparse.ArgumentParser:
    """The command line: each verb's parser, whose ``handler`` default is the verb's function."""
    parser = argparse.ArgumentParser(prog="llamarig", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add_parser, handler in (
        (_plan_parser, _plan),
        (_lock_parser, _lock),
        (_complete_parser, _complete),
        (_verify_parser, _verify),
        (_init_parser, _init),
        (_tune_parser, _tune),
        (_status_parser, _status),
        (_run_parser, _run),
        (_rollout_parser, lambda args: rollout.rollout(load_inventory(), args.pyinfra_args)),
    ):
        add_parser(commands).set_defaults(handler=handler)
    commands.add_parser(  # listed only: main hands its arguments to llamarig_sandbox
        "sandbox",
        help="the local sandbox rig: sandbox up|down|status|prepare (see `llamarig sandbox -h`)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sandbox"]:
        # The test rig is a package of its own (llamarig_sandbox): imported only when asked for.
        from llamarig_sandbox import sandbox

        return sandbox.main(argv[1:], prog="llamarig sandbox")
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except _Refusal as refusal:
        print(refusal, file=sys.stderr)
        return refusal.status
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
