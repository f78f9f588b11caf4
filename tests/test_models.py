"""Models named the way users name them (issue 14 items 3 and 4): the model rules, split-GGUF
naming, the files of a model on the host, merged shard headers and the plan they give, the
Hugging Face resolution recorded in models.lock.yml, the token's way to the host.

The Hub here is tests/hubstandin.py, a STAND-IN on loopback (not the Hub, not a mirror)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from pyinfra.api.command import StringCommand

from llamarig import operations
from llamarig.config import ConfigError, load_inventory
from llamarig.config import lock as model_lock
from llamarig.model import hub
from llamarig.model.files import (
    ModelFile,
    model_files,
    shard_names,
    sibling_paths,
    sibling_urls,
    split_parts,
)
from llamarig.model.gguf import GgufError, merge_split, read_gguf_header_file
from llamarig.model.reference import HubError
from llamarig.onhost.hostjob import JobCommand
from llamarig.onhost.hostpaths import ATOMIC_SUFFIX
from llamarig.planner.header import load_header
from llamarig.planner.plan import plan_host
from tests import hubstandin
from tests.ggufmodels import split_gguf, write_llama
from tests.hubstandin import HubStandIn, RunningStandIn, commit_sha

SHA = "ab" * 32
SHAS = [c * 64 for c in "123"]
HOST = """
all:
  children:
    rigs:
      hosts:
        rig1:
          ssh: {host: 192.0.2.1, user: root}
          gpus:
            - {name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}
          model:
