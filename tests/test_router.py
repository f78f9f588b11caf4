"""Several models behind one llama-server (issue 30) without a host: `models:` checked as each
model would be alone, every mistake named by its entry's key path; each entry seen as a
one-model rig; the presets file and the router's command line; the worst case of the models
loaded at once planned on the GPUs; a one-model rig's unit as it was before.
test_sandbox_router serves it for real."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from llamarig.config import ConfigError, load_inventory
from llamarig.facts.server import ServerProbe, slot_counts_command
from llamarig.model.catalog import model_views, with_views
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner import render
from llamarig.planner.host_plan import PlannedModel
from llamarig.planner.plan import plan_host
from llamarig.planner.render import preset_sections_of, unloaded_by_reload
from llamarig.planner.router_plan import loaded_at_once
from tests.conftest import PROJECT, default_http_timeouts
from tests.ggufmodels import Qwen35Shape, write_qwen35

BOUNDS = default_http_timeouts()

SHA = "a" * 64
# The start of each inline inventory: one host, rig1, reached at a documentation address.
RIG1 = """\
all:
  hosts:
    rig1:
      ssh: {host: 192.0.2.1, user: root}
"""
ONE_MODEL = (
    RIG1
    + f"""\
      llama_cpp: {{backend: cpu}}
      model: {{url: https://example.org/chat.Q4_K_M.gguf, sha256: "{SHA}"}}
      server: {{split_mode: none, SERVER}}
"""
)

ROUTER = (
    RIG1
    + f"""\
      llama_cpp: {{backend: cpu}}
      server: {{threads: 2, models_max: 2, idle_unload_seconds: 600, sampling: {{top_k: 40}}}}
      models:
        - name: chat
          url: https://example.org/chat.Q4_K_M.gguf
          sha256: "{SHA}"
          load_on_startup: true
          server: {{ctx: 8192, parallel: 4, spec: {{type: [ngram-mod]}},
                   sampling: {{temperature: 0.7, top_p: 0.8, presence_penalty: -0.5}}}}
          expect:
            answers: [{{prompt: "Capital of France?", chat: true, contains: Paris}}]
        - name: code.small
          path: /srv/models/code.gguf
          server: {{ctx: 2048, kv_unified: true, chat_template_kwargs: {{enable_thinking: false}}}}
"""
)


def load(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "hosts.yml"
    path.write_text(text)
    return load_inventory(path).hosts["rig1"].data


def refused(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "hosts.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_inventory(path)
    return caught.value.problems


def test_each_entry_is_a_one_model_rig_with_its_own_settings(tmp_path):
    data = load(tmp_path, ROUTER)
    chat, code = model_views(data)
    assert (chat.name, chat.load_on_startup, code.load_on_startup) == ("chat", True, False)
    assert chat.data["model"]["url"] == "https://example.org/chat.Q4_K_M.gguf"
    assert code.data["model"]["path"] == "/srv/models/code.gguf"
    assert (chat.data["server"]["ctx"], chat.data["server"]["parallel"]) == (8192, 4)
    # What an entry leaves out is the rig's; a nested setting merges key by key.
    assert code.data["server"]["parallel"] == data["server"]["parallel"]
    assert chat.data["server"]["spec"] == {"type": ["ngram-mod"], "draft_max": None}
    assert chat.data["expect"]["answers"][0]["contains"] == "Paris"
    assert code.data["expect"]["answers"] == [] and code.data["models"] == []


def test_the_router_runs_every_model_from_its_preset(tmp_path):
    data = load(tmp_path, ROUTER)
    for model in data["models"]:
        model.setdefault("server", {})["split_mode"] = "none"
    data["server"]["split_mode"] = "none"
    args = render.server_args(data)
    assert args == [
        "/opt/llamarig/current/bin/llama-server", "--host", "127.0.0.1", "--port", "8080",
        "--models-preset", "/etc/llamarig/llama-server.presets.ini", "--models-max", "2",
        "--sleep-idle-seconds", "600", "--metrics",
    ]  # fmt: skip
    text = render.render_presets(data)
    sections = re.split(r"^\[(.+)\]$", text, flags=re.MULTILINE)
    # Those loaded at startup last (the deploy's check loads them in this order).
    assert sections[1::2] == ["code.small", "chat"]
    chat = dict(line.split(" = ", 1) for line in sections[4].split("\n") if " = " in line)
    assert chat["m"] == "/opt/llamarig/models/chat.Q4_K_M.gguf"
    assert (chat["c"], chat["np"], chat["t"], chat["spec-type"]) == ("8192", "4", "2", "ngram-mod")
    assert chat["load-on-startup"] == "true" and "kvu" not in chat
    # Each model's default sampling: its own keys over the rig's.
    sampled = {key: chat[key] for key in ("temp", "top-k", "top-p", "presence-penalty")}
    assert sampled == {"temp": "0.7", "top-k": "40", "top-p": "0.8", "presence-penalty": "-0.5"}
    code = dict(line.split(" = ", 1) for line in sections[2].split("\n") if " = " in line)
    assert code["kvu"] == "true" and code["chat-template-kwargs"] == '{"enable_thinking":false}'
    assert code["load-on-startup"] == "false"
    assert code["top-k"] == "40" and "temp" not in code
    # The check against the binary's --help covers every preset key.
    assert {"-m", "-c", "-np", "-kvu", "--spec-type", "--temp", "--top-k"} <= set(
        render.preset_flags(data)
    )
    # The router reads its presets again without a restart: it must predate its unit only.
    assert render.layout(data)["model"] == "/etc/systemd/system/llama-server.service"
    data["server"]["models_max"] = None
    assert render.server_args(data)[7:9] == ["--models-max", str(render.MAX_MODELS)]


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        (("- name: code.small", "- name: chat"), "models.1.name", "also models[0]'s name"),
        (("- name: code.small", "- name: -code"), "models.1.name", "a letter or digit"),
        (('          sha256: "' + SHA + '"\n', ""), "models.0", "sha256"),
        (("      server: {threads", "      model: {path: /m.gguf}\n      server: {threads"),
         "model.path", "`model:` or `models:`, not both"),
        (("      server: {threads", "      server: {alias: x, threads"), "server.alias",
         "each entry's `name`"),
        (("          server: {ctx: 2048", "          server: {ctx: 0"), "models.1.server.ctx", ""),
        (("          path: /srv/models/code.gguf", "          path: /srv/models/c;de.gguf"),
         "models.1.path", "holds ; or #"),
        (("enable_thinking: false", 'note: "a # b"'), "models.1.server.chat_template_kwargs",
         "cannot carry"),
        (("          server: {ctx: 2048", "          server: {port: 9, ctx: 2048"),
         "models.1.server", "port"),
    ],
)  # fmt: skip
def test_a_wrong_entry_is_refused_by_its_key_path(tmp_path, change, key, words):
    text = ROUTER.replace(*change)
    assert text != ROUTER
    problems = refused(tmp_path, text)
    named = [p for p in problems if f"hosts.rig1.{key}" in p]
    assert named and all(words in p for p in named[:1]), problems


def test_router_settings_without_models_are_refused(tmp_path):
    text = (
        (PROJECT / "inventory" / "hosts.yml")
        .read_text()
        .replace(
            "            split_mode: none\n",
            "            split_mode: none\n            models_max: 2\n",
        )
    )
    problems = refused(tmp_path, text)
    assert any("server.models_max: has no effect without `models:`" in p for p in problems)


def test_a_one_model_rig_renders_the_unit_it_rendered_before_routers():
    """The units and environment files of the shipped one-model rigs, as rendered at 41ad331
    (before `models:`): sha256 of each. A deliberate change to the unit updates them."""
    expected = {
        ("hosts", "sandbox"): "4499dc87eb416cca6d674089b5a9c8a0c9992d426962318138afdc923d520446",
        ("example-5080-3090", "rig1"): (
            "6a5f74e40b7320c85fd3c35336dede4e3b7b20c3ff61b6ab118ee8732945d0e6"
        ),
    }
    for (inventory, host), digest in expected.items():
        data = load_inventory(PROJECT / "inventory" / f"{inventory}.yml").hosts[host].data
        if data["server"]["split_mode"] == "auto":
            data["server"]["split_mode"] = "layer"
        assert render.sha256_text(render.render_unit(data)) == digest, inventory


@pytest.fixture(scope="module")
def qwen_header(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "qwen36-27b-q8_0.gguf"
    write_qwen35(path, Qwen35Shape(), "q8_0")
    return read_gguf_header_file(path)


def test_the_models_loaded_at_once_must_fit_together_on_the_gpus(qwen_header):
    """The seed rig (5080 + 3090) with its 27B Q8_0 twice: each fits alone, both at once do
    not; with models_max 1 the router never holds both, and the plan fits."""
    seed = load_inventory(PROJECT / "inventory" / "example-5080-3090.yml").hosts["rig1"].data
    rig = copy.deepcopy(seed)
    entry = {key: value for key, value in seed["model"].items() if value is not None}
    rig["models"] = [{**entry, "name": "qwen-a"}, {**entry, "name": "qwen-b", "filename": "b.gguf"}]
    planned = []
    for view in model_views(rig):
        plan = plan_host("rig1", view.data, qwen_header)
        assert plan.fits, plan.report()
        planned.append(PlannedModel(view, plan))
    both = loaded_at_once(planned, None)
    assert both.names == ["qwen-a", "qwen-b"] and not both.fits
    (problem,) = both.problems
    assert "(qwen-a, qwen-b) do not fit together" in problem
    assert re.search(r"NVIDIA GeForce RTX \d+ lacks \d+ MiB", problem), problem
    one = loaded_at_once(planned, 1)
    assert one.fits and one.names == ["qwen-a"]
    alone = planned[0].plan.memory.devices
    assert [need for _, need, _ in one.devices.values()] == [d.need_mib for d in alone]
    assert "deficit" in both.table()
    # The plan of the rig carries each model's resolved settings back into its entry.
    resolved = with_views(rig, [p.view for p in planned])
    assert resolved["models"][1]["server"]["ctx"] == planned[1].plan.resolved["server"]["ctx"]
    assert yaml.safe_dump(resolved)  # plain data, as the deploy record keeps it


class _Router(BaseHTTPRequestHandler):
    """A router as the probes see it: `a` loaded with 2 slots (1 busy), `b` not loaded."""

    completions: list[dict] = []

    def do_GET(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        if url.path == "/health":
            return self._reply(200, {"status": "ok"})
        if url.path == "/slots" and query.get("autoload") == ["false"]:
            if query.get("model") == ["a"]:
                return self._reply(200, [{"id": 0, "is_processing": True},
                                         {"id": 1, "is_processing": False}])  # fmt: skip
            return self._reply(400, {"error": {"message": "model is not loaded"}})
        return self._reply(400, {"error": {"message": "model name is missing"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Router.completions.append(body)
        self._reply(200, {"content": " hi", "timings": {"predicted_per_second": 50.0}})

    def _reply(self, status, body):
        data = json.dumps(body, separators=(",", ":")).encode()  # compact, as llama-server
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_probes_count_only_loaded_models_and_complete_on_an_idle_one():
    """The slot count and the no-op probe, run by a real shell against a stand-in router on
    loopback (port 0): an unloaded model is neither counted nor loaded (autoload=false), and
    the probe's completion goes to the loaded model with an idle slot."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        counted = subprocess.run(
            ["sh", "-c", slot_counts_command(base, BOUNDS, ("b", "a"))],
            capture_output=True,
            text=True,
        )
        assert counted.stdout.strip().splitlines()[-1] == "slots 2 1"
        _Router.completions.clear()
        probe = ServerProbe()
        output = subprocess.run(
            ["sh", "-c", probe.command(base, BOUNDS, ("b", "a"))], capture_output=True, text=True
        ).stdout
        found = probe.process(output.splitlines())
        assert found == {"health": 200, "slots": 2, "busy": 1, "completion_ok": True,
                         "loaded": True, "tokens_per_second": 50.0}  # fmt: skip
        assert [body["model"] for body in _Router.completions] == ["a"]
        # Nothing loaded: no completion, and the probe says so.
        output = subprocess.run(
            ["sh", "-c", probe.command(base, BOUNDS, ("b",))], capture_output=True, text=True
        ).stdout
        assert probe.process(output.splitlines())["loaded"] is False
        assert len(_Router.completions) == 1
    finally:
        server.shutdown()


def test_a_name_has_one_shape_in_the_schema_and_the_cli():
    from llamarig.config.schema import schema
    from llamarig.model.catalog import MODEL_NAME

    pattern = schema()["properties"]["models"]["items"]["properties"]["name"]["pattern"]
    assert pattern == f"^{MODEL_NAME.pattern}$"


def test_the_cli_refuses_a_hostile_model_name_and_tune_a_router_rig(tmp_path, capsys):
    from llamarig.cli import main
    from llamarig.serving.tune import TuneError, tune_host

    with pytest.raises(SystemExit):
        main(["complete", "--model", "chat; rm -rf /"])
    assert "is not a model's name" in capsys.readouterr().err
    path = tmp_path / "hosts.yml"
    path.write_text(ROUTER)
    host = load_inventory(path).hosts["rig1"]
    with pytest.raises(TuneError, match=r"serves several models .* tune measures one model"):
        tune_host(host, path, 1, False, say=lambda line: None)


def test_a_one_model_rig_carries_its_sampling_and_guards_it(tmp_path):
    """server.sampling renders llama-server's sampling options; a key it sets is planned, so
    the same option in extra_args (any spelling) or env is refused; one it leaves unset is not."""
    rig = load(tmp_path, ONE_MODEL.replace("SERVER", "sampling: {temperature: 0.6, min_p: 0.05}"))
    args = render.server_args(rig)
    assert args[args.index("--temp") + 1] == "0.6" and args[args.index("--min-p") + 1] == "0.05"
    assert "--top-k" not in args
    hatches = "sampling: {temperature: 0.6}, extra_args: [--temperature, '1.2', --top-k, '5']"
    problems = refused(tmp_path, ONE_MODEL.replace("SERVER", hatches))
    assert any(
        "server.extra_args.0: `--temperature` (that is `--temp`) is planned from "
        "`server.sampling.temperature`"
        in p
        or "`--temperature` is planned from `server.sampling.temperature`" in p
        for p in problems
    ), problems
    assert not any("extra_args.2" in p for p in problems), problems  # top_k is not set
    env = "sampling: {temperature: 0.6}, env: {LLAMA_ARG_TEMPERATURE: '1.2'}"
    problems = refused(tmp_path, ONE_MODEL.replace("SERVER", env))
    assert any("server.env.LLAMA_ARG_TEMPERATURE" in p and "sampling.temperature" in p
               for p in problems), problems  # fmt: skip
    bad = refused(tmp_path, ONE_MODEL.replace("SERVER", "sampling: {temperature: hot}"))
    assert any("server.sampling.temperature" in p for p in bad), bad


def test_a_worker_with_models_is_refused_not_a_traceback(tmp_path):
    """Found by the schema property test: an RPC worker's entries (whose model is never
    checked) reached the presets check and crashed on a two-digest entry with no file."""
    problems = refused(
        tmp_path,
        RIG1
        + f"""\
      role: rpc-worker
      rpc: {{host: 10.0.0.2}}
      llama_cpp: {{backend: cpu}}
      models:
        - {{name: "00", sha256: ["{SHA}", "{SHA}"]}}
""",
    )
    assert any("an rpc-worker serves one model: `models:` is for a standalone rig" in p
               for p in problems), problems  # fmt: skip


def test_a_reload_unloads_the_models_whose_section_changed_or_is_gone(tmp_path):
    data = load(tmp_path, ROUTER)
    for model in data["models"]:
        model.setdefault("server", {})["split_mode"] = "none"
    served = render.render_presets(data)
    lines = served.splitlines()
    assert list(preset_sections_of(lines)) == ["code.small", "chat"]
    assert unloaded_by_reload(lines, served) == []
    assert unloaded_by_reload(lines, served.replace("c = 8192", "c = 4096")) == ["chat"]
    # chat gone: it is unloaded; code.small, unchanged, keeps serving.
    data["models"] = data["models"][1:]
    assert unloaded_by_reload(lines, render.render_presets(data)) == ["chat"]
    # A new model is loaded when asked for: nothing it serves is cut.
    assert unloaded_by_reload(render.render_presets(data).splitlines(), served) == []
    # Not known what the router serves (no presets that served): each may be unloaded.
    assert unloaded_by_reload(None, served) == ["code.small", "chat"]
