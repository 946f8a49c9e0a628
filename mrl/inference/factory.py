"""From the typed config tree to a generation backend: the only place that reads `generation.*` for the engines.

    cfg.generation + cfg.grpo/eval + run.seed  -> SamplingConfig       (training: the seed moves with the step;
                                                                         evaluation: eval.num_samples/temperature)
    cfg.generation.vllm + cfg.policy + cfg.run -> VllmEngineConfig     (one per engine)
    cluster size / tensor parallel size        -> number of engines (generation data-parallel size)
    cfg.generation.backend                     -> build_generation: vLLM engines, or one Megatron engine in-process

Refit transport (chosen by `mrl.app.runtime.Runtime.refit`): colocated engines get each bucket as a shared-memory
file written by the policy's rank 0; non-colocated engines (their own bundles, possibly other nodes) receive it by
broadcast in a group of the policy's rank 0 and the engines (mrl/inference/transports/collective.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

from mrl.inference.interface import SamplingConfig

if TYPE_CHECKING:
    from mrl.config.schema import MrlConfig
    from mrl.inference.interface import RolloutEngine
    from mrl.inference.megatron_backend import MegatronEngineConfig
    from mrl.inference.vllm_backend import VllmEngineConfig
    from mrl.inference.vllm_worker import VllmEngineGroup

#: Seeds of consecutive steps are this far apart, more than the samples of any step (prompt i, sample k of a step
#: use seed + i * n + k), so no two samples of a run share a seed.
STEP_SEED_STRIDE = 10_000_019


#: Seed offset of evaluation sampling (apart from every training step's seeds).
EVAL_SEED_OFFSET = 7


def sampling_config(
    cfg: "MrlConfig", step: int = 0, *, purpose: Literal["train", "eval"] = "train", turn_end_id: Optional[int] = None
) -> SamplingConfig:
    """How the engine samples: for GRPO step `step` (n = grpo.num_generations_per_prompt, generation.temperature),
    or for evaluation (n = eval.num_samples, eval.temperature). Every other setting (top-p/k, stop tokens and
    strings, length, overlong prompts) is generation.*'s in both, so validation sees what training sees.
    `turn_end_id` (the prompt template's end of an assistant turn) is a stop token besides EOS."""
    gen = cfg.generation
    stops = [*gen.stop_token_ids, *([turn_end_id] if turn_end_id is not None else [])]
    if purpose == "eval":
        n, temperature, seed = cfg.eval.num_samples, cfg.eval.temperature, cfg.run.seed + EVAL_SEED_OFFSET
    else:
        n, temperature = cfg.grpo.num_generations_per_prompt, gen.temperature
        seed = cfg.run.seed + step * STEP_SEED_STRIDE
    return SamplingConfig(
        n=n,
        temperature=temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_new_tokens=gen.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys(stops)),
        stop_strings=tuple(gen.stop_strings),
        seed=seed,
        overlong_prompt=gen.overlong_prompt,
    )


def engine_world_size(cfg: "MrlConfig") -> int:
    """GPUs (vLLM workers) of one engine: its tensor parallel size x its pipeline stages."""
    return cfg.generation.vllm.tensor_parallel_size * cfg.generation.vllm.pipeline_parallel_size


def num_generation_engines(cfg: "MrlConfig") -> int:
    """Generation data-parallel size: the engines' devices divided by each engine's workers (TP x PP)."""
    gen = cfg.generation
    devices = cfg.policy_world_size if gen.colocated or gen.num_devices is None else gen.num_devices
    size = engine_world_size(cfg)
    if devices % size:
        raise ValueError(
            f"generation.vllm.tensor_parallel_size x pipeline_parallel_size = {size} does not divide the {devices} "
            "devices of the engines; pick a divisor"
        )
    return devices // size


def engine_spans_nodes(cfg: "MrlConfig") -> bool:
    """On GPUs, whether one engine needs more GPUs than a node has (its pipeline stages on several nodes)."""
    return engine_world_size(cfg) > cfg.cluster.devices_per_node


@dataclass(frozen=True)
class EngineSeats:
    """Where the engines sit on a placement (global bundle indices)."""

    actors: tuple[int, ...]
    """Engine e's actor: on this bundle."""
    workers: tuple[tuple[int, ...], ...]
    """GPUs, more than one worker: engine e's TP x PP vLLM workers, on these bundles in vLLM's rank order (stage by
    stage); empty otherwise."""
    share: float
    """The part of each bundle the engine takes (colocated: shared with the policy)."""


