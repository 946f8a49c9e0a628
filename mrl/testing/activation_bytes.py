"""The bytes autograd keeps for the backward in one forward pass of megatron-core's own model: the measurement
`mrl plan`'s activation estimate (mrl/app/plan_activations.py, kernels "local") is checked against, on CPU (the unit
test) and on CUDA without Transformer Engine (the GPU tier).

Every tensor autograd saves goes through `torch.autograd.graph.saved_tensors_hooks`; each storage is counted once
(views of one storage are one tensor in memory), the parameters' are not (weights are not activations). On CUDA the
caching allocator's own figure is taken too: what `torch.cuda.memory_allocated` grew by over the forward, less the
output, which includes the allocator's rounding and anything the hooks do not see. The model is one rank of a TP
layout over torch's fake process group (mrl.parallel.groups.init_fake_process_groups: collectives do nothing, so
the values are not a TP run's, but every tensor has the shape it has on that rank), built without its output layer:
the decoder's activations alone.
"""

from __future__ import annotations

from typing import Any, Mapping


def saved_activation_bytes(
    hf_config: Mapping[str, Any],
    *,
    tokens: int,
    sequences: int = 1,
    tp: int = 1,
    recompute: bool = False,
    seed: int = 0,
) -> int:
    """Bytes saved for the backward by one bf16 forward on CPU of a micro-batch of `sequences` sequences of `tokens`
    tokens in all, on TP rank 0 of `tp` (sequence parallel when tp > 1), with or without full recompute of every
    layer."""
    return activation_bytes(hf_config, tokens=tokens, sequences=sequences, tp=tp, recompute=recompute, seed=seed)[
        "saved"
    ]


def activation_bytes(
    hf_config: Mapping[str, Any],
    *,
    tokens: int,
    sequences: int = 1,
    tp: int = 1,
    recompute: bool = False,
    seed: int = 0,
    device: str = "cpu",
    compiled_fusions: bool = False,
) -> dict[str, int]:
    """{"saved": the bytes of the tensors saved for the backward} of that forward on `device`, and on CUDA
    {"allocated": what the allocator holds after it above before, less the output}; megatron-core's unfused SwiGLU
    and RoPE unless `compiled_fusions` (`transformer_config_from_hf`)."""
    import torch

    from mrl.model.build import build_model, transformer_config_from_hf
    from mrl.parallel.groups import destroy_process_groups, init_fake_process_groups

    init_fake_process_groups(tp, 0, tp=tp)
    try:
        recompute_kwargs: dict[str, Any] = (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        )
        config = transformer_config_from_hf(
            dict(hf_config),
            tensor_parallel=tp,
            sequence_parallel=tp > 1,
            params_dtype=torch.bfloat16,
            compiled_fusions=compiled_fusions,
            **recompute_kwargs,
        )
        model = build_model(dict(hf_config), config, post_process=False).to(device)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        generator = torch.Generator().manual_seed(seed)
        length = tokens // sequences
        ids = torch.randint(0, int(hf_config["vocab_size"]), (sequences, length), generator=generator).to(device)
        positions = torch.arange(length, device=device).expand(sequences, length)
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = model(ids, positions, None)
        measured = {"saved": sum(saved.values())}
        if cuda:
            torch.cuda.synchronize()
            measured["allocated"] = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
        del out
        return measured
    finally:
        destroy_process_groups()