%s
"""


def model_yaml(**model) -> str:
    return HOST % "\n".join(f"            {k}: {json.dumps(v)}" for k, v in model.items())


def problems_of(write_inventory, **model) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_inventory(write_inventory(model_yaml(**model)))
    return caught.value.problems


def loads(write_inventory, **model) -> dict:
    return load_inventory(write_inventory(model_yaml(**model))).hosts["rig1"].data


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class TestRules:
    @pytest.mark.parametrize(
        "model, key, words",
        [
            (
                {"hf": "org/repo", "file": "m.gguf", "url": "https://e.org/m.gguf", "sha256": SHA},
                "model",
                "both `url` and `hf`",
            ),
            (
                {"hf": "org/repo", "file": "m.gguf", "path": "/srv/m.gguf"},
                "model",
                "both `path` and `hf`",
            ),
            ({"hf": "org/repo"}, "model.file", "exactly one of `file`"),
            (
                {"hf": "org/repo", "file": "m.gguf", "quant": "Q4_K_M"},
                "model.file",
                "exactly one of `file`",
            ),
            (
                {"url": "https://e.org/m.gguf", "sha256": SHA, "quant": "Q8_0"},
                "model.quant",
                "`hf` is not set",
            ),
            ({"path": "/srv/m.gguf", "revision": "v1"}, "model.revision", "`hf` is not set"),
            ({"path": "/srv/m.gguf", "token_file": "~/t"}, "model.token_file", "`hf` is not set"),
            ({"hf": "org/re--po", "file": "m.gguf"}, "model.hf", "is not a repo id"),
            ({"hf": "org/repo", "file": "-x/m.gguf"}, "model.file", "is not a GGUF path"),
            (
                {"hf": "org/repo", "quant": "Q4", "endpoint": "http://u@h/"},
                "model.endpoint",
                "is not an https URL of a Hub",
            ),
            (
                {"url": "https://e.org/m-00002-of-00003.gguf", "sha256": SHAS},
                "model.url",
                "shard 2 of 3",
            ),
            (
                {"hf": "org/repo", "file": "m-00003-of-00003.gguf"},
                "model.file",
                "name its first shard, m-00001-of-00003.gguf",
            ),
            (
                {"url": "https://e.org/m-00001-of-00003.gguf", "sha256": SHA},
                "model.sha256",
                "one sha256 given",
            ),
            (
                {"url": "https://e.org/m-00001-of-00003.gguf", "sha256": SHAS[:2]},
                "model.sha256",
                "2 sha256s given",
            ),
            ({"url": "https://e.org/m.gguf", "sha256": SHAS}, "model.sha256", "is one file"),
            (
                {
                    "url": "https://e.org/m-00001-of-00003.gguf",
                    "sha256": SHAS,
                    "filename": "x.gguf",
                },
                "model.filename",
                "cannot rename a split model",
            ),
            (
                {"path": "/srv/m-00001-of-00003.gguf", "sha256": SHA},
                "model.sha256",
                "one sha256 given",
            ),
            (
                {"url": "https://e.org/m-00000-of-00003.gguf", "sha256": SHA},
                "model.url",
                "numbers shard 0 of 3, which gguf-split never writes",
            ),
            (
                {"path": "/srv/m-00004-of-00003.gguf"},
                "model.path",
                "name the first shard, m-00001-of-00003.gguf",
            ),
            (
                {"url": "https://e.org/m-00001-of-00001.gguf", "sha256": SHAS[:1]},
                "model.sha256",
                "fewer than 2 items",
            ),
            ({"hf": "org/repo.git", "quant": "Q4"}, "model.hf", "not ending in .git"),
            (
                {"hf": "org/repo", "quant": "Q4", "endpoint": "http://hub.example.org"},
                "model.endpoint",
                "use https://hub.example.org",
            ),
        ],
    )
    def test_a_model_section_that_cannot_work_is_refused_by_key(
        self, write_inventory, model, key, words
    ):
        problems = problems_of(write_inventory, **model)
        assert any(f"hosts.rig1.{key}:" in p and words in p for p in problems), problems

    @pytest.mark.parametrize(
        "model",
        [
            {"hf": "org/repo", "file": "dir/m.gguf", "revision": "v1.0"},
            {"hf": "org/repo", "quant": "Q4_K_M", "sha256": SHA},
            {"hf": "org/repo", "file": "m-00001-of-00003.gguf", "sha256": SHAS},
            {"url": "https://e.org/m-00001-of-00003.gguf", "sha256": SHAS},
            {"path": "/srv/m-00001-of-00003.gguf"},
            {"url": "https://e.org/m-00001-of-00001.gguf", "sha256": SHA},
            {"hf": "org/repo", "quant": "Q4", "endpoint": "http://127.0.0.1:8000/mirror"},
        ],
    )
    def test_a_well_named_model_loads(self, write_inventory, model):
        assert loads(write_inventory, **model)["model"]["hf"] == model.get("hf")

    @pytest.mark.parametrize(
        ("content", "mode", "words"),
        [
            (None, None, "cannot read"),
            ("", 0o600, "does not hold a token"),
            ("hf_abc", 0o644, "can be read by others (mode 0644)"),
            ("hf_abc", 0o600, None),
        ],
    )
    def test_the_token_file_is_checked_when_the_inventory_is_loaded(
        self, write_inventory, tmp_path, content, mode, words
    ):
        """Before any host or Hub is contacted, even where the lock already holds the files."""
        token = tmp_path / "token"
        if content is not None:
            token.write_text(content)
            token.chmod(mode)
        model = {"hf": "org/repo", "quant": "Q4", "token_file": str(token)}
        if words is None:
            assert loads(write_inventory, **model)["model"]["token_file"] == str(token)
            return
        problems = problems_of(write_inventory, **model)
        assert any("hosts.rig1.model.token_file:" in p and words in p for p in problems), problems


class TestShardNames:
    def test_the_set_of_a_first_shard_in_order(self):
        assert shard_names("M-Q8_0-00001-of-00003.gguf") == [
            "M-Q8_0-00001-of-00003.gguf",
            "M-Q8_0-00002-of-00003.gguf",
            "M-Q8_0-00003-of-00003.gguf",
        ]

    @pytest.mark.parametrize(
        "name", ["m.gguf", "m-00000-of-00003.gguf", "m-00004-of-00003.gguf", "m-1-of-3.gguf"]
    )
    def test_a_name_gguf_split_does_not_write_is_one_file(self, name):
        assert split_parts(name) is None and shard_names(name) == [name]

    def test_sibling_urls_keep_the_directory_and_the_query(self):
        assert sibling_urls("https://e.org/a/m-00001-of-00002.gguf?download=1") == [
            "https://e.org/a/m-00001-of-00002.gguf?download=1",
            "https://e.org/a/m-00002-of-00002.gguf?download=1",
        ]

    def test_sibling_paths_stay_in_the_directory(self):
        assert sibling_paths("/srv/x/m-00001-of-00002.gguf") == [
            "/srv/x/m-00001-of-00002.gguf",
            "/srv/x/m-00002-of-00002.gguf",
        ]


class TestModelFiles:
    def test_a_split_url_model_has_every_shard_with_its_sha256(self, write_inventory):
        data = loads(write_inventory, url="https://e.org/m-00001-of-00003.gguf", sha256=SHAS)
        assert model_files(data) == [
            ModelFile(
                f"/opt/llamarig/models/m-0000{n}-of-00003.gguf",
                f"https://e.org/m-0000{n}-of-00003.gguf",
                SHAS[n - 1],
            )
            for n in (1, 2, 3)
        ]

    def test_a_split_host_file_is_checked_beside_the_first(self, write_inventory):
        data = loads(write_inventory, path="/srv/m-00001-of-00002.gguf", sha256=SHAS[:2])
        assert model_files(data) == [
            ModelFile("/srv/m-00001-of-00002.gguf", None, SHAS[0]),
            ModelFile("/srv/m-00002-of-00002.gguf", None, SHAS[1]),
        ]

    def test_one_file_keeps_its_filename(self, write_inventory):
        data = loads(write_inventory, url="https://e.org/x", sha256=SHA, filename="m.gguf")
        assert model_files(data) == [
            ModelFile("/opt/llamarig/models/m.gguf", "https://e.org/x", SHA)
        ]


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A small llama GGUF and its 3-shard gguf-split set."""
    directory = tmp_path_factory.mktemp("llama")
    whole = directory / "tiny.gguf"
    write_llama(whole, n_layer=4, weight_type="q8_0", full_size=True)
    return whole, split_gguf(whole, directory / "split", 3)


