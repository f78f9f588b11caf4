"""Hugging Face model references, resolved on the control machine into what the download uses.

A reference names a GGUF the way users and llama.cpp do::

    {hf: ORG/REPO, file: PATH.gguf}          # a file of the repo (a path inside it)
    {hf: ORG/REPO, quant: Q4_K_M}            # the one GGUF whose name carries that quant

with optional ``revision`` (a branch, tag or commit; default ``main``), ``endpoint`` (default
``https://huggingface.co``; a mirror) and ``token_file`` (a file on the control machine that
holds a token, for private and gated repos). ``resolve`` asks the Hub through
``huggingface_hub`` and returns the URL, size and sha256 of every file to fetch, with the
revision pinned to its commit sha so that a later run fetches the same bytes.

Choices, and why:

- The endpoint is the reference's (or the default), never ``HF_ENDPOINT`` from the environment
  of whoever runs the deploy, and the token is ``token_file``'s, never ``HF_TOKEN`` or a login
  cached under ~/.cache/huggingface: the rig data alone says where a model comes from, and a
  repo that only resolves with a personal login would then fail on the host, which downloads
  with ``token_file`` alone.
- ``quant`` is matched case-insensitively as a whole token of the file's path in the repo: the
  characters around it must not be letters, digits or ``_``. So ``Q4_K`` matches neither
  ``Q4_K_M`` nor ``Q4_K_S`` (they are different files; name one), ``F16`` does not match
  ``BF16``, ``Q4_K_XL`` matches ``UD-Q4_K_XL``. ``mmproj-*`` files (vision projectors, not
  models) are never matched. The shards of a split model count as one candidate.
- A split model (``NAME-00001-of-00003.gguf``, llama.cpp's gguf-split naming) is named or
  matched by its first shard; every shard must be in the repo, and all come back in order.
- A file that is not in LFS has no sha256 in the Hub's listing (only a git blob id): it is
  refused rather than downloaded unchecked.

The token is read in this process and handed to huggingface_hub, which sends it as an
``Authorization`` header to the endpoint (and, across a redirect, only to the same origin or
the Hub's own hosts as huggingface_hub lists them; a CDN's signed URL gets none): it is never
put in an argv, an environment, a log line or an exception message. The host's download and
header reads send it only with the endpoint's URLs (``reference.sends_hub_token``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import httpx2
from huggingface_hub import HfApi, RepoFile, constants, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import set_client_factory
from huggingface_hub.utils._http import default_client_factory

from llamarig.model.files import sibling_paths, split_parts
from llamarig.model.reference import (
    HubError,
    Reference,
    problem,
    quant_pattern,
    read_token,
    validated,
)

# Seconds any request to the Hub may wait for an answer. huggingface_hub's own client has no
# timeout for the listing and paths-info calls (only model_info and the HEAD take one), so its
# client factory is replaced with one that has this timeout for every request.
TIMEOUT = 30.0


def _client_with_timeout() -> httpx2.Client:
    client = default_client_factory()  # the library's own, with its request hook
    client.timeout = httpx2.Timeout(TIMEOUT)
    return client


set_client_factory(_client_with_timeout)

# Building its User-Agent, huggingface_hub fetches an "agent harness" list from huggingface.co
# (HF_ENDPOINT, never the endpoint given) unless telemetry is off: a request to the public Hub
# that a rig resolving through a mirror must not make. The library reads this at call time.
constants.HF_HUB_DISABLE_TELEMETRY = True

_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Shard:
    path: str  # inside the repo, e.g. "Q8_0/Model-Q8_0-00001-of-00002.gguf"
    filename: str  # the name to give it on the host (the path's last part)
    url: str  # pinned to the commit
    size: int
    sha256: str


@dataclass(frozen=True)
class ResolvedModel:
    """What the download path needs. For a split model, ``url``/``size``/``sha256``/``filename``
    are the first shard's (what llama-server is given) and ``shards`` holds every shard in
    order; for one file, ``shards`` holds that file alone."""

    repo: str
    revision: str  # as given
    commit: str  # the 40-hex commit the revision pointed to
    endpoint: str
    url: str
    size: int
    sha256: str
    filename: str
    shards: tuple[Shard, ...]
    requires_token: bool  # private or gated: the host's download needs the token too

    @property
    def total_size(self) -> int:
        return sum(shard.size for shard in self.shards)


@contextlib.contextmanager
def _hub_errors(ref: Reference, where: str) -> Iterator[None]:
    """The client's exceptions as HubErrors that name the repo, the revision and the fix."""
    at = f"{ref.repo} at {ref.endpoint}"
    token_hint = (
        f"the token in {ref.token_file} has no access to it"
        if ref.token_file
        else "set model.token_file to a file holding a token with access"
    )
    try:
        yield
    except GatedRepoError as error:
        raise problem(
            "token_file",
            f"{at} is gated ({_status(error)}): accept its terms at {ref.endpoint}/{ref.repo} "
            f"with your account, then {token_hint}"
            + (" once they are accepted" if ref.token_file else ""),
        ) from None
    except RepositoryNotFoundError as error:
        raise problem(
            "hf",
            f"{at} was not found ({_status(error)}): check the ORG/REPO spelling; if the repo is "
            f"private, {token_hint}",
        ) from None
    except RevisionNotFoundError as error:
        raise problem(
            "revision",
            f"{ref.revision!r} is not a branch, tag or commit of {at} ({_status(error)}): use one "
            f"listed at {ref.endpoint}/{ref.repo}/tree/main, or leave revision out for main",
        ) from None
    except RemoteEntryNotFoundError as error:
        raise problem(
            "file", f"{where} is not in {at} at {ref.revision} ({_status(error)})"
        ) from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            fix = (
                f"the token in {ref.token_file} was refused: check that it is valid and has read "
                "access"
                if ref.token_file
                else "set model.token_file to a file holding a token with read access"
            )
        elif status == 429:
            fix = "the Hub is rate-limiting: wait, or set model.token_file (higher limits)"
        else:
            fix = f"check that {ref.endpoint} is a Hugging Face Hub (or mirror) and that it is up"
        raise problem(
            "endpoint" if status not in (401, 403) else "token_file",
            f"{ref.endpoint} answered {_status(error)} for {where} of {ref.repo}: {fix}",
        ) from None
    except OfflineModeIsEnabled:
        raise problem(
            "hf",
            f"cannot resolve {ref.repo}: HF_HUB_OFFLINE is set in this environment; unset it, "
            "or give model.url and model.sha256 instead",
        ) from None
    except (httpx2.TransportError, OSError) as error:
        raise problem(
            "endpoint",
            f"cannot reach {ref.endpoint} for {where} of {ref.repo} ({type(error).__name__}: "
            f"{error}): check the network and the endpoint, or give model.url and model.sha256",
        ) from None


