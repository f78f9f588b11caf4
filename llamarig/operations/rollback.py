"""A (re)started llama-server kept only when it serves, gives every expected answer and decodes
about as fast as the last version that served; else that version is put back (its unit,
environment file, `current` link and a router's presets), restarted and confirmed serving, and
the run fails with why."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation

from llamarig.onhost import deploy_record
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.operations.drain import Drain, drain
from llamarig.operations.rotation import Rotation, back_in_rotation, guarded
from llamarig.operations.rotation import callback as rotation_callback
from llamarig.operations.serve import serving_check, wrong_answers
from llamarig.operations.systemd import journal_tail_command, restart_command
from llamarig.serving import pace
from llamarig.serving.answers import Answer


@operation(is_idempotent=False)
def serve_or_roll_back(
    base_url: str,
    service: str,
    timeout: int,
    unit: str,
    env_file: str,
    current: str,
    last_good: str,
    http_timeouts: HttpTimeouts,
    answers: list[Answer] | None = None,
    max_slowdown: float | None = None,
    drain_timeout: int = 0,
    model: str = "",
    presets: str | None = None,
    probe_model: str | None = None,
    models: tuple[str, ...] = (),
    rotation: Rotation | None = None,
):
    """
    Wait until a (re)started llama-server serves, gives every expected answer and decodes
    about as fast as the last version that served; if it does not, put that version back
    (unit, environment file and `current` link), restart it, confirm it serves, and fail with
    why: the new version's last journal lines, the answer it got wrong, or both speeds.

    + base_url: e.g. ``http://127.0.0.1:8080``
    + service: systemd unit name (journal, restart)
    + timeout: seconds the new version gets to answer /health
    + unit, env_file, current: the unit file, its environment file and the `current` link
    + last_good: directory holding copies of those three from the last version that served;
      refreshed after every successful start
    + http_timeouts: the rig's server.http_timeouts: every request to the server is bounded
    + answers: the rig's ``expect.answers`` (``llamarig.serving.answers.answers``), asked
      greedily once it serves; judged here, on the control machine, as ``llamarig verify``
      judges them
    + max_slowdown: the share by which the decode speed (``llamarig.serving.pace``: the best of 3
      greedy completions, 3 more, then the last version measured again and the new one once
      more before a refusal) may fall below the last good version's before the new one is
      rolled back; None: not measured
    + model: what the speed is of (the model file and its checksum): speeds of another model
      are not compared, since a larger model is meant to be slower
    + drain_timeout: before each switch between the versions measured side by side, the most
      seconds to wait for requests in flight to finish (``drain``)
    + presets, probe_model, models: a router's presets file (kept and put back with the
      unit; after a start each of its models must load and complete, in its order, or the
      router is rolled back), the model whose decode speed is measured, and every model's name
      (whose slots a drain waits for)

    + rotation: the gateways in front of this rig, which the restart took it out of: it is
      put back once the version that serves is checked, or after the rollback (their health
      checks decide when it takes requests); None: no gateway

    Only call it when something was (re)started (guard it with ``_if=``): it always runs.

    **Example:**

    .. code:: python

        serve_or_roll_back(
            base_url="http://127.0.0.1:8080",
            service="llama-server",
            timeout=600,
            unit="/etc/systemd/system/llama-server.service",
            env_file="/etc/llamarig/llama-server.env",
            current="/opt/llamarig/current",
            last_good="/var/lib/llamarig/last-good",
            http_timeouts=HttpTimeouts.of(rig),
        )
    """
    files = _VersionFiles(unit, env_file, current, presets)
    trial = _Trial(
        base_url=base_url,
        service=service,
        http_timeouts=http_timeouts,
        files=files,
        last_good=last_good,
        check=serving_check(base_url, service, timeout, http_timeouts, presets),
        roll_back=_roll_back(service, files, last_good),
    )
    steps: list[str | FunctionCommand] = [_serves_else_roll_back(trial)]
    if answers:
        steps.append(FunctionCommand(_answers_right(trial, answers), (), {}))
    if max_slowdown is not None:
        server = Drain(base_url, drain_timeout, http_timeouts, service=service, models=models)
        keep_pace = _keeps_pace(trial, max_slowdown, model, probe_model, server)
        steps.append(FunctionCommand(keep_pace, (), {}))
    steps.append(_kept_as_last_good(trial))
    if rotation is None:
        yield from steps
        return
    # Checked with no user on it: the gateways send it nothing until every step passed, or
    # a step failed and rolled back.
    yield from (guarded(step, rotation) for step in steps)
    yield rotation_callback(back_in_rotation, rotation)


@dataclass(frozen=True, kw_only=True)
class _Trial:
    """A (re)started version on trial: where it serves, the files that make it, the directory
    that keeps the last version that served, the shell function ``serving`` that waits until
    it serves (``check``) and the shell lines, run after it, that put the last version back
    (``roll_back``)."""

    base_url: str
    service: str
    http_timeouts: HttpTimeouts
    files: _VersionFiles
    last_good: str
    check: str
    roll_back: str

    def run(self, host, command: str) -> bool:
        """Run ``command`` (after ``check``) on ``host``, logging its output; True when it
        succeeded."""
        succeeded, output = host.run_shell_command(StringCommand(self.check + command))
        for line in output.output_lines:
            host.log(line, log_func=logger.info if succeeded else logger.error)
        return succeeded


def _serves_else_roll_back(trial: _Trial) -> str:
    """The shell script that waits until the new version serves, else says why with its last
    journal lines and rolls back."""
    # Values reach messages as printf arguments, never inside double quotes.
    return (
        trial.check
        + f"""