class TestMergedHeaders:
    def test_the_shards_merge_into_the_unsplit_header(self, llama_pair):
        whole, shards = llama_pair
        merged = merge_split([read_gguf_header_file(p) for p in shards])
        unsplit = read_gguf_header_file(whole)
        assert [(t.name, t.shape, t.ggml_type, t.n_bytes) for t in merged.tensors] == [
            (t.name, t.shape, t.ggml_type, t.n_bytes) for t in unsplit.tensors
        ]
        assert merged.metadata["split.count"] == 3
        assert all(len(read_gguf_header_file(p).tensors) < len(unsplit.tensors) for p in shards)

    def test_the_memory_plan_of_the_split_set_is_the_unsplit_one(self, llama_pair, write_inventory):
        whole, shards = llama_pair
        data = loads(write_inventory, url="https://e.org/tiny.gguf", sha256=SHA)
        plans = [
            plan_host("rig1", data, header=load_header(data, str(path))[0])
            for path in (whole, shards[0])
        ]
        assert plans[0].memory is not None and plans[0].memory.devices[0].weights_mib > 0
        assert plans[0].memory == plans[1].memory
        assert plans[0].to_json() == plans[1].to_json()

    def test_the_real_smollm2_split_in_three_plans_as_the_unsplit_file(
        self, write_inventory, tmp_path, smollm2
    ):
        shards = split_gguf(smollm2, tmp_path, 3)
        data = loads(write_inventory, url="https://e.org/s.gguf", sha256=SHA)
        plans = [
            plan_host("rig1", data, header=load_header(data, str(path))[0])
            for path in (smollm2, shards[0])
        ]
        assert plans[0].memory is not None and plans[0].memory == plans[1].memory
        assert [read_gguf_header_file(p).metadata["split.no"] for p in shards] == [0, 1, 2]

    def test_a_missing_shard_beside_the_first_is_an_error_naming_it(self, llama_pair, tmp_path):
        _, shards = llama_pair
        for shard in shards[:2]:
            (tmp_path / shard.name).write_bytes(shard.read_bytes())
        with pytest.raises(GgufError, match=r"00003-of-00003\.gguf: cannot be read"):
            load_header({}, str(tmp_path / shards[0].name))

    def test_shards_out_of_order_are_refused_by_their_split_keys(self, llama_pair):
        _, shards = llama_pair
        headers = [read_gguf_header_file(p) for p in (shards[0], shards[2], shards[1])]
        with pytest.raises(GgufError, match=r"split.no=2.*as shard 2 of 3 it must have 1"):
            merge_split(headers)

    def test_a_set_short_of_tensors_is_refused(self, llama_pair):
        _, shards = llama_pair
        first = read_gguf_header_file(shards[0])
        with pytest.raises(GgufError, match=r"split.count=3.*as shard 1 of 2"):
            merge_split([first, read_gguf_header_file(shards[1])])

    def test_the_header_of_a_split_url_model_is_read_from_every_shard(self, llama_pair):
        whole, shards = llama_pair
        stand_in = HubStandIn()
        stand_in.add_repo("org/tiny", shards[0].parent)
        running = RunningStandIn(stand_in)
        try:
            url = f"{running.url}/org/tiny/resolve/main/{shards[0].name}"
            header, note = load_header({"model": {"url": url}})
        finally:
            running.close()
        assert note == "" and len(header.tensors) == len(read_gguf_header_file(whole).tensors)
        fetched = {r.path.split("?")[0].rsplit("/", 1)[-1] for r in stand_in.requests}
        assert {p.name for p in shards} <= fetched