def _status(error: HfHubHTTPError) -> str:
    response = error.response
    if response is None:
        return "no answer"
    # the server's words, shortened and printable: a mirror's header is no place for escapes
    message = "".join(c for c in response.headers.get("X-Error-Message", "") if c.isprintable())
    return f"HTTP {response.status_code}" + (f", {message[:200]}" if message else "")


def _candidates(paths: list[str]) -> dict[str, list[str]]:
    """GGUF models among ``paths``: the first shard (or the file) -> the shards present."""
    models: dict[str, list[str]] = {}
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if not name.endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        models.setdefault(sibling_paths(path)[0], []).append(path)
    return models


def _listed(models: dict[str, list[str]]) -> str:
    if not models:
        return "none"
    shown = [
        first if len(sibling_paths(first)) == 1 else f"{first} ({len(sibling_paths(first))} shards)"
        for first in models
    ]
    return ", ".join(shown)


def _pick_quant(ref: Reference, paths: list[str], commit: str) -> str:
    models = _candidates(paths)
    pattern = quant_pattern(ref.quant)
    matches = [first for first in models if pattern.search(first)]
    where = f"{ref.repo} at {ref.revision} ({commit[:12]})"
    if not matches:
        raise problem(
            "quant",
            f"no GGUF of {where} carries the quant {ref.quant!r} as a whole name part; its GGUFs: "
            f"{_listed(models)}. Name one with `quant` (exactly as in the file name) or `file`",
        )
    if len(matches) > 1:
        raise problem(
            "quant",
            f"{ref.quant!r} matches {len(matches)} GGUFs of {where}: "
            f"{_listed({m: models[m] for m in matches})}. Name one with `file`",
        )
    return matches[0]


def resolve(reference: Mapping) -> ResolvedModel:
    """The files that ``reference`` names, with their pinned URLs, sizes and sha256s.

    Raises HubError (with the model key at fault) for a reference of a bad shape before any
    request, and for what the Hub answers: a missing repo, revision or file, a gated or
    private repo without a token that grants it, an ambiguous or missing quant (with the
    candidates), a split set with shards missing, a file without an LFS sha256, no network.
    """
    ref = validated(reference)
    token = read_token(ref.token_file) if ref.token_file else None
    try:
        return _resolved(ref, token)
    except HubError as error:
        if token is None or token not in error.message:
            raise
        # only a server that echoes the Authorization header puts it there; keep it out
        raise HubError(error.key_path, error.message.replace(token, "<token>")) from None