def engine_seats(cfg: "MrlConfig", placement: Any, *, colocated_share: float = 0.5) -> EngineSeats:
    """One engine per generation data-parallel rank. Colocated engines take the policy's bundles from the first;
    others the bundles after the policy's ranks. On GPUs an engine of TP k x PP s spans k x s consecutive bundles:
    each pipeline stage's k on one node (a tensor-parallel group all-reduces every layer), the stages on one node or
    several, all in one placement group (vLLM's Ray executor places an engine's workers in the group its actor runs
    in: `mrl.app.runtime.reserve_placement` makes one group of the whole cluster when an engine spans nodes). On CPU
    each engine is one bundle (its workers are its processes)."""
    engines, tp = num_generation_engines(cfg), cfg.generation.vllm.tensor_parallel_size
    span = engine_world_size(cfg) if placement.on_gpus else 1
    first = 0 if cfg.generation.colocated else cfg.policy_world_size
    if placement.num_bundles < first + engines * span:
        after = f" after {first} policy ranks" if first else ""
        raise ValueError(
            f"{engines} generation engines of {span} bundle(s){after} need {first + engines * span} "
            f"bundles, placement '{placement.name}' has {placement.num_bundles}: raise "
            "cluster.devices_per_node or cluster.num_nodes"
        )
    actors = tuple(first + e * span for e in range(engines))
    workers = tuple(tuple(range(a, a + span)) for a in actors) if span > 1 else ()
    for bundles in workers:
        _check_engine_bundles(cfg, placement, bundles, tp)
    return EngineSeats(actors, workers, colocated_share if cfg.generation.colocated else 1.0)


def _check_engine_bundles(cfg: "MrlConfig", placement: Any, bundles: tuple[int, ...], tp: int) -> None:
    """One engine's worker bundles: each stage's tensor-parallel group on one node, all in one placement group, and
    across nodes only colocated (a non-colocated engine's actor receives each bucket and hands it to its workers by
    CUDA IPC, which reaches its own node's GPUs only)."""
    stages = [bundles[i : i + tp] for i in range(0, len(bundles), tp)]
    if any(len({placement.bundles[b].node_id for b in stage}) != 1 for stage in stages):
        raise ValueError(
            f"a vLLM engine's tensor-parallel group of {tp} GPUs must sit on one node, but bundles "
            f"{list(bundles)} put one across nodes: make generation.vllm.tensor_parallel_size divide "
            "cluster.devices_per_node (and, not colocated, the policy's ranks on the first node); an "
            "engine larger than a node takes generation.vllm.pipeline_parallel_size stages"
        )
    if len({placement.bundles[b].group.id for b in bundles}) != 1:
        raise ValueError(
            f"a vLLM engine's workers (bundles {list(bundles)}) must be in one placement group, but "
            f"placement '{placement.name}' has a group per node: reserve it with one group "
            "(mrl.app.runtime.reserve_placement does when an engine spans nodes)"
        )
    if len({placement.bundles[b].node_id for b in bundles}) > 1 and not cfg.generation.colocated:
        raise ValueError(
            f"a vLLM engine across nodes (bundles {list(bundles)}) needs generation.colocated=true: a "
            "non-colocated engine's refit arrives in its actor and reaches only its own node's GPUs"
        )


def vllm_engine_config(
    cfg: "MrlConfig",
    model_path: str,
    *,
    load_weights: bool = True,
    seats: Optional[EngineSeats] = None,
    placement: Any = None,
    refitted: bool = False,
) -> "VllmEngineConfig":
    """Settings of every vLLM engine of the run, starting from the HF folder `model_path` (`load_weights=False`: its
    config alone, the weights come by refit); `seats` on `placement`: where the engines' workers go, whose devices
    decide GPU settings (None: this process's)."""
    import torch

    from mrl.inference.vllm_backend import VllmEngineConfig

    gen = cfg.generation
    gpus = placement.on_gpus if placement is not None else torch.cuda.is_available()
    executor = () if seats is None else tuple(tuple(placement.bundles[b].index for b in w) for w in seats.workers)
    return VllmEngineConfig(
        model_path=model_path,
        load_weights=load_weights,
        tensor_parallel_size=gen.vllm.tensor_parallel_size,
        pipeline_parallel_size=gen.vllm.pipeline_parallel_size,
        max_model_len=_vllm_context_length(cfg),
        dtype=cfg.policy.precision,
        seed=cfg.run.seed,
        enforce_eager=gen.vllm.eager(),
        kv_cache_bytes=int(gen.vllm.kv_cache_gib * 2**30),
        gpu_memory_utilization=gen.vllm.gpu_memory_utilization,
        sleep_when_idle=gen.colocated,  # on CPU the contract alone (mrl/cpu/vllm_sleep_mode.py)
        sleep_level=gen.sleep_level if refitted else 1,  # discarded weights need a policy to refit them
        seeded_sampling=gen.seeded_sampling,
        multiprocessing=engine_world_size(cfg) > 1 and not executor,
        refit_transport="cuda_ipc" if gpus else "shm_file",  # the engine's own hand-on
        refit_bucket_bytes=gen.refit_bucket_mb * 2**20,
        ray_executor_bundles=executor,
        ray_worker_gpus=seats.share if seats is not None else 1.0,
        return_routing=cfg.policy.moe.router_replay != "off",
    )