if ! serving; then
  printf 'llamarig: the new version of %s does not serve: %s. Its last journal lines:\\n' \\
    {shlex.quote(trial.service)} "$why" >&2
  {journal_tail_command(trial.service, 30)} >&2
{trial.roll_back}
fi
"""
    )


def _answers_right(trial: _Trial, answers: list[Answer]) -> Callable[..., bool]:
    """The callback that asks the expected answers, and rolls back when one is wrong."""

    # pyinfra passes (state, host) to a callback whose parameters have those names, and fails
    # the operation when it returns False.
    def ask(state, host) -> bool:
        started = time.monotonic()
        wrong = wrong_answers(host, trial.base_url, answers, trial.http_timeouts)
        if not wrong:
            host.log(
                f"llamarig: {len(answers)} expected answer(s) right at {trial.base_url} "
                f"in {time.monotonic() - started:.1f} s"
            )
            return True
        for problem in wrong:
            host.log_styled(f"llamarig: {problem}", fg="red", log_func=logger.error)
        q_service, why = shlex.quote(trial.service), shlex.quote("; ".join(wrong))
        _, output = host.run_shell_command(
            StringCommand(
                trial.check
                + f"""
printf 'llamarig: the new version of %s answers wrongly: %s\\n' {q_service} {why} >&2
{trial.roll_back}
"""
            )
        )
        for line in output.output_lines:
            host.log(line, log_func=logger.error)
        return False

    return ask


def _decode_speed(host, trial: _Trial, probe_model: str | None, best: float = 0.0) -> float | None:
    """The best decode speed of RUNS completions, or ``best`` (an earlier look) when higher;
    None, the error logged, when a reply has no timings."""
    replies = []
    for _ in range(pace.RUNS):
        command = StringCommand(
            pace.decode_command(trial.base_url, trial.http_timeouts, probe_model)
        )
        replies.append(host.run_shell_command(command)[1].stdout)
    try:
        return max(best, pace.decode_speed(replies))
    except ValueError as error:
        host.log_styled(f"llamarig: {error}", fg="red", log_func=logger.error)
        return None


def _keeps_pace(
    trial: _Trial, max_slowdown: float, model: str, probe_model: str | None, server: Drain
) -> Callable[..., bool]:
    """The callback that compares the new version's decode speed with the last one's
    (``pace.keep_pace``, draining ``server`` before each switch between them) and records it,
    or rolls back."""
    speed_file = shlex.quote(f"{trial.last_good}/{pace.SPEED_FILE}")
    stored = {"last": trial.last_good, "new": f"{trial.last_good}/candidate"}

    def keep_pace(state, host) -> bool:
        _, recorded = host.run_shell_command(StringCommand(f"cat {speed_file} 2>/dev/null"))
        last = pace.recorded_speed(recorded.stdout_lines, model)

        def switch_to(version: str) -> bool:
            drain(host, server)
            switch = _switch_to(trial.service, trial.files, stored[version])
            return trial.run(host, switch + f"\nserving || {{\n{trial.roll_back}\n}}\n")

        speed = pace.keep_pace(
            pace.Versions(
                measure=lambda best: _decode_speed(host, trial, probe_model, best),
                stash_new=lambda: trial.run(
                    host, _keep_version(trial.files, stored["new"]) + " || exit 1\n"
                ),
                switch_to=switch_to,
                roll_back=lambda: trial.run(host, trial.roll_back),
                say=lambda line: host.log(f"llamarig: {line}"),
                error=lambda line: host.log_styled(
                    f"llamarig: {line}", fg="red", log_func=logger.error
                ),
            ),
            last,
            max_slowdown,
            trial.service,
        )
        if speed is None:
            return False
        q_good, q_model = shlex.quote(trial.last_good), shlex.quote(model)
        record = f"mkdir -p {q_good} && printf '%.1f\\n%s\\n' {speed} {q_model}"
        host.run_shell_command(StringCommand(f"{record} > {speed_file}.new"))
        return True

    return keep_pace


def _kept_as_last_good(trial: _Trial) -> str:
    """The shell command that keeps the version that serves as the last good one, with the
    speed it was measured at, and says so."""
    q_good = shlex.quote(trial.last_good)
    q_speed = shlex.quote(f"{trial.last_good}/{pace.SPEED_FILE}")
    q_service, q_url = shlex.quote(trial.service), shlex.quote(trial.base_url)
    return (
        _keep_version(trial.files, trial.last_good)
        + f" && {{ [ ! -f {q_speed}.new ] || mv {q_speed}.new {q_speed}; }}"
        f" && rm -rf {q_good}/candidate"
        f" && printf 'llamarig: %s serves at %s\\n' {q_service} {q_url}"
    )


@dataclass(frozen=True)
class _VersionFiles:
    """What makes a version of the server besides its build: the unit, its environment file,
    the `current` link and, on a router, the presets file."""

    unit: str
    env_file: str
    current: str
    presets: str | None = None

    @property
    def copies(self) -> list[tuple[str, str]]:
        """(kept file name, path) of each file copied whole."""
        kept = [("unit", self.unit), ("env", self.env_file)]
        return kept + ([("presets", self.presets)] if self.presets else [])


def _keep_version(files: _VersionFiles, directory: str) -> str:
    """A shell command that copies the version's files and the `current` link's target into
    ``directory`` (files ``unit``, ``env``, ``presets``, ``current``), each replaced whole;
    what ``_switch_to`` puts back."""
    q_dir, q_current = shlex.quote(directory), shlex.quote(files.current)
    copies = "".join(
        f" && cp {shlex.quote(path)} {q_dir}/{name}.new" for name, path in files.copies
    )
    names = " ".join([name for name, _ in files.copies] + ["current"])
    return (
        f"mkdir -p {q_dir}{copies}"
        f" && readlink {q_current} > {q_dir}/current.new"
        f" && for f in {names}; do mv {q_dir}/$f.new {q_dir}/$f; done"
    )


def _switch_to(service: str, files: _VersionFiles, source: str) -> str:
    """Shell lines that install the files and `current` link kept in ``source`` and restart
    the service."""
    q_source, q_current = shlex.quote(source), shlex.quote(files.current)
    # A version kept before the rig had several models has no presets file (nor needs one).
    copies = " && ".join(
        f"{{ [ ! -f {q_source}/{name} ] || cp {q_source}/{name} {shlex.quote(path)}; }}"
        if name == "presets"
        else f"cp {q_source}/{name} {shlex.quote(path)}"
        for name, path in files.copies
    )
    return f"""
{copies} \\
  && ln -sfn "$(cat {q_source}/current)" {q_current}.new && mv -T {q_current}.new {q_current}
systemctl daemon-reload
{restart_command(service)}
""".strip("\n")


def _roll_back(service: str, files: _VersionFiles, last_good: str) -> str:
    """Shell lines (after a ``serving`` function) that put the last version that served back,
    restart it, say whether it serves and exit 1 (the run fails)."""
    q_good = shlex.quote(last_good)
    return f"""
if [ ! -f {q_good}/current ]; then
  echo "llamarig: no earlier version served on this host: nothing to roll back to" >&2
  exit 1
fi
started=$(date +%s)
{_switch_to(service, files, last_good)}
date -u +%Y-%m-%dT%H:%M:%SZ > {shlex.quote(deploy_record.ROLLED_BACK_PATH)} || true
if serving; then
  echo "llamarig: rolled back: the last version that served ($(cat {q_good}/current)) serves" \\
    "again after $(( $(date +%s) - started )) s; fix the rig data and deploy again" >&2
else
  printf 'llamarig: the rollback does not serve either: %s\\n' "$why" >&2
  exit 1
fi
exit 1
""".strip("\n")
