"""A Hugging Face reference resolved on the control machine, before any host is touched, into
the URL(s) and sha256(s) the download path uses, and recorded so that a re-run does not move.

The record is ``models.lock.yml`` beside the inventory file, which the user commits with it:
for each reference (endpoint, repo, revision as given, file or quant) the commit it resolved to
and every file's path, size and sha256. A later run (deploy or ``llamarig plan``) takes a
recorded reference from the file without asking the Hub, so ``revision: main`` keeps meaning
the commit first seen until the user asks again: ``llamarig plan --update-models``, or
``LLAMARIG_UPDATE_MODELS=1`` for a deploy, resolves every reference anew and rewrites its
record.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import yaml

from llamarig.config.loader import MAX_FILE_BYTES, load_yaml, shape_problem
from llamarig.config.paths import inventory_path
from llamarig.config.problems import ConfigError
from llamarig.model import header_record
from llamarig.model.catalog import is_router, model_views, with_views
from llamarig.model.files import ModelFile, sibling_paths
from llamarig.model.gguf import GgufError, GgufHeader, merge_split, model_problem, split_problem
from llamarig.model.reference import (
    DEFAULT_ENDPOINT,
    DEFAULT_REVISION,
    HubError,
    quant_pattern,
    validated,
)
from llamarig.tables.text import printable

LOCK_NAME = "models.lock.yml"
UPDATE_ENV = "LLAMARIG_UPDATE_MODELS"
_HEADER = """\
# The commits llamarig resolved Hugging Face model references to, and each file's sha256
# (`models`); the GGUF header of each model file the planner read (`headers`, trimmed and
# compressed, keyed by the file's sha256 or its path on the host, with the file's size in
# bytes as the header gives it). Commit this file with the
# inventory: later runs fetch exactly these files, and a plan made where the model cannot be
# read is the plan the deploy makes. To move to what the references name now: `llamarig plan
# --update-models` (or LLAMARIG_UPDATE_MODELS=1 for a deploy); `llamarig lock` records the
# headers. Written by llamarig; edit only by deleting an entry.
"""
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REPO_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*\.gguf")


class LockError(HubError, GgufError):
    """models.lock.yml refused: ``message`` names the file, the entry where there is one, and
    the fix, with every character a terminal would obey shown escaped (``text.printable``).
    A HubError (of the model section: its references resolve through the lock) for the code
    that resolves them, a GgufError for the code that reads headers; shown as its message."""

    def __init__(self, message: str, key_path: tuple[str, ...] = ("model",)):
        super().__init__(key_path, printable(message))

    def __str__(self) -> str:
        return self.message


# What a merge that stopped on a conflict leaves in the file (git's markers, diff3's base).
_CONFLICT_MARKER = re.compile(rb"(<{7}|>{7}|\|{7})( |$)|={7}$")
# The fix for a file that is not a lock as llamarig writes it.
_FIX_FILE = (
    "llamarig writes this file: restore it from version control, or delete it (or the broken "
    "entries) and run `llamarig lock` to record the headers again (a plan resolves a deleted "
    "Hugging Face reference again)"
)
_FIX_HEADER = "delete that entry of `headers:`; `llamarig lock` records it again"


def lock_path() -> Path:
    """``models.lock.yml`` in the directory of the inventory RIG_INVENTORY names."""
    return inventory_path().parent / LOCK_NAME


def update_requested() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")


def reference_of(model: dict) -> dict:
    """The key a reference is recorded under: what names the files, defaults filled in (the
    token file is not part of it: it grants access, it does not choose the files)."""
    key = {
        "endpoint": (model["endpoint"] or DEFAULT_ENDPOINT).rstrip("/"),
        "hf": model["hf"],
        "revision": model["revision"] or DEFAULT_REVISION,
    }
    key.update({name: model[name] for name in ("file", "quant") if model[name]})
    return key


def _read_document(path: Path) -> dict:
    """The file's `models` and `headers` lists, each entry checked into shapes that cannot carry
    shell syntax (the file is the user's to commit, so it is read as untrusted input). Raises
    LockError naming the file and the fix for anything else in its place: a directory, a file
    with merge-conflict markers, one that is not YAML or not a lock's shape."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return {"models": [], "headers": []}
    except OSError as error:
        why = error.strerror or error
        raise LockError(f"{path}: cannot be read ({why}); {_FIX_FILE}") from None
    if stat.S_ISDIR(mode):
        raise LockError(
            f"{path}: is a directory, where llamarig keeps the lock file {LOCK_NAME}: move it "
            "away; `llamarig lock` records the headers again"
        )
    if stat.S_ISREG(mode):
        conflict = _conflict_line(path)
        if conflict:
            raise LockError(
                f"{path}:{conflict}: has git merge-conflict markers (<<<<<<<, =======, >>>>>>>): "
                "a merge left both sides of an entry: keep one side of each conflict (or "
                "delete both) and remove the markers, then run `llamarig lock` to record the "
                "headers again"
            )
    try:
        document = load_yaml(path)
    except ConfigError as error:
        # The loader's hint is for an inventory; a lock is llamarig's to write.
        problem = error.problems[0].split("; fix the YAML there")[0]
        raise LockError(f"{problem}: {_FIX_FILE}") from None
    if document is not None and not isinstance(document, dict):
        raise _lock_error(path, "is not a mapping of `models:` and `headers:` lists")
    shape = shape_problem(document)
    if shape:
        raise LockError(f"{path}: {shape}: {_FIX_FILE}")
    document = document or {}
    lists = {}
    for key, problem_of in (("models", _entry_problem), ("headers", _header_entry_problem)):
        entries = document.get(key, [])
        if not isinstance(entries, list):
            raise _lock_error(path, f"has a `{key}:` that is not a list")
        for index, entry in enumerate(entries):
            problem = problem_of(entry)
            if problem and key == "headers":
                raise LockError(f"{path} headers entry {index + 1}: {problem}: {_FIX_HEADER}")
            if problem:
                raise _lock_error(path, f"{key} entry {index + 1}: {problem}")
        lists[key] = entries
    return lists


def _conflict_line(path: Path) -> int | None:
    """The line of the first merge-conflict marker in the file, if any (read as load_yaml
    reads it: at most MAX_FILE_BYTES)."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None  # load_yaml says why
    for number, line in enumerate(raw.splitlines(), 1):
        if _CONFLICT_MARKER.match(line):
            return number
    return None


def _write_document(path: Path, document: dict) -> None:
    """Written whole, then renamed into place, so a reader never sees half a file."""
    text = _HEADER + yaml.safe_dump(
        {key: entries for key, entries in document.items() if entries}, sort_keys=True, width=100
    )
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def read_lock(path: Path) -> list[dict]:
    """The recorded Hugging Face references."""
    return _read_document(path)["models"]


def _entry_problem(entry: object) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("reference"), dict):
        return "not a mapping with `reference`, `commit` and `files`"
    try:
        validated(entry["reference"])
    except HubError as error:
        return f"reference: {error.message}"
    if not isinstance(entry.get("commit"), str) or not _COMMIT.fullmatch(entry["commit"]):
        return f"commit {entry.get('commit')!r} is not 40 hex digits"
    files = entry.get("files")
    if not isinstance(files, list) or not files:
        return "`files` is not a list of {path, size, sha256}"
    for file in files:
        if not (
            isinstance(file, dict)
            and isinstance(file.get("path"), str)
            and _REPO_PATH.fullmatch(file["path"])
            and isinstance(file.get("sha256"), str)
            and _SHA256.fullmatch(file["sha256"])
            and isinstance(file.get("size"), int)
        ):
            return f"file {file!r} is not {{path: DIR/NAME.gguf, size, sha256: 64 hex digits}}"
    paths = [file["path"] for file in files]
    if paths != sibling_paths(paths[0]):
        return (
            f"lists {', '.join(paths)}, but a split model is its shards in order from the "
            f"first: {', '.join(sibling_paths(paths[0]))}"
        )
    reference = entry["reference"]
    if reference.get("file") and reference["file"] != paths[0]:
        return f"is for {paths[0]}, not for the file its reference names, {reference['file']}"
    if reference.get("quant") and not quant_pattern(reference["quant"]).search(paths[0]):
        return f"is for {paths[0]}, whose name does not carry its reference's quant"
    return None


def _lock_error(path: Path, message: str) -> LockError:
    return LockError(
        f"{path} {message}: delete the file (or the entry) to resolve the references again",
        ("model", "hf"),
    )


def write_entry(path: Path, entry: dict) -> None:
    """Record ``entry``, replacing the one of the same reference."""
    document = _read_document(path)
    entries = [e for e in document["models"] if e["reference"] != entry["reference"]]
    entries.append(entry)
    entries.sort(key=lambda e: sorted(e["reference"].items()))
    _write_document(path, {**document, "models": entries})


def _header_entry_problem(entry: object) -> str | None:
    shape = "a mapping of `file`, `format`, `record`, `size` and one of `digest` or `declared`"
    if not isinstance(entry, dict) or set(entry) - {"size"} not in (
        {"file", "digest", "format", "record"},
        {"file", "declared", "format", "record"},
    ):
        return f"not {shape}"
    size = entry.get("size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"size {entry['size']!r} is not a number of bytes"
    if _file_key_problem(entry["file"]):
        return _file_key_problem(entry["file"])
    if entry["format"] != header_record.FORMAT:
        return f"format {entry['format']!r} is not {header_record.FORMAT}"
    if "digest" in entry and not (
        isinstance(entry["digest"], str) and _SHA256.fullmatch(entry["digest"])
    ):
        return f"digest {entry['digest']!r} is not 64 hex digits"
    if "declared" in entry and not (
        isinstance(entry["declared"], str)
        and 0 < len(entry["declared"]) <= 500
        and entry["declared"].isprintable()
    ):
        return (
            f"declared {_shown(entry['declared'])} is not the text of where the header's values "
            "come from (one printable line of at most 500 characters)"
        )
    if not isinstance(entry["record"], str):
        return "record is not text"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _file_key_problem(key: object) -> str | None:
    if isinstance(key, dict) and len(key) == 1:
        [(kind, value)] = key.items()
        if isinstance(value, str) and "\n" not in value:
            if kind == "sha256" and _SHA256.fullmatch(value):
                return None
            if kind == "host_path" and value.startswith("/"):
                return None
            if kind == "url" and re.fullmatch(r"https?://\S+", value):
                return None
    return (
        f"file {key!r} is not {{sha256: 64 hex digits}}, {{host_path: /absolute/path}} or "
        "{url: http(s)://...} (a declared header)"
    )


def header_key(file: ModelFile) -> dict:
    """What a model file's header is recorded under: its sha256, else its path on the host."""
    return {"sha256": file.sha256} if file.sha256 else {"host_path": file.dest}


def declared_key(file: ModelFile) -> dict | None:
    """What a header declared for a file's URL is recorded under (before the file is read)."""
    return {"url": file.url} if file.url else None


def header_entry(path: Path, key: dict) -> dict | None:
    """The entry of `headers:` recorded under ``key`` as it stands in the file, or None."""
    return next((e for e in _read_document(path)["headers"] if e["file"] == key), None)


def recorded_header(path: Path, key: dict | None) -> GgufHeader | None:
    """The header recorded under ``key`` (``header_key`` or ``declared_key``), or None. A
    declared header has no digest. Raises LockError (a GgufError), naming the lock file, the
    entry and the fix, for a lock that is not one and for a record that cannot be decoded or
    contradicts itself (``header_record.decode``)."""
    for entry in _read_document(path)["headers"]:
        if key is not None and entry["file"] == key:
            return _decoded(path, entry)
    return None


def _decoded(path: Path, entry: dict) -> GgufHeader:
    what = next(iter(entry["file"].values()))
    name = f"{path} (header of {what}" + (
        f", declared from {entry['declared']})" if "declared" in entry else ")"
    )
    try:
        return header_record.decode(
            entry["record"], entry.get("digest", ""), name, entry.get("size")
        )
    except GgufError as error:
        raise LockError(f"{error}: {_FIX_HEADER}") from None


def merged_records(records: list[GgufHeader]) -> GgufHeader:
    """The model's header from its files' records (each shard's, in order, as
    ``recorded_header`` gave them), checked as a whole: the shards one gguf-split set, the
    merged header a model (``model_problem``). Raises LockError naming the entries."""
    first = records[0]
    split = len(records) > 1
    name = first.source + (f" and its {len(records) - 1} other shards' entries" if split else "")
    problem = split_problem(records)
    header = merge_split(records) if problem is None else None
    if header is not None:
        problem = model_problem(header)
    if problem:
        raise LockError(
            f"{name}: the recorded header{'s are' if split else ' is'} inconsistent: {problem}: "
            + (
                "delete those entries of `headers:`; `llamarig lock` records them again"
                if split
                else _FIX_HEADER
            )
        )
    return header


def lock_problems(path: Path | None = None) -> list[str]:
    """Every problem of the lock beside the inventory (``path``), each naming the file, the
    entry and the fix: the file is not one (a directory, merge-conflict markers, not YAML, not
    a lock's shape), or a header record cannot be decoded or contradicts itself. Checked
    when the inventory is loaded for a deploy, so that a dry run refuses before it connects;
    the shards of a split model are checked together when a plan reads them."""
    path = lock_path() if path is None else path
    try:
        entries = _read_document(path)["headers"]
    except LockError as error:
        return [error.message]
    problems = []
    for entry in entries:
        try:
            _decoded(path, entry)
        except LockError as error:
            problems.append(error.message)
    return problems


def record_header(path: Path, key: dict, header: GgufHeader, superseded: list[dict] = ()) -> bool:
    """Record ``header`` (read from the file) under ``key``, replacing an entry with another
    digest and the entries of ``superseded`` (declared ones the file now speaks for); False when
    the same header was recorded already."""
    document = _read_document(path)
    entries = document["headers"]
    if any(
        e["file"] == key and e.get("digest") == header.digest and "size" in e for e in entries
    ) and not any(e["file"] in superseded for e in entries):
        return False
    _put_header(path, document, {"file": key, "digest": header.digest}, header, superseded)
    return True


def _put_header(
    path: Path, document: dict, entry: dict, header: GgufHeader, superseded: list[dict] = ()
) -> None:
    """Write ``entry`` (its file key and digest or declaration) with ``header``'s record in
    place of the entries of the same file key and of ``superseded``."""
    gone = [entry["file"], *superseded]
    entries = [e for e in document["headers"] if e["file"] not in gone]
    record = header_record.encode(header)
    # The file's size, readable beside the compressed record (a reviewer of the lock sees it).
    entries.append(
        {**entry, "size": header.data_end, "format": header_record.FORMAT, "record": record}
    )
    entries.sort(key=lambda e: sorted(e["file"].items()))
    _write_document(path, {**document, "headers": entries})


def declare_header(path: Path, url: str, header: GgufHeader, source: str) -> None:
    """Record ``header``, built from ``source`` (a model's published configuration) rather than
    read, as the declared header of the file at ``url``; the first deploy that reads the file
    checks it and records the file's own."""
    _put_header(path, _read_document(path), {"file": {"url": url}, "declared": source}, header)


def recorded(model: dict, lock: Path, update: bool) -> dict:
    """The lock entry of the model's reference: the recorded one, else (or with ``update``) one
    resolved now through the Hub and recorded."""
    reference = reference_of(model)
    if not update:
        for entry in read_lock(lock):
            if entry["reference"] == reference:
                return entry
    from llamarig.model import hub  # the network side, imported only when a reference is resolved

    asked = {**reference, **({"token_file": model["token_file"]} if model["token_file"] else {})}
    found = hub.resolve(asked)
    entry = {
        "reference": reference,
        "commit": found.commit,
        "requires_token": found.requires_token,
        "files": [
            {"path": shard.path, "size": shard.size, "sha256": shard.sha256}
            for shard in found.shards
        ],
    }
    write_entry(lock, entry)
    return entry


def file_url(reference: dict, commit: str, path: str) -> str:
    """The resolve URL of a file of the repo, pinned to the commit (as huggingface_hub builds
    it: the path's parts percent-quoted)."""
    return f"{reference['endpoint']}/{reference['hf']}/resolve/{commit}/{quote(path)}"


def resolved(data: dict, lock: Path | None = None, update: bool | None = None) -> dict:
    """The rig data with a Hugging Face reference turned into what a URL model has: ``url``
    (the first file's, pinned to the commit), ``sha256`` (one, or a list for a split model)
    and ``filename``; data without a reference is returned as it is. Raises HubError (the
    model key at fault and the fix) for a reference that does not resolve, a sha256 pin the
    Hub contradicts, or a filename given for a split model."""
    if is_router(data):
        views = []
        for view in model_views(data):
            try:
                views.append(replace(view, data=resolved(view.data, lock, update)))
            except HubError as error:
                key = ("models", str(view.index), *error.key_path[1:])
                raise HubError(key, error.message) from None
        return with_views(data, views)
    model = data["model"]
    if not model["hf"]:
        return data
    lock = lock_path() if lock is None else lock
    entry = recorded(model, lock, update_requested() if update is None else update)
    reference, files = entry["reference"], entry["files"]
    digests = [file["sha256"] for file in files]
    pinned = model["sha256"]
    if pinned is not None and (pinned if isinstance(pinned, list) else [pinned]) != digests:
        raise HubError(
            ("model", "sha256"),
            f"pins {pinned!r}, but {reference['hf']} at {entry['commit'][:12]} has "
            f"{digests[0] if len(digests) == 1 else digests} for {files[0]['path']}"
            + (f" (and its {len(files) - 1} other shards)" if len(files) > 1 else "")
            + ": the file changed upstream; check it, then update or remove model.sha256",
        )
    first = files[0]["path"].rsplit("/", 1)[-1]
    if len(files) > 1 and model["filename"]:
        raise HubError(
            ("model", "filename"),
            f"cannot rename a split model: llama.cpp finds the {len(files)} shards of {first} "
            "by their names; remove `filename`",
        )
    out = copy.deepcopy(data)
    out["model"].update(
        url=file_url(reference, entry["commit"], files[0]["path"]),
        sha256=digests if len(files) > 1 else digests[0],
        filename=model["filename"] or first,
    )
    return out
