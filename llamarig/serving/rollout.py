"""`llamarig rollout`: the deploy run through the rigs a gateway fronts a few at a time, so
users see no error. pyinfra runs each operation on every host at once, so the deploy alone
would restart every rig of a model together (the gateway would hold their requests until one
serves); the rollout runs it per batch with `--limit`, as Ansible's `serial:` does:

0. the builds (LLAMARIG_BUILDS_ONLY: the deploy makes and keeps the builds and changes nothing
   that serves), on every rig and builder at once: a build key's one build is made there (by a
   builder, or the first rig of the key while it still serves) and kept in the control
   machine's cache, so each rig's own step below gets it shipped instead of compiling it, out
   of rotation, once per rig;
1. the rigs the gateways front, in batches of at most `gateway.max_unavailable` rigs of any
   one model (with the RPC workers of a head in its batch): each rig's restart takes it out of
   its gateways' rotation first and puts it back once it is checked (tasks/server.py), so the
   other rigs of its model serve meanwhile; a rig a gateway is to front accepts its key here;
2. the gateways, whose changes (users, rigs, certificate) HAProxy applies by a reload: a rig
   added now gets requests it accepts, a rig removed gets no more;
3. the other hosts (rigs no gateway fronts, and those it fronted until step 2, which only now
   stop accepting its key), at once; builders ran in step 0 only.

The first batch that fails stops the rollout, before any other rig is touched; the summary
says which rigs run which build."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from llamarig import PROJECT_DIR
from llamarig.config import Inventory
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.gateways import GATEWAYS_GROUP
from llamarig.planner import fleet
from llamarig.planner.gather import run_on_host
from llamarig.planner.render import layout
from llamarig.tables.text import printable


@dataclass(frozen=True)
class Step:
    """One pyinfra run of the rollout: its hosts, and what they are."""

    hosts: tuple[str, ...]
    what: str
    builds_only: bool = False


def _backends_of(inventory: Inventory, rig: str) -> set[str]:
    """The gateway backends (``GATEWAY/BACKEND``) a rig is a server of."""
    entries = inventory.hosts[rig].data["server"].get("gateways") or []
    return {
        f"{entry['host']}/{server.split('/', 1)[0]}"
        for entry in entries
        for server in entry["servers"]
    }


def max_unavailable(inventory: Inventory, rig: str) -> int:
    """The least `gateway.max_unavailable` of the gateways in front of ``rig``."""
    entries = inventory.hosts[rig].data["server"].get("gateways") or []
    return min(
        (inventory.hosts[e["host"]].data["gateway"]["max_unavailable"] for e in entries),
        default=1,
    )


def steps(inventory: Inventory) -> list[Step]:
    """The runs of a rollout, in order (module docstring)."""
    gateways = inventory.groups.get(GATEWAYS_GROUP, [])
    hosts = inventory.hosts
    building = tuple(name for name, host in hosts.items() if host.data["role"] != "gateway")
    builders = {name for name, host in hosts.items() if host.data["role"] == "builder"}
    fronted = [name for name, host in hosts.items() if host.data["server"].get("gateways")]
    batches: list[list[str]] = []
    for rig in fronted:
        backends = _backends_of(inventory, rig)
        for batch in batches:
            out = [b for other in batch for b in _backends_of(inventory, other)]
            limit = min(max_unavailable(inventory, other) for other in [*batch, rig])
            if all(out.count(backend) < limit for backend in backends) and len(batch) < limit:
                batch.append(rig)
                break
        else:
            batches.append([rig])
    plan = [
        Step((*batch, *_workers_of(inventory, batch)), "out of rotation, changed, checked, back")
        for batch in batches
    ]
    placed = {name for step in plan for name in step.hosts} | builders
    gateway_hosts = [name for name in gateways if name not in placed]
    if gateway_hosts:
        plan.append(Step(tuple(gateway_hosts), "the gateways (a reload keeps every connection)"))
    rest = [name for name in hosts if name not in placed and name not in gateway_hosts]
    if rest:
        plan.append(Step(tuple(rest), "the hosts no gateway fronts"))
    if building and (builders or any(hosts[name].data["llama_cpp"]["share_builds"]
                                     for name in building)):  # fmt: skip
        plan.insert(0, Step(building, BUILDS_STEP, builds_only=True))
    return plan


BUILDS_STEP = "the builds: each made once and kept, nothing that serves changed"


def step_env(step: Step) -> dict[str, str]:
    """The environment of a step's deploy: this one's, with the builds-only switch set for
    the builds step and removed otherwise."""
    env = {key: value for key, value in os.environ.items() if key != fleet.BUILDS_ONLY_ENV}
    if step.builds_only:
        env[fleet.BUILDS_ONLY_ENV] = "1"
    return env


def _workers_of(inventory: Inventory, batch: list[str]) -> list[str]:
    """The RPC workers of the heads in ``batch``: a worker's restart restarts its head, so it
    changes in its head's run, out of rotation with it."""
    return [
        worker
        for head in batch
        if inventory.hosts[head].data["role"] == "rpc-head"
        for worker in inventory.hosts[head].data["rpc"]["workers"]
    ]


def deploy_command(hosts: tuple[str, ...], extra: list[str]) -> list[str]:
    limits = [argument for host in hosts for argument in ("--limit", host)]
    return [sys.executable, "-m", "pyinfra", "-y", *limits, *extra, "inventory.py", "deploy.py"]


def builds(inventory: Inventory, rigs: list[str]) -> dict[str, str]:
    """The build each rig runs now (its `current` link), or why it is not known."""
    found = {}
    for name in rigs:
        data = inventory.hosts[name].data
        try:
            result = run_on_host(data, f"readlink {layout(data)['current']}", timeout=30)
            found[name] = result.stdout.strip().rsplit("/", 1)[-1] or "no build"
        except (OSError, subprocess.SubprocessError) as error:
            found[name] = f"not known ({error})"
    return found


def rollout(inventory: Inventory, extra: list[str]) -> int:
    """Run the steps, stopping at the first that fails; returns pyinfra's exit status."""
    plan = steps(inventory)
    for number, step in enumerate(plan, 1):
        print(
            f"llamarig rollout: step {number} of {len(plan)}: {', '.join(step.hosts)} "
            f"({step.what})",
            flush=True,
        )
        status = subprocess.run(
            deploy_command(step.hosts, extra), cwd=PROJECT_DIR, env=step_env(step)
        ).returncode
        if status != 0:
            done = [h for s in plan[: number - 1] if not s.builds_only for h in s.hosts]
            untouched = [h for s in plan[number:] for h in s.hosts]
            print(
                f"llamarig rollout: step {number} failed on {', '.join(step.hosts)}; stopped "
                f"before {', '.join(untouched) or 'nothing else'}. Converged: "
                f"{', '.join(done) or 'none'}.",
                file=sys.stderr,
            )
            rigs = [h for s in plan for h in s.hosts if h in _rigs(inventory)]
            for name, build in builds(inventory, rigs).items():
                print(printable(f"  {name}: runs {build}"), file=sys.stderr)
            return status
    return 0


def _rigs(inventory: Inventory) -> set[str]:
    return {
        name for name, host in inventory.hosts.items() if host.data["role"] not in SERVES_NO_MODEL
    }