@pytest.fixture
def stand_in():
    hub_stand_in = HubStandIn()
    running = RunningStandIn(hub_stand_in)
    yield running
    running.close()


@pytest.fixture
def split_repo(tmp_path, llama_pair, stand_in) -> Path:
    whole, shards = llama_pair
    root = tmp_path / "repo"
    (root / "split").mkdir(parents=True)
    (root / whole.name).symlink_to(whole)
    for shard in shards:
        (root / "split" / shard.name).symlink_to(shard)
    stand_in.stand_in.add_repo("org/tiny", root)
    return root


def hf_data(write_inventory, stand_in, **model) -> dict:
    return loads(write_inventory, hf="org/tiny", endpoint=stand_in.url, **model)


def api_calls(stand_in) -> list[str]:
    return [r.path for r in stand_in.stand_in.requests if r.path.startswith("/api/")]


def lock_text(reference: dict, *stems: str) -> str:
    files = [{"path": f"{stem}.gguf", "size": 1, "sha256": SHA} for stem in stems]
    entry = {"reference": {"hf": "org/tiny", **reference}, "commit": "a" * 40, "files": files}
    return yaml.safe_dump({"models": [entry]})


class TestLock:
    def test_a_reference_resolves_into_a_url_model_and_is_recorded(
        self, write_inventory, stand_in, split_repo, tmp_path
    ):
        data = hf_data(write_inventory, stand_in, file="split/tiny-00001-of-00003.gguf")
        lock = tmp_path / "models.lock.yml"
        out = model_lock.resolved(data, lock, update=False)
        commit = commit_sha("org/tiny@main")
        shards = sorted((split_repo / "split").iterdir())
        assert out["model"]["url"] == (
            f"{stand_in.url}/org/tiny/resolve/{commit}/split/tiny-00001-of-00003.gguf"
        )
        assert out["model"]["sha256"] == [sha256_of(p) for p in shards]
        assert [f.url.rsplit("/", 1)[-1] for f in model_files(out)] == [p.name for p in shards]
        [entry] = model_lock.read_lock(lock)
        assert entry["commit"] == commit and len(entry["files"]) == 3
        assert data["model"]["url"] is None  # the loaded data is left as it was

    def test_a_recorded_reference_does_not_move_until_an_update_is_asked(
        self, write_inventory, stand_in, split_repo, tmp_path
    ):
        data = hf_data(write_inventory, stand_in, file="tiny.gguf")
        lock = tmp_path / "models.lock.yml"
        first = model_lock.resolved(data, lock, update=False)["model"]["url"]
        # main moves to another commit upstream
        repo = stand_in.stand_in.repos["org/tiny"]
        repo.revisions["main"] = (commit_sha("moved"), split_repo)
        stand_in.stand_in.requests.clear()
        assert model_lock.resolved(data, lock, update=False)["model"]["url"] == first
        assert api_calls(stand_in) == []
        updated = model_lock.resolved(data, lock, update=True)["model"]["url"]
        assert commit_sha("moved") in updated and api_calls(stand_in)
        [entry] = model_lock.read_lock(lock)
        assert entry["commit"] == commit_sha("moved")

    def test_the_lock_is_beside_the_inventory_and_the_env_asks_an_update(self, monkeypatch):
        monkeypatch.setenv("RIG_INVENTORY", "/srv/rigs/prod.yml")
        monkeypatch.setenv(model_lock.UPDATE_ENV, "1")
        assert model_lock.lock_path() == Path("/srv/rigs/models.lock.yml")
        assert model_lock.update_requested()

    def test_a_sha256_pin_the_hub_contradicts_is_refused(
        self, write_inventory, stand_in, split_repo, tmp_path
    ):
        data = hf_data(write_inventory, stand_in, file="tiny.gguf", sha256=SHA)
        with pytest.raises(HubError) as caught:
            model_lock.resolved(data, tmp_path / "lock.yml", update=False)
        assert caught.value.key_path == ("model", "sha256")
        assert sha256_of(split_repo / "tiny.gguf") in caught.value.message

    def test_a_pin_that_matches_passes(self, write_inventory, stand_in, split_repo, tmp_path):
        pin = sha256_of(split_repo / "tiny.gguf")
        data = hf_data(write_inventory, stand_in, file="tiny.gguf", sha256=pin)
        assert (
            model_lock.resolved(data, tmp_path / "lock.yml", update=False)["model"]["sha256"] == pin
        )

    def test_a_filename_for_a_split_set_matched_by_quant_is_refused(
        self, write_inventory, stand_in, split_repo, tmp_path
    ):
        for shard in (split_repo / "split").iterdir():
            shard.rename(shard.with_name(shard.name.replace("tiny", "tiny-Q8_0")))
        data = hf_data(write_inventory, stand_in, quant="Q8_0", filename="x.gguf")
        with pytest.raises(HubError, match="cannot rename a split model") as caught:
            model_lock.resolved(data, tmp_path / "lock.yml", update=False)
        assert caught.value.key_path == ("model", "filename")

    @pytest.mark.parametrize(
        "text, words",
        [
            ("models: {}", "has a `models:` that is not a list"),
            (
                "models:\n- reference: {hf: org/tiny, file: a.gguf}\n  commit: xyz\n  files: []\n",
                "commit 'xyz' is not 40 hex digits",
            ),
            (
                "models:\n- reference: {hf: org/tiny, file: a.gguf}\n  commit: "
                + "a" * 40
                + "\n  files: [{path: '$(id).gguf', size: 1, sha256: "
                + SHA
                + "}]\n",
                "is not {path: DIR/NAME.gguf",
            ),
            ("models:\n- reference: {hf: 'org/$(id)', file: a.gguf}\n", "is not a repo id"),
            (
                lock_text(
                    {"file": "m-00001-of-00002.gguf"}, "m-00002-of-00002", "m-00001-of-00002"
                ),
                "a split model is its shards in order from the first: m-00001-of-00002.gguf, "
                "m-00002-of-00002.gguf",
            ),
            (
                lock_text({"file": "a.gguf"}, "other"),
                "entry 1: is for other.gguf, not for the file its reference names, a.gguf",
            ),
            (
                lock_text({"quant": "Q8_0"}, "m-Q4_K_M"),
                "is for m-Q4_K_M.gguf, whose name does not carry its reference's quant",
            ),
            ("models: [" + "{}, " * 300_000 + "]", "larger than 1024 KiB"),
        ],
    )
    def test_a_malformed_lock_is_refused_naming_the_file(self, tmp_path, text, words):
        lock = tmp_path / "models.lock.yml"
        lock.write_text(text)
        with pytest.raises(HubError) as caught:
            model_lock.read_lock(lock)
        assert str(lock) in caught.value.message and words in caught.value.message


