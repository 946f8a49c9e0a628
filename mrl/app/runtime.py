"""What every algorithm loop runs on: the model folder, the Ray cluster, the policy group and the rollout engine.

The loops (mrl/algorithms) receive a `Runtime` as their `Workers` and never touch Ray, ranks or devices themselves.

Model source (`policy.*`):
- `policy.build`: a randomly initialised model of the given size is written once, as an HF folder with the task's
  tokenizer (the arithmetic character tokenizer when `data.arith` is set), to `<run.output_dir>/initial_model`;
- `policy.model_name`: an HF folder (config.json + safetensors + tokenizer), e.g. the previous stage's export.
Both the policy (Megatron) and the engine (vLLM) start from that folder, so they start from the same weights.

Placement: `cluster.num_nodes x cluster.devices_per_node` bundles. Colocated (the default): the policy's ranks and
the engines share the bundles, each taking half of a bundle's resources; the engine gets the policy's weights by
refit after every step (mrl/inference/refit.py), as shared-memory files written by the policy's rank 0 (on GPUs:
device buffers the engine maps by CUDA IPC). An engine
on devices of its own (`generation.colocated: false`) receives them by broadcast in a group of the policy's rank 0
and the engines, made on the first refit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from mrl.config.schema import ModelBuildConfig, MrlConfig
from mrl.distributed import Placement, RayCluster
from mrl.inference.interface import RolloutEngine
from mrl.inference.refit import RefitStats, refit
from mrl.inference.transports import (CollectiveTransport, CudaIpcTransport, SharedMemoryFileTransport, WeightTransport,
                                     collective)
from mrl.policy.interface import TrainablePolicy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

INITIAL_MODEL_DIR = "initial_model"


def _build_tokenizer(cfg: MrlConfig, out: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    if cfg.data.arith is not None:
        from mrl.data.arith import build_arith_tokenizer

        tokenizer = build_arith_tokenizer()
        tokenizer.save_pretrained(out)
        return tokenizer
    from mrl.data.tokenizers import build_tokenizer

    build_tokenizer(out)
    return PreTrainedTokenizerFast.from_pretrained(out)


def _family_settings(build: ModelBuildConfig) -> dict[str, Any]:
    """Config keys a family adds to the shared ones."""
    if build.family == "qwen2":
        return {"use_sliding_window": False}
    if build.family == "qwen3_moe":
        return {"num_experts": build.num_experts, "num_experts_per_tok": build.num_experts_per_tok,
                "moe_intermediate_size": build.moe_intermediate_size, "norm_topk_prob": True}
    return {}


def build_initial_model(cfg: MrlConfig, build: ModelBuildConfig, out: Path) -> Path:
    """Write a random-init HF model of `build`'s size (transformers' default init, seeded by run.seed) to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out  # written by an earlier (interrupted or resumed) run with the same config
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(cfg, out)
    config = AutoConfig.for_model(
        build.family, vocab_size=len(tokenizer), hidden_size=build.hidden_size,
        intermediate_size=build.intermediate_size, num_hidden_layers=build.num_layers,
        num_attention_heads=build.num_attention_heads,
        num_key_value_heads=build.num_key_value_heads or build.num_attention_heads,
        head_dim=build.hidden_size // build.num_attention_heads,
        max_position_embeddings=max(64, cfg.policy.max_total_sequence_length),
        tie_word_embeddings=build.tie_word_embeddings, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32",
        **_family_settings(build))
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_logging.disable_progress_bar()  # one tiny shard: a progress bar would be noise
    try:
        model.save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out


def resolve_model_dir(cfg: MrlConfig) -> Path:
    """The HF folder the run starts from (see the module docstring)."""
    if cfg.policy.build is not None:
        return build_initial_model(cfg, cfg.policy.build, Path(cfg.run.output_dir) / INITIAL_MODEL_DIR)
    if not cfg.policy.model_name:
        raise ValueError("set policy.model_name (an HF model folder) or policy.build (a random model of a given size)")
    path = Path(cfg.policy.model_name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"policy.model_name={cfg.policy.model_name}: no config.json there. mrl loads HF folders from disk (hub "
            "downloads are not done at run time); convert a training checkpoint with `mrl convert megatron-to-hf "
            "--checkpoint DIR --out HF_DIR` first")
    return path


