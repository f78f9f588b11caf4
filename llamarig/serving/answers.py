"""The answer check (`expect.answers`): each answer's request, the host command that sends it,
and the verdict on the reply. One definition for `llamarig verify` (llamarig/checks) and the
deploy's post-start check (operations/rollback.py, serve_or_roll_back), so both judge alike.

Greedy decoding (temperature 0, a fixed seed) makes an answer a property of the model and the
build: a wrong architecture list or a broken split shows as a wrong answer at full speed."""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, replace

from llamarig.model.catalog import is_router, model_views
from llamarig.onhost.hostpaths import CURL_AUTH
from llamarig.onhost.httpbounds import HttpTimeouts

# Per-answer defaults (documented in group_data/all.yml and schema.json): a short answer is
# all a check needs, and it keeps the check to about a second on a CPU rig.
DEFAULT_MAX_TOKENS = 32
DEFAULT_CHAT = False
SEED = 42
# How much of an actual answer a failure quotes.
QUOTED_ANSWER_CHARS = 300


@dataclass(frozen=True)
class Answer:
    """One entry of `expect.answers`, with the per-answer defaults applied."""

    index: int
    prompt: str
    chat: bool
    contains: str | None
    matches: str | None
    max_tokens: int
    # A rig of several models: the model asked (a request's `model`) and its entry's index.
    model: str | None = None
    model_index: int = 0

    @property
    def name(self) -> str:
        """How a failure names it: its key path and its prompt."""
        if self.model:
            where = f"models[{self.model_index}].expect.answers[{self.index}] of {self.model}"
            return f"{where} ({self.prompt!r})"
        return f"expect.answers[{self.index}] ({self.prompt!r})"

    @property
    def expectation(self) -> str:
        if self.contains is not None:
            return f"to contain {self.contains!r}"
        return f"to match the regex {self.matches!r}"


def answers(data: dict) -> list[Answer]:
    """The rig's answers, defaults applied; none for an RPC worker, which holds no model. A
    rig of several models: each model's own, asked of it by name."""
    if data["role"] == "rpc-worker":
        return []
    if is_router(data):
        return [
            replace(answer, model=view.name, model_index=view.index)
            for view in model_views(data)
            for answer in answers(view.data)
        ]
    return [
        Answer(
            index=index,
            prompt=entry["prompt"],
            chat=entry.get("chat", DEFAULT_CHAT),
            contains=entry.get("contains"),
            matches=entry.get("matches"),
            max_tokens=entry.get("max_tokens", DEFAULT_MAX_TOKENS),
        )
        for index, entry in enumerate(data["expect"]["answers"])
    ]


def request(answer: Answer) -> tuple[str, dict]:
    """The API path and JSON body that ask the answer's question greedily (of its model, on a
    rig of several)."""
    path, body = greedy_request(answer.prompt, answer.chat, answer.max_tokens)
    return path, ({"model": answer.model, **body} if answer.model else body)


def greedy_request(prompt: str, chat: bool, max_tokens: int) -> tuple[str, dict]:
    """The API path and JSON body that ask ``prompt`` greedily: as a completion, or as the
    user's message through the model's chat template."""
    greedy = {"temperature": 0, "seed": SEED}
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **greedy}
    return "/completion", {"prompt": prompt, "n_predict": max_tokens, **greedy}


def reply_text(chat: bool, body: str) -> str:
    """The generated text of a reply body (ValueError when it has none)."""
    try:
        reply = json.loads(body)
        if not isinstance(reply, dict):
            raise TypeError("not a JSON object")
        text = reply["choices"][0]["message"]["content"] if chat else reply["content"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(f"no answer in the reply: {body[:QUOTED_ANSWER_CHARS]!r}") from error
    if not isinstance(text, str):
        raise ValueError(f"no answer in the reply: {body[:QUOTED_ANSWER_CHARS]!r}")
    return text


def reply_speed(chat: bool, body: str) -> tuple[float, int | None]:
    """The decode speed (tokens/s, 0 when not told) and the generated tokens of a reply body
    that ``reply_text`` read: what the server says of them, only where it is a number."""
    reply = json.loads(body)
    timings, usage = reply.get("timings"), reply.get("usage")
    speed = timings.get("predicted_per_second") if isinstance(timings, dict) else None
    if chat:
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    else:
        tokens = reply.get("tokens_predicted")
    return (
        float(speed) if _number(speed) else 0.0,
        tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_right(answer: Answer, text: str) -> bool:
    """`contains`: a case-sensitive substring; `matches`: `re.search` anywhere in the text."""
    if answer.contains is not None:
        return answer.contains in text
    return re.search(answer.matches, text) is not None


def verdict(answer: Answer, status: int, body: str) -> str | None:
    """None when the reply is right; else what failed, naming the answer, the expectation and
    the actual answer."""
    if status != 200:
        return f"{answer.name}: the server answered HTTP {status}: {body[:QUOTED_ANSWER_CHARS]!r}"
    try:
        text = reply_text(answer.chat, body)
    except ValueError as error:
        return f"{answer.name}: {error}"
    if is_right(answer, text):
        return None
    return (
        f"{answer.name}: expected the answer {answer.expectation}, "
        f"got {text[:QUOTED_ANSWER_CHARS]!r}"
    )


# Ends the body so the status code can be split off the last line.
STATUS_MARK = "\nllamarig-http-status:"


def check_command(base_url: str, answer: Answer, timeouts: HttpTimeouts) -> str:
    """The shell command, run on the host, that asks the question and prints the reply body
    then the HTTP status (see `parse_output`), bounded by ``timeouts``' answer bound. The
    prompt travels inside one quoted printf argument on stdin (a builtin: in no process's
    argv), the key as the root-only header file."""
    path, body = request(answer)
    write_out = shlex.quote(STATUS_MARK + "%{http_code}")
    return (
        f"printf '%s' {shlex.quote(json.dumps(body))} | curl -sS {timeouts.options('answer')} "
        f"{CURL_AUTH} -H 'Content-Type: application/json' --data-binary @- "
        f"-w {write_out} -- {shlex.quote(base_url + path)}"
    )


def parse_output(output: str) -> tuple[int, str]:
    """(HTTP status, body) from `check_command`'s output; status 0 when curl got no reply."""
    body, mark, status = output.rpartition(STATUS_MARK)
    if not mark:
        return 0, output
    try:
        return int(status.strip()), body
    except ValueError:
        return 0, output
