"""How tune chooses among measured candidates: the planned one stays unless the best beats it
by more than a margin, so a re-run does not flip between candidates that only the noise of the
measurement tells apart. Each sweep passes its own margin (how much its measurements scatter).
Its table shows each candidate's row the same way (``table_row``, ``tuned_note``).
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

Result = TypeVar("Result")


def kept_or_best(
    results: Sequence[Result],
    speed: Callable[[Result], float],
    is_planned: Callable[[Result], bool],
    *,
    keep_within: float,
) -> Result:
    """The fastest of ``results`` (not empty) by ``speed``; the planned one instead (the first
    for which ``is_planned`` holds) while it is within ``keep_within`` of it, a share (0.02:
    2% slower)."""
    best = max(results, key=speed)
    planned = next((result for result in results if is_planned(result)), None)
    if planned is not None and speed(planned) >= speed(best) * (1 - keep_within):
        return planned
    return best


def tuned_note(skipped: str, chosen: bool) -> str:
    """The note of a candidate's row: why it was skipped, or that it is the one tuned."""
    return skipped or ("<- tuned" if chosen else "")


def table_row(label: object, cells: str | None, blank: str, note: str) -> str:
    """A candidate's row of a sweep's table: its measured ``cells`` (``blank`` when nothing was
    measured) and its note."""
    return f"{label!s:<32}{cells or blank}  {note}"
