"""The rules of `expect` the schema cannot state: each answer has exactly one of `contains`
and `matches`, a `matches` that Python compiles, and a prompt that says something."""

from __future__ import annotations

import re

from llamarig.config.problems import Problem


def answer_problems(data: dict) -> list[Problem]:
    """Every answer checked, each problem with the answer's key path."""
    problems: list[Problem] = []
    for index, answer in enumerate(data["expect"]["answers"]):
        path = ("expect", "answers", index)
        if not answer["prompt"].strip():
            problems.append(
                Problem((*path, "prompt"), "is only white space: ask the question to check")
            )
        given = [key for key in ("contains", "matches") if key in answer]
        if len(given) != 1:
            problems.append(
                Problem(
                    path,
                    (
                        "has both `contains` and `matches`"
                        if given
                        else "has neither `contains` nor `matches`"
                    )
                    + ": give exactly one, `contains: TEXT` (a substring of the answer) or "
                    "`matches: REGEX` (a Python regular expression found in the answer)",
                )
            )
        if "matches" in answer:
            try:
                re.compile(answer["matches"])
            except re.error as error:
                problems.append(
                    Problem(
                        (*path, "matches"),
                        f"{answer['matches']!r} is not a Python regular expression ({error}): "
                        "fix it, or use `contains` for plain text",
                    )
                )
    return problems
