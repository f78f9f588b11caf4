"""Where llama.cpp puts each block and tensor: `-ngl` and the `-ts` split in layer mode, whole
units per device in tensor mode (see llamarig.memory)."""

import bisect
import math
import re
from collections.abc import Sequence

from llamarig.gguf_header import GgufHeader, ggml_type
from llamarig.memory.sizes import ON_HOST, TENSOR_SPLIT_FFN_BLOCK, Layers, SplitMode

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")
_ATTENTION_SPLIT = re.compile(
    r"attn_(q|k|v|qkv)\.(weight|bias)|attn_output\.weight|attn_gate\.weight|attn_sinks\.weight"
)
_RECURRENT_SPLIT = re.compile(
    r"(attn_qkv|attn_gate|ssm_conv1d|ssm_out|ssm_ba|ssm_alpha|ssm_beta)\.weight|ssm_dt\.bias|ssm_a"
)
_FFN_SPLIT = re.compile(r"ffn_(up|gate|down|gate_up)(_exps|_shexp)?\.weight")


# --- placement -------------------------------------------------------------------------------


def split_units(units: int, ratio: Sequence[float], rotation: int) -> list[int]:
    """Whole units per device, as llama_meta_device_get_split_state rounds a tensor-mode split.

    Split points are the cumulative ratio (rotated by ``rotation`` devices, so that rounding
    alternates between layers) rounded down; the last device in rotated order takes the rest.
    """
    n = len(ratio)
    rotated = [ratio[(j + rotation) % n] for j in range(n)]
    total = sum(rotated)
    shares = [0] * n
    low, cumulative = 0, 0.0
    for j in range(n - 1):
        cumulative += rotated[j]
        high = units * (j + 1) // n if total == 0 else int(units * cumulative / total)
        shares[(j + rotation) % n] = high - low
        low = high
    shares[(n - 1 + rotation) % n] = units - low
    return shares


def first_offloaded(n_layer_all: int, n_gpu_layers: int | None) -> int:
    """The first block on a GPU (load_tensors' i_gpu_start): `-ngl N` offloads the last N of
    the blocks and the output layer (block ``n_layer_all``); the ones before stay on the host.
    None: all of them (`-ngl all`)."""
    if n_gpu_layers is None:
        return 0
    return max(n_layer_all + 1 - n_gpu_layers, 0)


def layer_devices(
    n_layer_all: int, ratio: Sequence[float], n_gpu_layers: int | None = None
) -> list[int]:
    """Device of each block and, last, of the output layer in layer mode (load_tensors);
    ON_HOST for a block `-ngl` leaves on the host."""
    total = sum(ratio)
    splits, cumulative = [], 0.0
    for r in ratio:
        cumulative += r
        splits.append(cumulative / total)
    start = first_offloaded(n_layer_all, n_gpu_layers)
    n_offloaded = n_layer_all + 1 - start
    return [
        ON_HOST
        if il < start
        else min(bisect.bisect_right(splits, (il - start) / n_offloaded), len(ratio) - 1)
        for il in range(n_layer_all + 1)
    ]


class Placement:
    """Bytes per device by kind, and the weights kept on the host."""

    def __init__(self, n_devices: int) -> None:
        self.weights = [0.0] * n_devices
        self.kv = [0.0] * n_devices
        self.state = [0.0] * n_devices
        self.compute = [0.0] * n_devices
        self.host_weights = 0


class Placer:
    def __init__(
        self,
        header: GgufHeader,
        layers: Layers,
        mode: SplitMode,
        ratio: Sequence[float],
        n_gpu_layers: int | None = None,
    ):
        self.header, self.layers, self.mode, self.ratio = header, layers, mode, list(ratio)
        self.n = len(ratio)
        self.gpu_start = first_offloaded(layers.n_all, n_gpu_layers)
        self.block_device = (
            layer_devices(layers.n_all, ratio, n_gpu_layers) if mode == "layer" else []
        )
        # get_il_eff: a block's rotation counts only earlier blocks of its own kind
        self.block_rotation = []
        seen = {True: 0, False: 0}
        for recurrent in layers.recurrent:
            self.block_rotation.append(seen[recurrent] % self.n)
            seen[recurrent] += 1

    def on_host(self, layer: int | None) -> bool:
        """Whether `-ngl` leaves block ``layer`` (None: the output layer) on the host."""
        return (self.layers.n_all if layer is None else layer) < self.gpu_start

    def rotation(self, layer: int | None) -> int:
        return self.layers.n_main % self.n if layer is None else self.block_rotation[layer]

    def place(self, target: list[float], n_bytes: int, layer: int | None, units: int) -> None:
        """Put ``n_bytes`` of block ``layer`` (None: the output layer) on the devices.

        ``units`` is how many whole slices tensor mode may cut it into; 0 mirrors it.
        """
        if self.mode == "none":
            target[0] += n_bytes
        elif self.mode == "layer":
            index = self.layers.n_all if layer is None else layer
            target[self.block_device[index]] += n_bytes
        elif units == 0:
            for d in range(self.n):
                target[d] += n_bytes
        else:
            for d, share in enumerate(split_units(units, self.ratio, self.rotation(layer))):
                target[d] += n_bytes * share / units


def _tensor_units(
    header: GgufHeader, layers: Layers, name: str, shape: tuple[int, ...], type_id: int
) -> tuple[int | None, int]:
    """(block or None for the output layer, tensor-mode units; 0 = mirrored)."""
    match = _BLOCK.match(name)
    if match is None:
        return None, shape[1] if name == "output.weight" else 0
    layer, rest = int(match.group(1)), match.group(2)
    if layers.recurrent[layer] and _RECURRENT_SPLIT.fullmatch(rest):
        return layer, max(header.ssm_group_count, 1)
    if not layers.recurrent[layer] and _ATTENTION_SPLIT.fullmatch(rest):
        return layer, max(header.head_count_kv_at(layer), 1)
    ffn = _FFN_SPLIT.fullmatch(rest)
    if ffn:
        rows = shape[0] if ffn.group(1) == "down" else shape[1]
        if ffn.group(1) == "gate_up":
            rows //= 2
        granularity = math.lcm(ggml_type(type_id).block_size, TENSOR_SPLIT_FFN_BLOCK)
        return layer, max(rows // granularity, 1)
    return layer, 0


def place_weights(placer: Placer, placement: Placement, mtp_loaded: bool) -> None:
    header, layers = placer.header, placer.layers
    tied = header.tensor("output.weight") is None
    for t in header.tensors:
        if t.name == "token_embd.weight":
            placement.host_weights += t.n_bytes
            if tied and placer.on_host(None):
                placement.host_weights += t.n_bytes
            elif tied:  # the output layer gets its own copy (TENSOR_DUPLICATED)
                placer.place(placement.weights, t.n_bytes, None, t.shape[1])
            continue
        layer, units = _tensor_units(header, layers, t.name, t.shape, t.ggml_type)
        if layer is not None and layer >= layers.n_main and not mtp_loaded:
            continue  # MTP blocks are skipped unless a draft-mtp context loads them
        if placer.on_host(layer):
            placement.host_weights += t.n_bytes
        else:
            placer.place(placement.weights, t.n_bytes, layer, units)