class TestTimeout:
    def test_a_listing_call_that_never_answers_times_out(
        self, monkeypatch, write_inventory, stand_in, split_repo, tmp_path
    ):
        from huggingface_hub.utils import close_session

        # The stand-in answers only once the call has returned: a call that returns at all
        # returned by its own timeout (no bound on how long that took, which load stretches).
        released, answered = threading.Event(), threading.Event()

        def never_answering(*_):
            released.wait(60)
            answered.set()

        monkeypatch.setattr(hub, "TIMEOUT", 0.5)
        monkeypatch.setattr(hubstandin._Handler, "_paths_info", never_answering)
        close_session()  # the next request builds a client with the patched timeout
        data = hf_data(write_inventory, stand_in, file="tiny.gguf")
        try:
            with pytest.raises(HubError, match="cannot reach") as caught:
                model_lock.resolved(data, tmp_path / "lock.yml", update=False)
            assert not answered.is_set(), "the call waited for the stand-in's answer"
        finally:
            released.set()
            close_session()
        assert caught.value.key_path == ("model", "endpoint")


class TestTokenOnTheHost:
    @pytest.fixture
    def gated(self, tmp_path, llama_pair, stand_in) -> tuple[str, Path]:
        whole, _ = llama_pair
        root = tmp_path / "gated"
        root.mkdir()
        (root / whole.name).symlink_to(whole)
        stand_in.stand_in.add_repo("org/gated", root, gated=True, tokens=("tok-7e1",))
        header = tmp_path / "header"
        header.write_text("Authorization: Bearer tok-7e1\n")
        header.chmod(0o600)
        url = f"{stand_in.url}/org/gated/resolve/main/{whole.name}"
        return url, header

    def test_curl_sends_the_header_file_to_the_hub_and_not_across_the_redirect(
        self, gated, stand_in, tmp_path, llama_pair
    ):
        url, header = gated
        whole, _ = llama_pair
        dest = tmp_path / "m.gguf"
        command = operations.fetch_command(
            url, str(dest), sha256_of(whole), str(header), records=str(tmp_path / "records")
        )
        assert "tok-7e1" not in command and f"-H @{header}" in command
        subprocess.run(["bash", "-ec", command], check=True, capture_output=True, timeout=60)
        assert sha256_of(dest) == sha256_of(whole)
        hub_gets = [r for r in stand_in.stand_in.requests if r.server == "hub"]
        cdn_gets = [r for r in stand_in.stand_in.requests if r.server == "cdn"]
        assert hub_gets and all(r.authorized for r in hub_gets)
        assert cdn_gets and not any(r.authorized for r in cdn_gets)

    def test_without_the_header_file_the_gated_download_fails(self, gated, tmp_path, llama_pair):
        url, _ = gated
        command = operations.fetch_command(
            url, str(tmp_path / "m.gguf"), SHA, records=str(tmp_path / "records")
        )
        result = subprocess.run(["bash", "-ec", command], capture_output=True, timeout=60)
        assert result.returncode == 22 and not (tmp_path / "m.gguf").exists()


