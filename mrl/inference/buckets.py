"""Group Hugging Face-named tensors into bounded buckets: whole layers, or (`split_layers=True`) cut inside a layer.

Why whole layers by default: mrl loads a bucket with one `Worker.reload_weights(..., is_checkpoint_format=True)`
call (mrl/inference/vllm_extension.py), and vLLM 0.32 opens and closes a layerwise reload session in every call
(vllm/model_executor/model_loader/reload/inplace.py:92-96: initialize_layerwise_reload, model.load_weights,
finalize_layerwise_reload). The session moves every module to the meta device and rebuilds a module once all of its
elements arrived (reload/layerwise.py:217-219). At the end of a call, a module that got nothing keeps its old weights
(layerwise.py:256-267: so buckets compose: reloading layer 0, then the rest, equals one full reload -- measured), but
a module that got only part of its elements is processed anyway ("Delayed processing", layerwise.py:273-275) from
fresh uninitialised storage (reload/meta.py:53 torch.empty_strided): the missing part becomes garbage. vLLM fuses HF
tensors into one module (q/k/v -> qkv_proj, gate/up -> gate_up_proj, all routed experts of a layer -> one FusedMoE
`mlp.experts`, weights with their biases), so with one call per bucket the unit that is safe to cut between calls is
the transformer layer (`model.layers.<i>`), or a top-level module (embeddings, final norm, lm_head). Peak extra
memory of a refit is then one bucket, or one layer if a layer alone exceeds the bucket size (a DeepSeek-V3 MoE layer:
~22.5 GB in bf16).

Cut inside a layer (`split_layers=True`; the policy's exporter: mrl.policy.export.plan_buckets(split_units=True)):
buckets of at most `bucket_bytes` whatever the layer size (a single tensor larger than that alone), which is only
correct when the receiver keeps ONE layerwise session over all the buckets of a refit, as vLLM's chunked weight
transfer does (vllm/distributed/weight_transfer/nccl_engine.py:159-173, ipc_engine.py:160-174:
initialize_layerwise_reload in start_weight_update, model.load_weights per chunk (nccl_engine.py:227,
ipc_engine.py:245), finalize_layerwise_reload in finish_weight_update): the per-module count of loaded elements
(`LayerReloadingInfo.load_numel`, reload/types.py) then carries over from chunk to chunk and a module is processed
when its last tensor arrives, in whichever chunk. Until then vLLM keeps a reference to every tensor it was given for
that module (layerwise.py:185, the checkpoint tensor before any TP narrowing): a receiver must not reuse or free a
buffer whose views it passed while a module they fed is incomplete (copy them out, or keep the buffer), and holds up
to one module's checkpoint tensors (a layer's routed experts) until the module is processed.
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
                assert key is not None  # the key of the run just yielded
                finished.add(key)
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
    named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
    bucket_bytes: int,
    *,
    split_layers: bool = False,
) -> Iterator[list[NamedTensor]]:
    """Yield lists of (name, tensor) of at most `bucket_bytes` each, in input order.

    Default: buckets of whole layers; a layer larger than `bucket_bytes` forms a bucket alone. A stream (iterator)
    is consumed lazily, at most one bucket plus one layer held at a time, and must yield each layer's tensors
    together; a state dict or its `.items()` is already in memory and may come in any order (it is regrouped by
    layer first).
    `split_layers=True`: tensors packed in order, a bucket closed when the next tensor would not fit, so a layer
    may be cut anywhere between its tensors and a bucket exceeds the bound only when it is a single larger tensor;
    a stream is consumed one bucket plus one tensor at a time. The receiver must keep one layerwise reload session
    over the buckets (module docstring).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    if isinstance(named_tensors, (Mapping, ItemsView)):
        named_tensors = _in_layer_order(named_tensors)
    runs = ([item] for item in named_tensors) if split_layers else _layers(named_tensors)
    bucket: list[NamedTensor] = []
    size = 0
    for run in runs:
        run_size = sum(tensor_bytes(t) for _, t in run)
        if bucket and size + run_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(run)
        size += run_size
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
        buffer[start : start + size] = tensor.detach().contiguous().view(-1).view(torch.uint8)


def flat_views(buffer: torch.Tensor, header: list[FlatEntry]) -> list[NamedTensor]:
    """The bucket's tensors as views of `buffer` (no copy): the receiving side of `pack_flat`."""
    return [
        (name, buffer[start : start + size].view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, start, size in header
    ]