def _resolved(ref: Reference, token: str | None) -> ResolvedModel:
    # token=False: no implicit HF_TOKEN or cached login (see the module's docstring)
    api = HfApi(endpoint=ref.endpoint, token=token or False, library_name="llamarig")
    with _hub_errors(ref, "the repo info"):
        info = api.model_info(ref.repo, revision=ref.revision, timeout=TIMEOUT)
    commit = info.sha or ""
    if not _COMMIT.fullmatch(commit):
        raise problem(
            "endpoint",
            f"{ref.endpoint} gave no commit for {ref.repo} at {ref.revision} (sha {commit!r}): "
            "is it a Hugging Face Hub?",
        )
    requires_token = bool(info.private or info.gated)
    if info.gated and token is None:
        raise problem(
            "token_file",
            f"{ref.repo} at {ref.endpoint} is gated: accept its terms at "
            f"{ref.endpoint}/{ref.repo}, then set model.token_file to a file holding a token "
            "of that account",
        )

    if ref.file is not None:
        first = ref.file
        parts = split_parts(first)
        if parts and parts[1] != 1:
            raise problem(
                "file",
                f"{first} is shard {parts[1]} of a split model: name its first shard, "
                f"{sibling_paths(first)[0]}",
            )
        wanted = sibling_paths(first)
        with _hub_errors(ref, first):
            entries = api.get_paths_info(ref.repo, wanted, revision=commit)
        if not any(entry.path == first for entry in entries):
            with _hub_errors(ref, "the file listing"):
                listing = api.list_repo_tree(ref.repo, revision=commit, recursive=True)
                paths = [entry.path for entry in listing]
            raise problem(
                "file",
                f"{first} is not in {ref.repo} at {ref.revision} ({commit[:12]}); its GGUFs: "
                f"{_listed(_candidates(paths))}",
            )
    else:
        with _hub_errors(ref, "the file listing"):
            entries = list(api.list_repo_tree(ref.repo, revision=commit, recursive=True))
        first = _pick_quant(ref, [entry.path for entry in entries], commit)
        wanted = sibling_paths(first)

    found = {entry.path: entry for entry in entries if isinstance(entry, RepoFile)}
    missing = [path for path in wanted if path not in found]
    if missing:
        raise problem(
            "file" if ref.file else "quant",
            f"{first} is the first of {len(wanted)} shards, but {ref.repo} at {ref.revision} "
            f"({commit[:12]}) lacks {', '.join(missing)}: an incomplete upload; pick another "
            "revision or file",
        )
    shards = tuple(_shard(ref, commit, found[path]) for path in wanted)

    # The host fetches the first shard's URL as this client would: confirm it answers (a gated
    # repo's metadata is public, its files are not) and that its size is the listed one.
    with _hub_errors(ref, first):
        metadata = get_hf_file_metadata(shards[0].url, token=token or False, timeout=TIMEOUT)
    if metadata.size is not None and metadata.size != shards[0].size:
        raise problem(
            "endpoint",
            f"{shards[0].url} answers {metadata.size} bytes but the listing says "
            f"{shards[0].size}: the endpoint is inconsistent; try again or use another",
        )
    return ResolvedModel(
        repo=ref.repo,
        revision=ref.revision,
        commit=commit,
        endpoint=ref.endpoint,
        url=shards[0].url,
        size=shards[0].size,
        sha256=shards[0].sha256,
        filename=shards[0].filename,
        shards=shards,
        requires_token=requires_token,
    )


def _shard(ref: Reference, commit: str, entry) -> Shard:
    if entry.lfs is None:
        raise problem(
            "file" if ref.file else "quant",
            f"{entry.path} of {ref.repo} is stored in git, not LFS, so the Hub lists no sha256 "
            "for it: give model.url and model.sha256 (sha256sum of the file) instead",
        )
    sha256 = entry.lfs.sha256.lower()
    if not re.fullmatch(r"[0-9a-f]{64}", sha256) or entry.lfs.size != entry.size:
        raise problem(
            "endpoint",
            f"{ref.endpoint} lists {entry.path} of {ref.repo} with a malformed LFS record "
            f"(sha256 {sha256!r}, size {entry.lfs.size} vs {entry.size})",
        )
    return Shard(
        path=entry.path,
        filename=entry.path.rsplit("/", 1)[-1],
        url=hf_hub_url(ref.repo, entry.path, revision=commit, endpoint=ref.endpoint),
        size=entry.size,
        sha256=sha256,
    )