def load_tokenizer(cfg: MrlConfig, model_dir: Path) -> "PreTrainedTokenizerBase":
    from mrl.data.tokenizers import load_tokenizer as load

    return load(cfg.policy.tokenizer or model_dir)


@dataclass
class Runtime:
    """The started workers of one run; `shutdown()` stops them all (also after a failure). A command starts only
    the parts it needs: `policy` is None for `mrl eval`, `engine` for `mrl sft` and `mrl score`."""

    cfg: MrlConfig
    model_dir: Path
    tokenizer: "PreTrainedTokenizerBase"
    cluster: RayCluster
    placement: Optional[Placement] = None
    policy: Optional[TrainablePolicy] = None
    engine: Optional[RolloutEngine] = None
    reward_model: Optional[Any] = None  # a frozen reward model's worker group (env.reward_model), on the same bundles
    _broadcast: Optional[CollectiveTransport] = None
    _local: Optional[WeightTransport] = None

    def refit(self) -> RefitStats:
        """Stream the policy's weights into the engine (see the module docstring for the transport)."""
        assert self.policy is not None and self.engine is not None, "refit needs a policy and an engine"
        return refit(self.policy, self.engine, self._transport(), bucket_bytes=self.cfg.generation.refit_bucket_mb << 20)

    def _transport(self) -> WeightTransport:
        if self.cfg.generation.colocated or self.cfg.generation.backend != "vllm":
            if self._local is None:  # one object for the run: a CUDA IPC sender keeps its buffers under its name
                import torch

                cuda = torch.cuda.is_available() and self.cfg.generation.backend == "vllm"
                self._local = CudaIpcTransport() if cuda else SharedMemoryFileTransport()
            return self._local
        if self._broadcast is None:
            self._broadcast = collective.connect(self.policy, self.engine)  # type: ignore[arg-type]
        return self._broadcast

    def shutdown(self) -> None:
        for part in (self.engine, self.reward_model, self.policy):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as error:  # noqa: BLE001 -- keep shutting the rest down
                    log.warning("shutdown: %s", error)
        self.cluster.shutdown()


def start_runtime(cfg: MrlConfig, *, total_steps: int, policy: bool = True, engine: bool = True,
                  reference: bool = False, padded_vocab: Optional[int] = None,
                  model_dir: Optional[Path] = None) -> Runtime:
    """Start Ray, reserve the bundles, then the policy group and/or the engines (see the module docstring).
    `model_dir` replaces the configured model folder (a reward model's variant of it, `mrl rm`)."""
    model_dir = model_dir or resolve_model_dir(cfg)
    tokenizer = load_tokenizer(cfg, model_dir)
    cluster = RayCluster.from_config(cfg.cluster)
    runtime = Runtime(cfg, model_dir, tokenizer, cluster)
    try:
        runtime.placement = cluster.create_placement(
            f"{cfg.run.name}-workers", bundles_per_node=cfg.cluster.devices_per_node, num_nodes=cfg.cluster.num_nodes,
            cpus_per_bundle=cfg.cluster.cpus_per_worker)
        from mrl.policy.group import Policy
        from mrl.policy.worker import PolicySpec

        scorer = cfg.env.reward_model if policy and engine else None
        sharing = 1 + (engine and cfg.generation.colocated) + (scorer is not None)  # groups on one bundle
        if policy:
            spec = PolicySpec(hf_dir=str(model_dir), policy=cfg.policy, seed=cfg.run.seed, total_steps=total_steps,
                              with_reference=reference, padded_vocab=padded_vocab)
            runtime.policy = Policy(spec, runtime.placement, world_size=cfg.policy_world_size,
                                    resource_fraction=1.0 / sharing, omp_num_threads=cfg.cluster.omp_num_threads)
        if scorer is not None:
            runtime.reward_model = Policy(
                PolicySpec(hf_dir=scorer.model, policy=cfg.policy, seed=cfg.run.seed, total_steps=1, trainable=False),
                runtime.placement, world_size=cfg.policy_world_size, resource_fraction=1.0 / sharing,
                omp_num_threads=cfg.cluster.omp_num_threads, name="reward_model")
        if engine:  # vLLM engines in Ray actors on the placement, or the Megatron engine in this (driver) process
            from mrl.inference.factory import build_generation

            runtime.engine = build_generation(cfg, str(model_dir), runtime.placement, colocated_share=1.0 / sharing)
    except BaseException:
        runtime.shutdown()
        raise
    return runtime

