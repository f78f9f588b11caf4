"""What `llamarig tune` keeps beside the inventory: the sweep file (``.HOST.sweep.json``), what
was measured for one build and model, so that a run cut short by its time bound resumes where it
stopped; and the tuned file (``tuned/HOST.yml``) that the loader merges under the host's own
settings, with the tuned values that those settings override.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from llamarig.config.inventory import load_inventory
from llamarig.serving import draft_tune, throughput
from llamarig.serving.draft_tune import DraftMeasured
from llamarig.serving.llama_bench import DECODE_TOKENS, PROMPT_TOKENS, REPETITIONS, Measured


@dataclass(frozen=True)
class SweepRecord:
    """The sweep file (``path``) and the build and model its results hold for
    (``identity``): what a sweep reads before measuring and saves after each result.

    .. code:: python

        SweepRecord(Path("inventory/tuned/.rig1.sweep.json"), "build 0c1e57098bba-f9a5, model m")
    """

    path: Path
    identity: str

    def read(self) -> dict:
        """What the file holds for this build and model (empty for another): each result
        three numbers, or why a run was cut. The file is only a cache: one that cannot be read,
        or an entry of another shape (a damaged or edited file), is measured afresh."""
        try:
            document = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(document, dict) or document.get("identity") != self.identity:
            return {}
        results = document.get("results")
        if not isinstance(results, dict):
            return {}
        return {key: value for key, value in results.items() if _result_shape(value)}

    def save(self, saved: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"identity": self.identity, "results": saved}, indent=1))


def _result_shape(value: object) -> bool:
    numbers = isinstance(value, list) and len(value) == 3
    return isinstance(value, str) or (
        numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


def write_tuned(
    path: Path,
    host: str,
    chosen: Measured,
    identity: str,
    draft: DraftMeasured | None = None,
) -> None:
    settings = {k: v for k, v in chosen.candidate.settings().items() if v is not None}
    served = ""
    if draft:
        settings["spec"] = {"draft_max": draft.draft_max}
        served = (
            f"# draft_max {draft.draft_max} served at {draft.tps:.1f} t/s (median of "
            f"{len(draft_tune.DRAFT_PROMPTS)} greedy prompts of "
            f"{draft_tune.DRAFT_TOKENS} tokens).\n"
        )
    header = (
        f"# Written by `llamarig tune` for {host} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC:\n"
        f"# {chosen.candidate.label} decoded at {chosen.tps:.1f} t/s, prompt at "
        f"{chosen.prompt_tps:.1f} t/s (llama-bench -n {DECODE_TOKENS} -p {PROMPT_TOKENS}, "
        f"{REPETITIONS} repetitions; {identity}).\n"
        f"{served}"
    )
    _write_tuned_file(path, header, settings)


def _write_tuned_file(path: Path, header: str, settings: dict) -> None:
    """A tuned file: what was measured as comment lines, then the settings under `server:`."""
    note = "# The loader merges it under the host's own settings; commit it like any other.\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + note + yaml.safe_dump({"server": settings}, sort_keys=False))


def write_tuned_throughput(
    path: Path, host: str, chosen: throughput.LoadMeasured, bound: float, identity: str
) -> None:
    """Adds the load settings to the host's tuned file, keeping what an earlier tune for
    decode wrote there."""
    settings = {}
    if path.is_file():
        settings = (yaml.safe_load(path.read_text()) or {}).get("server") or {}
    load_settings = chosen.candidate.settings()
    # Drafting on again (or never varied) drops an earlier "off"; a decode draft_max stays.
    spec = {k: v for k, v in settings.pop("spec", {}).items() if k != "type"}
    spec |= load_settings.pop("spec", {})
    settings |= load_settings | ({"spec": spec} if spec else {})
    header = (
        f"# Written by `llamarig tune --for throughput` for {host} on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC:\n"
        f"# {chosen.candidate.label} served {chosen.tps:.1f} tokens/s with "
        f"{chosen.candidate.parallel} client(s) at once ({throughput.LOAD_TOKENS} tokens each, "
        f"median of {throughput.ROUNDS} rounds), gaps between tokens p50 "
        f"{chosen.gap_p50_ms:.1f} ms, p95 {chosen.gap_p95_ms:.1f} ms (bound {bound:.1f} ms; "
        f"{identity}).\n"
    )
    _write_tuned_file(path, header, settings)


def overridden(inventory: Path, host: str, settings: dict) -> list[str]:
    """The tuned ``settings`` that the host's own settings replace (they win over a tuned
    file), each naming the file that sets it."""
    loaded = load_inventory(inventory).hosts[host]
    lines = []
    for path, value in _leaves(settings, ("server",)):
        served = loaded.data
        for key in path:
            served = served[key]
        if served != value:
            lines.append(
                f"{host}: {'.'.join(path)} is {served!r} in {loaded.origins[path]}, which "
                f"wins over the tuned {value!r}: remove it there to serve the tuned value"
            )
    return lines


def _leaves(settings: dict, prefix: tuple) -> list[tuple[tuple, object]]:
    """(key path, value) of every value of nested ``settings`` that is not a mapping."""
    found = []
    for key, value in settings.items():
        if isinstance(value, dict):
            found += _leaves(value, (*prefix, key))
        else:
            found.append(((*prefix, key), value))
    return found
