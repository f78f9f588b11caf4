"""Write the declared GGUF headers of the shipped example rigs into inventory/models.lock.yml,
so that their plans are whole on a machine that cannot read their models (CI).

A declared header is built from the model's published configuration, not read from the file:
the seed rig's Qwen3.6-27B Q8_0 (a 28 GB file on the Hub) from the Qwen3.6-27B model card and
config.json, through the tensor table llama.cpp's qwen35 loader reads (tests/ggufmodels). The
first deploy that reads the real file checks the declaration against it, plans with the file's
header where they differ (naming what differed) and records the file's in its place.

    python -m scripts.declared_headers           # rewrite the declared entries
    python -m scripts.declared_headers --check   # exit 1 when they are stale
"""

import argparse
import sys
import tempfile
from pathlib import Path

from llamarig.config import load_inventory
from llamarig.config.lock import LOCK_NAME, declare_header, header_entry, recorded_header
from llamarig.model.gguf import read_gguf_header_file
from tests.ggufmodels import Qwen35Shape, write_qwen35

PROJECT = Path(__file__).resolve().parent.parent
COMMAND = "python -m scripts.declared_headers"
LOCK = PROJECT / "inventory" / LOCK_NAME
SEED = PROJECT / "inventory" / "example-5080-3090.yml"
QWEN36_27B_SOURCE = (
    "Qwen/Qwen3.6-27B's model card and config.json (https://huggingface.co/Qwen/Qwen3.6-27B): "
    "64 layers as 16 x (3 Gated DeltaNet + 1 gated attention), hidden 5120, FFN 17408, vocab "
    "248320, attention 24 Q / 4 KV heads of 256, DeltaNet 16 QK / 48 V heads of 128, context "
    "262144, one MTP layer; Q8_0 weights with f32 norms, as llama.cpp's qwen35 loader reads them"
)


def declarations() -> list[tuple[str, object, str]]:
    """(the model's URL, its declared header, where the header's values come from)."""
    url = load_inventory(SEED).hosts["rig1"].data["model"]["url"]
    with tempfile.TemporaryDirectory() as scratch:
        path = write_qwen35(Path(scratch) / "qwen36-27b-q8_0.gguf", Qwen35Shape(), "q8_0")
        header = read_gguf_header_file(path)
    return [(url, header, QWEN36_27B_SOURCE)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the lock is stale")
    args = parser.parse_args()
    stale = []
    for url, header, source in declarations():
        recorded = recorded_header(LOCK, {"url": url})
        entry = header_entry(LOCK, {"url": url}) or {}
        if (
            recorded is None
            or (recorded.metadata, recorded.tensors) != (header.metadata, header.tensors)
            or entry.get("size") != header.data_end
        ):
            stale.append(url)
            if not args.check:
                declare_header(LOCK, url, header, source)
    if args.check and stale:
        print(f"{LOCK}: stale declared headers: {', '.join(stale)}; run {COMMAND}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
