"""Rotary embeddings as kernels torch.compile generates, where Transformer Engine's are missing
(`policy.speed.compiled_fusions`).

With `apply_rope_fusion` set, megatron-core's `rope_utils.apply_rotary_pos_emb` calls two module globals,
`fused_apply_rotary_pos_emb` (bshd) and `fused_apply_rotary_pos_emb_thd` (packed), which it imports from Transformer
Engine and leaves None without it (its TransformerConfig then refuses the flag). Without them every call runs the
unfused arithmetic, each step its own elementwise pass over q or k (cos, sin, two products, the rotated half's
negation and concatenation, a sum, a final concatenation), forward and backward. `provide_rope_kernels` fills the
two globals, only where they are None, with the same arithmetic compiled by torch.compile into one kernel forward
and one backward (Triton on CUDA). SwiGLU needs nothing here: megatron-core's `bias_activation_fusion` path runs
its own `swiglu` / `swiglu_back`, which its `jit_fuser` compiles with torch.compile.

What the kernels compute is megatron-core 0.19.2's unfused path (`_apply_rotary_pos_emb_bshd`), not Transformer
Engine's: run eagerly, the result is the same to the bit.
- bshd: t [s, b, h, d], freqs [s, 1, 1, d'] (d' <= d): the first d' channels rotate by halves, the rest pass.
- thd: t [T, h, d] packed by cu_seqlens [n + 1]; freqs is a table indexed by each token's position within its own
  sequence or, when it holds one row per packed token, those rows in order (megatron-core's branch for per-token
  frequencies, which its dynamic inference engine passes).
Interleaved rotation goes to megatron-core's unfused code. Context parallelism and multi-latent attention are not
covered (their rotations slice or scale differently): `mrl.model.build` sets `apply_rope_fusion` without them only.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from mrl.cpu.megatron_speed import frequencies_per_token

log = logging.getLogger(__name__)
_compiled: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None


def rotate(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron-core's unfused rotation (`_apply_rotary_pos_emb_bshd`, halves, mscale 1), as one function to compile:
    t [..., d], freqs broadcasting to t's leading dims, [..., d'] fp32 angles."""
    rot_dim = freqs.shape[-1]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1)


def _rotate_compiled() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`rotate` through torch.compile, made on first use (compiling happens at the first call of each grad mode;
    dynamic shapes: the packed lengths and head counts vary without recompiling). Not `fullgraph`: with torch's
    own switch `TORCH_COMPILE_DISABLE=1` it then runs as written instead of failing."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(rotate, dynamic=True)
    return _compiled


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Stands for Transformer Engine's `fused_apply_rotary_pos_emb` as megatron-core calls it: `(t, freqs,
    interleaved=...)`."""
    if interleaved:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    return _rotate_compiled()(t, freqs)


def rope_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """Stands for Transformer Engine's `fused_apply_rotary_pos_emb_thd` without context parallelism: each packed
    token rotated by its position within its own sequence (the positions computed on the device)."""
    if cp_size != 1:
        raise NotImplementedError(
            f"mrl's compiled packed RoPE has no context parallelism (context_parallel_size={cp_size}); "
            "mrl.model.build sets apply_rope_fusion only without it"
        )
    freqs = frequencies_per_token(freqs, cu_seqlens, t.shape[0])
    return rope_bshd(t.unsqueeze(1), freqs, interleaved=interleaved).squeeze(1)


@functools.cache
def inductor_works() -> bool:
    """Whether torch.compile's default backend (inductor) generates and runs a kernel on this process's CUDA device:
    `auto` asks it once, so a machine without Triton or a C compiler runs unfused rather than failing in its first
    step (the log says why)."""
    try:
        x = torch.arange(8.0, device=torch.device("cuda", torch.cuda.current_device()))
        return bool(torch.equal(torch.compile(lambda t: t * 2 + 1, dynamic=False)(x), x * 2 + 1))
    except Exception as err:  # noqa: BLE001 - any failure of the compiler means: do not use it
        log.warning(
            "torch.compile fails on this GPU (%s: %s); policy.speed.compiled_fusions=auto leaves SwiGLU and RoPE "
            "unfused",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return False


def provide_rope_kernels() -> bool:
    """Fill megatron-core's missing fused-RoPE globals with `rope_bshd` / `rope_thd`; True where both are set after
    the call (mrl's, or Transformer Engine's where it is installed but a model is built without it: LoRA's local
    linears). Idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
    return rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None