def command_text(command) -> str | None:
    """The shell a command runs on the host: a plain command's, or a detached job's script
    (the download runs as one, `llamarig.onhost.hostjob`); None for an upload."""
    if isinstance(command, JobCommand):
        return command.job.script
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    return None


class TestModelStage:
    """tasks/model.py's operations as pyinfra renders them for @local (built, not run)."""

    def operations_of(self, inventory_file: Path, monkeypatch, **config) -> list[tuple[str, list]]:
        from pyinfra.api import Config, Inventory, State
        from pyinfra.api.connect import connect_all
        from pyinfra.context import ctx_host, ctx_state

        from llamarig.config.ssh import pyinfra_host
        from llamarig.converge import stage
        from tasks import model

        monkeypatch.setenv("RIG_INVENTORY", str(inventory_file))
        host_config = load_inventory(inventory_file).hosts["here"]
        inventory = Inventory(([pyinfra_host(host_config)], {}))
        state = State(inventory, Config(**config))
        connect_all(state)
        monkeypatch.setattr(stage, "_rigs", {})
        host = inventory.get_host("@local")
        with ctx_state.use(state), ctx_host.use(host):
            model.deploy()
            return [
                (
                    state.get_op_meta(op_hash).names.pop().split(" | ", 1)[-1],
                    list(state.get_op_data_for_host(host, op_hash).command_generator()),
                )
                for op_hash in state.get_op_order()
            ]

    def test_the_token_reaches_the_host_only_in_the_uploaded_header_file(
        self, tmp_path, stand_in, llama_pair, monkeypatch, caplog
    ):
        from pyinfra.api.command import FileUploadCommand

        from tasks.model import TOKEN_HEADER_FILE

        whole, _ = llama_pair
        (tmp_path / "repo").mkdir()
        (tmp_path / "repo" / whole.name).symlink_to(whole)
        stand_in.stand_in.add_repo("org/gated", tmp_path / "repo", gated=True, tokens=("tk-5a",))
        (tmp_path / "token").write_text("tk-5a\n")
        (tmp_path / "token").chmod(0o600)
        inventory_file = tmp_path / "rig.yml"
        inventory_file.write_text(
            "all:\n  hosts:\n    here:\n      ssh: {local: true}\n"
            f"      model: {{hf: org/gated, file: {whole.name}, endpoint: '{stand_in.url}', "
            f"token_file: '{tmp_path / 'token'}'}}\n"
            "      gpus: [{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, "
            'compute_capability: "8.6"}]\n'
        )
        # --diff: pyinfra's files.put would print the new file's content ("Will create ...").
        caplog.set_level(logging.DEBUG)
        operations = self.operations_of(inventory_file, monkeypatch, DIFF=True)
        assert caplog.records and "tk-5a" not in caplog.text
        commands = [command for _, listed in operations for command in listed]
        uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
        shells = [text for c in commands if (text := command_text(c)) is not None]
        assert [u.dest.removesuffix(ATOMIC_SUFFIX) for u in uploads] == [TOKEN_HEADER_FILE]
        assert uploads[0].src.getvalue() == b"Authorization: Bearer tk-5a\n"
        assert not any("tk-5a" in text for text in shells + [n for n, _ in operations])
        assert not any("tk-5a" in repr(c) for c in commands)
        [fetch] = [text for text in shells if "curl" in text]
        assert (
            f"-H @{TOKEN_HEADER_FILE}" in fetch
            and f"/resolve/{commit_sha('org/gated@main')}/" in fetch
        )
        assert any(f"chmod 600 {TOKEN_HEADER_FILE}" in text for text in shells)
        assert (tmp_path / "models.lock.yml").is_file()

    def test_a_split_url_model_fetches_every_shard(self, tmp_path, monkeypatch):
        inventory_file = tmp_path / "rig.yml"
        inventory_file.write_text(
            "all:\n  hosts:\n    here:\n      ssh: {local: true}\n"
            "      model: {url: 'http://127.0.0.1:9/m-00001-of-00003.gguf', sha256: "
            + json.dumps(SHAS)
            + "}\n"
            "      gpus: [{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, "
            'compute_capability: "8.6"}]\n'
        )
        operations = self.operations_of(inventory_file, monkeypatch)
        fetches = [(name, listed) for name, listed in operations if "sha256 checked" in name]
        assert [name for name, _ in fetches] == [
            f"Model /opt/llamarig/models/m-0000{n}-of-00003.gguf (sha256 checked)"
            for n in (1, 2, 3)
        ]
        for (_, [command]), digest in zip(fetches, SHAS, strict=True):
            assert digest in command_text(command) and "-H @" not in command_text(command)


