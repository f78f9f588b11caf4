"""Model: download resumably and checksummed into the models directory, or use a file that is
already on the host; every shard of a split model, each checked, before the server changes.
The Hugging Face token is on the host only while a model of the rig needs it, and goes only
with the requests for its Hub's URLs."""

import io

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta

from llamarig import operations
from llamarig.converge import stage
from llamarig.model.catalog import served_data
from llamarig.model.files import model_files
from llamarig.model.reference import hub_token_file, read_token, sends_hub_token
from llamarig.onhost import hostpaths

# The token is uploaded into a directory only root may enter, so no one else can read it even
# before its own mode is set.
TOKEN_DIRECTORY = hostpaths.HUB_TOKEN_DIRECTORY
TOKEN_HEADER_FILE = hostpaths.HUB_TOKEN_HEADER_PATH


@api.deploy("tasks/model.py")
def deploy() -> list[OperationMeta]:
    """Returns the downloads (none for a file already on the host or an RPC worker): when one
    changes, the server must restart. A rig of several models fetches each."""
    if stage.serves_no_model():
        host.noop(f"{stage.rig()['role']}: no model here")
        return []
    if stage.builds_only():
        host.noop("builds only: the model is left as it is")
        return []
    rig = stage.rig()
    if rig["role"] == "rpc-worker":
        _hub_token([])
        host.noop("rpc-worker: the head holds the model and sends the worker its tensors")
        return []
    served = served_data(rig)
    _hub_token(served)
    downloads = [op for model in served for op in _model(model)]
    stage.record_headers()
    return downloads


def _hub_token(served: list[dict]) -> None:
    """The Hub token's header file on the host (root only) while a model of ``served`` (each
    model's one-model rig data) is a Hugging Face reference with a `token_file`; removed by
    the first converge whose models need it no more (then nothing), so no later request can
    find it. The models of a rig share one token_file (the loader checks)."""
    token_files = [token for model in served if (token := hub_token_file(model["model"]))]
    if not token_files:
        operations.absent(
            name=f"No Hugging Face token on the host ({TOKEN_HEADER_FILE}: no model needs it)",
            path=TOKEN_HEADER_FILE,
        )
        return
    operations.directory(
        name=f"Root-only {TOKEN_DIRECTORY}",
        path=TOKEN_DIRECTORY,
        user="root",
        group="root",
        mode="700",
    )
    # secret_file, not files.put: `--diff` prints what files.put writes.
    operations.secret_file(
        name=f"Hugging Face token for the Hub's downloads ({TOKEN_HEADER_FILE}, root only)",
        src=io.BytesIO(f"Authorization: Bearer {read_token(token_files[0])}\n".encode()),
        dest=TOKEN_HEADER_FILE,
    )


def _model(rig: dict) -> list[OperationMeta]:
    """One model's files: checked in place (``path``) or downloaded and checked, the Hub
    token's header file sent with a shard's request only when its URL is the Hub's
    (``sends_hub_token``)."""
    model = rig["model"]
    shards = model_files(rig)
    if model["path"]:
        for shard in shards:
            operations.check_file(
                name=f"Model file {shard.dest} on the host",
                path=shard.dest,
                sha256=shard.sha256,
                rehash=model["rehash"],
            )
        return []
    operations.directory(name="Models directory", path=rig["paths"]["models"], mode="755")
    # A file in place without a valid record (from before records, changed on the host, or
    # model.rehash) is hashed here, so a digest that matches changes no download and restarts
    # nothing; fetch_checked then reads the record.
    for shard in shards:
        operations.record_checksum(
            name=f"Checksum of {shard.dest} (hashed only when it changed)",
            path=shard.dest,
            rehash=model["rehash"],
        )
    return [
        operations.fetch_checked(
            name=f"Model {shard.dest} (sha256 checked)",
            url=shard.url,
            dest=shard.dest,
            sha256=shard.sha256,
            header_file=TOKEN_HEADER_FILE if sends_hub_token(model, shard.url) else None,
        )
        for shard in shards
    ]
