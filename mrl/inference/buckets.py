"""Group Hugging Face-named tensors into bounded buckets that never split a layer.

Why whole layers: vLLM's layerwise `reload_weights` moves every module of the model to the meta device at the start
of a call and rebuilds a module once all of its elements arrived. A module that gets nothing in a call keeps its old
weights (so buckets compose: reloading layer 0, then the rest, equals one full reload -- measured), but a module
that gets only part of its inputs in a call is rebuilt with the missing part uninitialised. vLLM fuses HF tensors
into one module (q/k/v -> qkv_proj, gate/up -> gate_up_proj, weights with their biases), so the unit that is safe
to cut between calls is the transformer layer (`model.layers.<i>`), or a top-level module (embeddings, final norm,
lm_head). Peak extra memory of a refit is then one bucket, or one layer if a layer alone exceeds the bucket size.
"""

from __future__ import annotations

import re
from collections.abc import ItemsView, Iterable, Iterator, Mapping

import torch

NamedTensor = tuple[str, torch.Tensor]

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_key(name: str) -> str:
    """The unit a tensor belongs to: `model.layers.3.mlp.up_proj.weight` -> `model.layers.3`;
    a tensor outside the layer stack is its own unit's module (`model.embed_tokens.weight` -> `model.embed_tokens`)."""
    match = _LAYER.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _layers(named_tensors: Iterable[NamedTensor]) -> Iterator[list[NamedTensor]]:
    """Runs of consecutive tensors with the same layer key; a key seen again after its run ended is an error."""
    finished: set[str] = set()
    run: list[NamedTensor] = []
    key = None
    for name, tensor in named_tensors:
        this = layer_key(name)
        if this != key:
            if run:
                yield run
                finished.add(key)  # type: ignore[arg-type]
            if this in finished:
                raise ValueError(
                    f"tensor {name!r} of {this!r} arrives after other layers' tensors: the exporter must yield each "
                    f"layer's tensors together, or a refit bucket would carry a partial layer"
                )
            run, key = [], this
        run.append((name, tensor))
    if run:
        yield run


def _in_layer_order(named_tensors: Mapping[str, torch.Tensor] | ItemsView) -> list[NamedTensor]:
    """An in-memory state dict in any order (e.g. read from safetensors) regrouped layer by layer, layers in order of
    first appearance."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    by_layer: dict[str, list[NamedTensor]] = {}
    for name, tensor in items:
        by_layer.setdefault(layer_key(name), []).append((name, tensor))
    return [item for layer in by_layer.values() for item in layer]


def iter_buckets(
    named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor], bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """Yield lists of (name, tensor) of at most `bucket_bytes` each, made of whole layers, in input order.

    A layer larger than `bucket_bytes` forms a bucket alone. A stream (iterator) is consumed lazily, at most one
    bucket plus one layer held at a time, and must yield each layer's tensors together; a state dict or its
    `.items()` is already in memory and may come in any order (it is regrouped by layer first).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    if isinstance(named_tensors, (Mapping, ItemsView)):
        named_tensors = _in_layer_order(named_tensors)
    bucket: list[NamedTensor] = []
    size = 0
    for layer in _layers(named_tensors):
        layer_size = sum(tensor_bytes(t) for _, t in layer)
        if bucket and size + layer_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer)
        size += layer_size
    if bucket:
        yield bucket


# --------------------------------------------------------------------------------------------- one flat buffer
#: Every tensor of a flat bucket starts at a multiple of this many bytes, so a receiver can view it in place.
FLAT_ALIGN = 16
#: One tensor of a flat bucket: [name, dtype name ("float32"), shape, byte offset, bytes]: plain JSON/msgpack data.
FlatEntry = list


def flat_layout(bucket: list[NamedTensor]) -> tuple[list[FlatEntry], int]:
    """Where each tensor of `bucket` goes in one byte buffer (offsets aligned to FLAT_ALIGN), and the buffer's size."""
    header, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // FLAT_ALIGN) * FLAT_ALIGN
        size = tensor_bytes(tensor)
        header.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, size])
        offset += size
    return header, offset


def pack_flat(bucket: list[NamedTensor], header: list[FlatEntry], buffer: torch.Tensor) -> None:
    """Copy the bucket's bytes into `buffer` (uint8, at least the layout's size, on any device) at the header's
    offsets."""
    for (_, tensor), (_, _, _, start, size) in zip(bucket, header):
        buffer[start:start + size] = tensor.detach().contiguous().view(-1).view(torch.uint8)


def flat_views(buffer: torch.Tensor, header: list[FlatEntry]) -> list[NamedTensor]:
    """The bucket's tensors as views of `buffer` (no copy): the receiving side of `pack_flat`."""
    return [(name, buffer[start:start + size].view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, start, size in header]
