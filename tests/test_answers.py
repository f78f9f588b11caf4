"""`expect.answers`: the rules that refuse a bad answer before any host is touched, the verdict
on a reply, and the check command the deploy runs on the host, run for real with curl against a
loopback server with prompts that would break a careless shell command."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llamarig import cli, operations
from llamarig.config import load_inventory
from llamarig.onhost.hostpaths import API_KEY_HEADER_PATH
from llamarig.serving import answers
from tests.conftest import default_http_timeouts
from tests.test_bad_input import Case, assert_refused_by_name, host

QUESTION = "What is the capital of France? Answer in one word."


def answer_list(*entries: str) -> str:
    return host("expect:", "  answers:", *(f"    - {entry}" for entry in entries))


CASES = [
    Case(
        "regex-does-not-compile",
        answer_list('{prompt: "Capital?", matches: "(Paris"}'),
        "hosts.rig1.expect.answers.0.matches",
        ("'(Paris' is not a Python regular expression", "missing ), unterminated subpattern"),
    ),
    Case(
        "both-contains-and-matches",
        answer_list('{prompt: "Capital?", contains: Paris, matches: "Par.s"}'),
        "hosts.rig1.expect.answers.0",
        ("has both `contains` and `matches`", "give exactly one"),
    ),
    Case(
        "neither-contains-nor-matches",
        answer_list('{prompt: "Capital?", contains: Paris}', '{prompt: "Capital?", chat: true}'),
        "hosts.rig1.expect.answers.1",
        ("has neither `contains` nor `matches`", "`contains: TEXT`", "`matches: REGEX`"),
    ),
    Case(
        "empty-prompt",
        answer_list('{prompt: "", contains: Paris}'),
        "hosts.rig1.expect.answers.0.prompt",
        ("''", "expected the question"),
    ),
    Case(
        "blank-prompt",
        answer_list('{prompt: "  \\t", contains: Paris}'),
        "hosts.rig1.expect.answers.0.prompt",
        ("is only white space", "ask the question"),
    ),
    Case(
        "empty-contains",
        answer_list('{prompt: "Capital?", contains: ""}'),
        "hosts.rig1.expect.answers.0.contains",
        ("''", "expected text the answer must contain"),
    ),
    Case(
        "misspelt-key",
        answer_list('{prompt: "Capital?", contain: Paris}'),
        "hosts.rig1.expect.answers.0.contain",
        ("unknown key `contain`", "did you mean `contains`?"),
    ),
    Case(
        "max-tokens-zero",
        answer_list('{prompt: "Capital?", contains: Paris, max_tokens: 0}'),
        "hosts.rig1.expect.answers.0.max_tokens",
        ("0", "expected tokens the answer may have, 1 to 4096"),
    ),
    Case(
        "chat-is-a-string",
        answer_list('{prompt: "Capital?", contains: Paris, chat: "yes"}'),
        "hosts.rig1.expect.answers.0.chat",
        ("'yes' is a string", "expected true: ask /v1/chat/completions"),
    ),
    Case(
        "answers-not-a-list",
        host('expect: {answers: {prompt: "Capital?", contains: Paris}}'),
        "hosts.rig1.expect.answers",
        ("expected a list of answers",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_answer_is_refused_with_key_and_fix(case, tmp_path):
    assert_refused_by_name(case, tmp_path)


# Prompts and expectations that would break out of a careless quoting.
HOSTILE = [
    'it\'s "quoted" $(touch CANARY) `touch CANARY` ${HOME} $HOME',
    "'; touch CANARY; echo '",
    "100% %s %n %d \\x \\\\ \\n",
    "-d @/etc/passwd --output CANARY",
    "line one\nline two\r\n\ttabbed",
    "ünïcödé 東京 \u2028 end",
    "} ] \" ' EOF\nEOF\n",
]


# The loader keeps every setting to one line of plain text.
ONE_LINE = [text for text in HOSTILE if text.isprintable()]


@pytest.mark.parametrize("text", ONE_LINE, ids=range(len(ONE_LINE)))
def test_hostile_strings_load_as_written(text, tmp_path):
    entries = [
        {"prompt": text, "contains": text},
        {"prompt": text, "chat": True, "matches": "\\$\\(touch", "max_tokens": 8},
    ]
    path = tmp_path / "rig.yml"
    path.write_text(host(f"expect: {{answers: {json.dumps(entries)}}}"))
    data = load_inventory(path).hosts["rig1"].data
    assert answers.answers(data) == [
        answers.Answer(0, text, False, text, None, answers.DEFAULT_MAX_TOKENS),
        answers.Answer(1, text, True, None, "\\$\\(touch", 8),
    ]


def test_defaults_document_an_empty_list(tmp_path):
    path = tmp_path / "rig.yml"
    path.write_text(host())
    assert load_inventory(path).hosts["rig1"].data["expect"]["answers"] == []


def test_an_rpc_worker_is_never_asked():
    entry = {"prompt": QUESTION, "contains": "Paris"}
    data = {"role": "rpc-worker", "expect": {"answers": [entry]}}
    assert answers.answers(data) == []
    assert len(answers.answers({**data, "role": "rpc-head"})) == 1


def answer(**fields) -> answers.Answer:
    values = {"index": 2, "prompt": QUESTION, "chat": False, "contains": "Paris"}
    values.update(matches=None, max_tokens=16)
    values.update(fields)
    return answers.Answer(**values)


def test_requests_are_greedy_and_go_to_the_right_endpoint():
    path, body = answers.request(answer(max_tokens=7))
    assert path == "/completion"
    assert body == {"prompt": QUESTION, "n_predict": 7, "temperature": 0, "seed": answers.SEED}
    path, body = answers.request(answer(chat=True, max_tokens=9))
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": QUESTION}]
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (9, 0, answers.SEED)


def completion(text: str) -> str:
    return json.dumps({"content": text, "tokens_predicted": 4})


def chat(text: str) -> str:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})


def test_verdict_right_and_wrong():
    assert answers.verdict(answer(), 200, completion(" Paris.")) is None
    assert answers.verdict(answer(chat=True), 200, chat("The capital is Paris.")) is None
    assert answers.verdict(answer(contains=None, matches=r"\bparis\b"), 200, completion("PARIS"))
    assert (
        answers.verdict(answer(contains=None, matches=r"(?i)\bparis\b"), 200, completion(" paris"))
        is None
    )
    wrong = answers.verdict(answer(), 200, completion(" vermЗ隆bere"))
    assert wrong == (
        f"expect.answers[2] ({QUESTION!r}): expected the answer to contain 'Paris', "
        "got ' vermЗ隆bere'"
    )
    # Case-sensitive: `contains` is the text as written.
    assert answers.verdict(answer(), 200, completion("paris"))
    # A chat reply read as a completion has no answer.
    assert "no answer in the reply" in answers.verdict(answer(), 200, chat("Paris"))
    assert "HTTP 503" in answers.verdict(answer(chat=True), 503, '{"error": "loading"}')
    assert "expected the answer to match the regex 'Par+is'" in answers.verdict(
        answer(contains=None, matches="Par+is"), 200, completion("Lyon")
    )


def test_a_long_wrong_answer_is_quoted_short():
    problem = answers.verdict(answer(), 200, completion("x" * 5000))
    assert len(problem) < 500 and problem.endswith("'")


def test_parse_output():
    body = completion("Paris")
    assert answers.parse_output(body + answers.STATUS_MARK + "200") == (200, body)
    assert answers.parse_output("curl: (7) refused" + answers.STATUS_MARK + "000") == (
        0,
        "curl: (7) refused",
    )
    assert answers.parse_output("no mark at all") == (0, "no mark at all")


class Recorder(BaseHTTPRequestHandler):
    """Answers every POST with a canned completion and records what arrived."""

    received: list[tuple[str, bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Recorder.received.append((self.path, body))
        request = json.loads(body)
        if self.path == "/v1/chat/completions":
            reply = chat(f"echo: {request['messages'][0]['content']}").encode()
        else:
            reply = completion(f"echo: {request['prompt']}").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    Recorder.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl on this machine")
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("chat_mode", [False, True], ids=["completion", "chat"])
def test_check_command_sends_the_prompt_byte_exact(recorder, tmp_path, text, chat_mode):
    checked = answer(prompt=text, chat=chat_mode, contains=text)
    command = answers.check_command(recorder, checked, default_http_timeouts())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = subprocess.run(
        ["bash", "-c", command], cwd=scratch, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert not list(scratch.iterdir()), "the prompt ran as a command"
    path, sent = Recorder.received[-1]
    assert (path, json.loads(sent)) == (
        answers.request(checked)[0],
        answers.request(checked)[1],
    )
    status, body = answers.parse_output(result.stdout)
    assert status == 200
    if not chat_mode:
        assert answers.verdict(checked, status, body) is None


def test_check_command_shape():
    command = answers.check_command(
        "http://127.0.0.1:8080", answer(prompt="it's $(id)"), default_http_timeouts()
    )
    words = shlex.split(command)
    # The body is one printf argument piped to curl, which reads it from stdin.
    assert words[:3] == [
        "printf",
        "%s",
        json.dumps(answers.request(answer(prompt="it's $(id)"))[1]),
    ]
    assert (
        words[3] == "|"
        and "--data-binary" in words
        and words[words.index("--data-binary") + 1] == "@-"
    )
    assert words[-2:] == ["--", "http://127.0.0.1:8080/completion"]
    # The API key only as the root-only header file, when the host has one.
    assert f"-H @{API_KEY_HEADER_PATH}" in command and "Bearer" not in command


def test_the_deploy_records_a_version_only_after_its_answers():
    from pyinfra.api import FunctionCommand

    arguments = ("http://127.0.0.1:8080", "llama-server.service", 60, "/u", "/e", "/c", "/g")
    arguments += (default_http_timeouts(),)
    plain = list(operations.serve_or_roll_back._inner(*arguments))
    checked = list(operations.serve_or_roll_back._inner(*arguments, answers=[answer()]))
    assert len(plain) == 2 and plain[0] == checked[0] and plain[1] == checked[2]
    assert isinstance(checked[1], FunctionCommand)
    # The wait rolls back on its own; the last-good copy is written by the last command only.
    assert "/g/current.new" not in plain[0] and "/g/current.new" in plain[1]
    assert "does not serve" in plain[0] and "exit 1" in plain[0]


@pytest.mark.skipif(not shutil.which("curl"), reason="needs curl on this machine")
@pytest.mark.parametrize("chat_mode", [False, True], ids=["completion", "chat"])
def test_llamarig_complete_asks_greedily(recorder, tmp_path, monkeypatch, capsys, chat_mode):
    port = recorder.rsplit(":", 1)[1]
    inventory = tmp_path / "local.yml"
    inventory.write_text(
        "all:\n  hosts:\n    box:\n      ssh: {local: true}\n"
        "      driver: {source: none}\n      cuda: {source: none}\n"
        "      llama_cpp: {backend: cpu}\n      model: {path: /srv/m.gguf}\n"
        f"      server: {{port: {port}}}\n"
    )
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    prompt = "it's $(id) 100%"
    argv = ["complete", "--prompt", prompt, "--tokens", "5"] + (["--chat"] if chat_mode else [])
    assert cli.main(argv) == 0
    path, sent = Recorder.received[-1]
    assert (path, json.loads(sent)) == answers.greedy_request(prompt, chat_mode, 5)
    said = "answer:" if chat_mode else "completion:"
    assert f"  {said:<12}{f'echo: {prompt}'!r}" in capsys.readouterr().out