def build_vllm_engines(
    cfg: "MrlConfig",
    model_path: str,
    placement: Any,
    *,
    colocated_share: float = 0.5,
    load_weights: bool = True,
    refitted: bool = False,
) -> "VllmEngineGroup":
    """One engine per generation data-parallel rank on `placement` (which must hold that many bundles).

    Colocated engines take `colocated_share` of each bundle (half by default), leaving the rest to the policy group
    (and a reward model) on the same bundles.
    """
    from mrl.distributed.env import worker_threads
    from mrl.inference.vllm_worker import VllmEngineGroup

    if cfg.generation.backend != "vllm":
        raise ValueError(f"generation.backend={cfg.generation.backend!r}: build_vllm_engines builds vLLM engines only")
    seats = engine_seats(cfg, placement, colocated_share=colocated_share)
    threads, busy_per_node = worker_threads(cfg)
    return VllmEngineGroup(
        vllm_engine_config(
            cfg, model_path, load_weights=load_weights, seats=seats, placement=placement, refitted=refitted
        ),
        placement,
        bundle_indices=list(seats.actors),
        resource_fraction=seats.share,
        omp_num_threads=threads,
        busy_per_node=busy_per_node,
    )


def _vllm_context_length(cfg: "MrlConfig") -> int:
    return cfg.generation.vllm.max_model_len or cfg.policy.max_total_sequence_length


def engine_context_length(cfg: "MrlConfig") -> int:
    """The configured rollout engine's context in tokens (prompt + response): vLLM's generation.vllm.max_model_len
    when set, else (and always for the Megatron engine) policy.max_total_sequence_length."""
    if cfg.generation.backend == "vllm":
        return _vllm_context_length(cfg)
    return cfg.policy.max_total_sequence_length


def megatron_engine_config(cfg: "MrlConfig", model_path: str, *, load_weights: bool = True) -> "MegatronEngineConfig":
    """Settings of the Megatron static-inference engine, starting from the HF folder `model_path` (`load_weights`:
    as for vLLM)."""
    from mrl.inference.megatron_backend import MegatronEngineConfig

    fusions = cfg.policy.speed.compiled_fusions  # the engine computes as the policy does
    return MegatronEngineConfig(
        model_path=model_path,
        load_weights=load_weights,
        max_model_len=cfg.policy.max_total_sequence_length,
        dtype=cfg.policy.precision,
        seed=cfg.run.seed,
        sleep_when_idle=cfg.generation.colocated,
        return_routing=cfg.policy.moe.router_replay != "off",
        engine=cfg.generation.megatron.engine,
        kv_block_tokens=cfg.generation.megatron.kv_block_tokens,
        compiled_fusions=None if fusions == "auto" else fusions,
    )


def build_generation(
    cfg: "MrlConfig",
    model_path: str,
    placement: Any,
    *,
    colocated_share: float = 0.5,
    load_weights: bool = True,
    refitted: bool = False,
) -> "RolloutEngine":
    """The rollout backend `generation.backend` names: vLLM engines on `placement` (`build_vllm_engines`), or one
    Megatron static-inference engine in this process at TP1 (`placement` unused: it holds its own model copy).
    `colocated_share`: the part of a shared bundle a colocated engine asks for. `load_weights=False`: the engines
    start from `model_path`'s config alone and must be refitted before they generate. `refitted`: a policy refits
    the engines (only then may they sleep at generation.sleep_level 2, which discards their weights)."""
    if cfg.generation.backend == "megatron":
        from mrl.inference.megatron_backend import MegatronBackend

        return MegatronBackend(megatron_engine_config(cfg, model_path, load_weights=load_weights))
    return build_vllm_engines(
        cfg, model_path, placement, colocated_share=colocated_share, load_weights=load_weights, refitted=refitted
    )
