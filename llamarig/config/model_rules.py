"""The rules of the model section the schema cannot state: one way to name the model (`url`,
`path` or `hf`), the Hugging Face keys only with `hf`, a reference in shapes that cannot carry
shell syntax, and a split model named by its first shard with one sha256 per shard."""

from __future__ import annotations

from llamarig.config.problems import Problem
from llamarig.model.files import (
    model_filename,
    model_source_name,
    numbering_problem,
    shard_names,
    split_parts,
)
from llamarig.model.reference import KEYS as HF_KEYS
from llamarig.model.reference import HubError, read_token, validated
from llamarig.tables.text import printable

SOURCES = ("url", "path", "hf")


def model_problems(data: dict) -> list[Problem]:
    model = data["model"]
    given = [key for key in SOURCES if model[key]]
    if not given:
        if data["role"] == "rpc-worker":
            return []
        return [
            Problem(
                ("model",),
                "has neither `url`, `path` nor `hf`: set `url` (download, with `sha256`), "
                "`path` (a file already on the host) or `hf: ORG/REPO` with `file` or `quant` "
                "(a Hugging Face repo)",
                in_inventory=True,
            )
        ]
    if len(given) > 1:
        return [
            Problem(
                ("model",),
                f"the model is named by both `{given[0]}` and `{given[1]}`: set exactly one of "
                "`url` (download), `path` (a file already on the host) and `hf` (a Hugging Face "
                "repo)",
            )
        ]
    problems = _reference_problems(model) + _split_problems(model)
    if model["url"] and not model["sha256"]:
        problems.append(
            Problem(
                ("model", "sha256"),
                "is required with `url`: a download is only used "
                "when its checksum matches (sha256sum FILE prints it)",
                in_inventory=True,
            )
        )
    if model["url"] and not model["filename"] and not model_filename(data).endswith(".gguf"):
        problems.append(
            Problem(
                ("model", "filename"),
                "cannot be taken from the URL (it does not end "
                "in .gguf); set `filename: NAME.gguf`",
                in_inventory=True,
            )
        )
    return problems


def _reference_problems(model: dict) -> list[Problem]:
    if not model["hf"]:
        return [
            Problem(
                ("model", key),
                f"belongs to a Hugging Face reference, but `hf` is not set: add "
                f"`hf: ORG/REPO`, or remove `{key}`",
            )
            for key in HF_KEYS
            if key != "hf" and model[key] is not None
        ]
    try:
        validated({key: model[key] for key in HF_KEYS if model[key] is not None})
        if model["token_file"]:
            read_token(model["token_file"])  # here, before any host or Hub is contacted
    except HubError as error:
        return [Problem(error.key_path, error.message)]
    return []


def _split_problems(model: dict) -> list[Problem]:
    """A split model is named by its first shard, its shards keep their names, and a sha256
    list has one digest per shard."""
    name = model_source_name(model)
    key = next(key for key in ("url", "path", "file") if model[key]) if name else "quant"
    parts = split_parts(name) if name else None
    sha256 = model["sha256"]
    misnumbered = numbering_problem(name) if name else None
    if misnumbered:
        return [Problem(("model", key), misnumbered)]
    if parts is not None and parts[2] == 1:
        parts = None  # a set of one shard is one file, named as gguf-split names it
    if parts is None:
        if isinstance(sha256, list) and name:
            return [
                Problem(
                    ("model", "sha256"),
                    f"is a list, which is for a split model (NAME-00001-of-0000N.gguf), but "
                    f"{printable(name)} is one file: give its sha256 as one string",
                )
            ]
        return []
    _, number, count = parts
    # Names decoded from a URL are shown escaped (the URL's own check refuses what needs it).
    first = printable(shard_names(name)[0])
    if number != 1:
        return [
            Problem(
                ("model", key),
                f"names shard {number} of {count} of a split model: name its first shard, "
                f"{first} (llama.cpp loads the set from it)",
            )
        ]
    problems = []
    if model["filename"]:
        problems.append(
            Problem(
                ("model", "filename"),
                f"cannot rename a split model: llama.cpp finds the shards of {first} by their "
                "names; remove `filename`",
            )
        )
    if isinstance(sha256, str) or (isinstance(sha256, list) and len(sha256) != count):
        given = "one sha256" if isinstance(sha256, str) else f"{len(sha256)} sha256s"
        problems.append(
            Problem(
                ("model", "sha256"),
                f"{first} is the first of {count} shards, but {given} given: list one sha256 "
                f"per shard, in order ({printable(', '.join(shard_names(name)[:2]))}, ...)",
            )
        )
    return problems + _repeated_digest_problems(sha256)


def _repeated_digest_problems(sha256: object) -> list[Problem]:
    """Each shard of a split model holds its own part of the tensors: two shards with one
    digest would be one file twice (a digest copied into the wrong place of the list)."""
    if not isinstance(sha256, list):
        return []
    first_at: dict[str, int] = {}
    problems = []
    for index, digest in enumerate(sha256):
        if not isinstance(digest, str):
            continue  # the schema names it
        earlier = first_at.setdefault(digest.lower(), index)
        if earlier != index:
            problems.append(
                Problem(
                    ("model", "sha256", index),
                    f"is also sha256[{earlier}]: two shards cannot have the same content; give "
                    f"each shard's own sha256, in order (sha256sum NAME-{index + 1:05d}-of-... "
                    "prints it)",
                )
            )
    return problems