class TestPlanCommand:
    def test_plan_resolves_the_reference_and_plans_the_merged_header(
        self, write_inventory, stand_in, split_repo, monkeypatch, capsys
    ):
        from llamarig.cli import main

        text = model_yaml(
            hf="org/tiny", file="split/tiny-00001-of-00003.gguf", endpoint=stand_in.url
        )
        monkeypatch.setenv("RIG_INVENTORY", str(write_inventory(text)))
        assert main(["plan", "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)["hosts"]["rig1"]
        assert planned["warnings"] == [] and planned["devices"][0]["weights_mib"] > 0
        model_argument = planned["server_args"][planned["server_args"].index("-m") + 1]
        assert model_argument == "/opt/llamarig/models/tiny-00001-of-00003.gguf"

    def test_a_reference_plans_the_same_from_its_recorded_headers(
        self, write_inventory, stand_in, split_repo, monkeypatch, capsys, tmp_path
    ):
        """The shards' headers recorded by `llamarig lock`: with the Hub's files out of reach
        and no header cache, the plan is the one made from the files, byte for byte."""
        import shutil
        import urllib.error

        from llamarig.cli import main
        from llamarig.planner import header as model_header

        text = model_yaml(
            hf="org/tiny", file="split/tiny-00001-of-00003.gguf", endpoint=stand_in.url
        )
        monkeypatch.setenv("RIG_INVENTORY", str(write_inventory(text)))
        monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
        assert main(["plan", "--json"]) == 0
        from_files = capsys.readouterr().out
        assert main(["lock"]) == 0
        assert capsys.readouterr().out.count("rig1: recorded the header of") == 3
        shutil.rmtree(tmp_path / "cache")

        def unreachable(url, *_, **__):
            raise urllib.error.URLError(f"cannot reach {url}")

        monkeypatch.setattr(model_header, "fetch_header", unreachable)
        assert main(["plan", "--json"]) == 0
        assert capsys.readouterr().out == from_files

    def test_plan_refuses_a_reference_that_does_not_resolve_naming_file_and_key(
        self, write_inventory, stand_in, monkeypatch, capsys
    ):
        from llamarig.cli import main

        path = write_inventory(model_yaml(hf="org/absent", quant="Q8_0", endpoint=stand_in.url))
        monkeypatch.setenv("RIG_INVENTORY", str(path))
        assert main(["plan"]) == 2
        error = capsys.readouterr().err
        assert f"{path}: hosts.rig1.model.hf:" in error and "was not found" in error
        assert not (path.parent / "models.lock.yml").exists()


def test_the_deploy_reads_every_shard_header_from_the_host(write_inventory, llama_pair):
    """gather on a local host (its shell, as over ssh): the shards of a split `path` model are
    read one by one from the host and merged; a missing one is named."""
    from llamarig.planner.gather import gather, shell_reader

    whole, shards = llama_pair
    text = model_yaml(path=str(shards[0])).replace(
        "ssh: {host: 192.0.2.1, user: root}", "ssh: {local: true}"
    )
    data = load_inventory(write_inventory(text)).hosts["rig1"].data
    gathered = gather(data, shell_reader(data), gpus=False)
    assert gathered.header is not None, gathered.header_note
    assert len(gathered.header.tensors) == len(read_gguf_header_file(whole).tensors)


def test_a_shard_missing_on_the_host_is_named_in_the_plan_note(
    write_inventory, llama_pair, tmp_path
):
    from llamarig.planner.gather import gather, shell_reader

    _, shards = llama_pair
    for shard in shards[:2]:
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    first = tmp_path / shards[0].name
    text = model_yaml(path=str(first)).replace(
        "ssh: {host: 192.0.2.1, user: root}", "ssh: {local: true}"
    )
    data = load_inventory(write_inventory(text)).hosts["rig1"].data
    gathered = gather(data, shell_reader(data), gpus=False)
    assert gathered.header is None
    assert f"{tmp_path / shards[2].name} is not on the host yet" in gathered.header_note
