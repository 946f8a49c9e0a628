"""vLLM engines as Ray actors: one engine per generation data-parallel rank, each with its own tensor parallel size.

`VllmEngineWorker` is a plain class (one per actor, built by mrl.distributed's `WorkerGroup`) that owns one
`VllmBackend`. `VllmEngineGroup` is what the controller holds; it implements `GenerationBackend` over N engines:

- generate: prompts are SHARDED along the prompt axis over the engines (contiguous blocks, the first B % N engines
  take one more; fewer prompts than engines are padded); sampling settings are REPLICATED; samples come back
  concatenated in prompt order. Each shard
  keeps the global prompt indices, so per-prompt seeds do not depend on how many engines there are.
- refit (the group is a sink of mrl/inference/refit.py): every bucket is REPLICATED to all engines (each loads
  the full model; vLLM's loaders cut their tensor-parallel shards); all engines finish a bucket before the next.
- life cycle (mrl/inference/lifecycle.py): the group's state machine is the one the controller checks; each
  transition runs on every engine at once (REPLICATED), and each engine checks its own state again.
- An engine actor that dies surfaces as `mrl.distributed.WorkerDiedError` naming the group ("generation"), the
  engine's rank and its node/pid; the run replaces the engines (mrl/app/engine_restarts.py). The fault suite kills
  an engine at the named points `engine.start`, `engine.wake` (its wake-up to generate), `engine.generate`,
  `engine.sleep` and `engine.refit_bucket` (mrl/distributed/faults.py).

An engine of several workers (tensor parallel size x pipeline stages) runs vLLM's own worker processes inside its
actor: on CPU give its bundle that many CPUs; on GPUs vLLM's Ray executor puts one worker on each of its GPU bundles,
which may be on several nodes (one pipeline stage per node: mrl.inference.factory.engine_seats).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch

from mrl.distributed import GroupFuture, Work, WorkerGroup
from mrl.distributed.env import Threads
from mrl.distributed.faults import inject
from mrl.inference.buckets import NamedTensor
from mrl.inference.interface import GeneratedSample, GenerationOutput, SamplingConfig
from mrl.inference.lifecycle import WEIGHTS, EngineLifecycle
from mrl.inference.refit import LocalWeights, RefitStats, refit
from mrl.inference.transports import CollectiveTransport, Payload, make_transport
from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig, expected_tensor_names
from mrl.logging.known_noise import ENGINE_ENV


class VllmEngineWorker:
    """Lives in one Ray actor: one vLLM engine."""

    def __init__(self, config: VllmEngineConfig) -> None:
        inject("engine.start")
        self.backend = VllmBackend(config.for_engine(int(os.environ.get("RANK", "0"))))

    def generate_shard(self, shard: dict[str, list], sampling: SamplingConfig) -> dict[str, list]:
        """shard: {"prompts": [P_i token ids], "prompt_index": [global index of each]} (contiguous indices).

        Returns lists only, so the group's merge concatenates them in data-parallel (= prompt) order.
        """
        inject("engine.generate")
        offset = shard["prompt_index"][0]
        # Shift the base seed so local prompt i draws the seeds of global prompt offset + i.
        seed = None if sampling.seed is None else sampling.seed + offset * sampling.n
        output = self.backend.generate(shard["prompts"], dataclasses.replace(sampling, seed=seed))
        samples = [dataclasses.replace(s, prompt_index=s.prompt_index + offset) for s in output.samples]
        return {
            "samples": samples,
            "num_prompts_truncated": [output.num_prompts_truncated],
            "num_prompts_rejected": [output.num_prompts_rejected],
        }

    def load_payload(self, payload: Payload) -> None:
        inject("engine.refit_bucket")
        self.backend.load_payload(payload)

    def join_refit_group(self, transport: CollectiveTransport) -> None:
        """Join the refit broadcast group as member 1 + this engine's rank (collective transport)."""
        transport.join(1 + int(os.environ.get("RANK", "0")))

    def finish_refit(self, complete: bool = True) -> None:
        self.backend.finish_refit(complete)

    def prepare_for_refit(self) -> None:
        self.backend.prepare_for_refit()

    def wake_weights(self) -> None:
        self.backend.wake_weights()

    def begin_refit(self) -> None:
        self.backend.begin_refit()

    def prepare_for_generation(self) -> None:
        inject("engine.wake")
        self.backend.prepare_for_generation()

    def finish_generation(self, refit_follows: bool = False) -> None:
        inject("engine.sleep")
        self.backend.finish_generation(refit_follows)

    def sleep_events(self) -> list[tuple[str, float]]:
        return self.backend.sleep_events()

    def worker_uss_bytes(self) -> list[int]:
        return self.backend.worker_uss_bytes()

    def shutdown(self) -> None:
        self.backend.shutdown()


def engine_actor_options(config: VllmEngineConfig) -> dict[str, Any]:
    """What an engine's actor asks of its bundle beyond the group's share (`WorkerGroup` keywords). With vLLM's Ray
    executor the actor holds no GPU (its workers do) and sees its node's GPUs, as vLLM's platform code expects."""
    executor = bool(config.ray_executor_bundles)
    return {
        "gpu_fraction": 0.0 if executor else None,
        "env": {
            **ENGINE_ENV,  # vLLM's INFO logs and torch's C++ notices, known to be harmless
            **({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if executor else {}),
        },
    }


class VllmEngineGroup:
    """`GenerationBackend` over one vLLM engine per bundle of `placement` (see the module docstring)."""

    def __init__(
        self,
        config: VllmEngineConfig,
        placement: Any,
        *,
        name: str = "generation",
        bundle_indices: Optional[Sequence[int]] = None,
        resource_fraction: float = 1.0,
        omp_num_threads: Threads = 1,
        busy_per_node: Optional[int] = None,
    ) -> None:
        """`bundle_indices[e]`: engine e's actor. With `config.ray_executor_bundles` (GPUs, several workers) the actor
        holds no GPU itself: vLLM's Ray workers hold them, on the bundles listed there, and the actor sees every GPU of
        its node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), as vLLM's platform code expects."""
        self.config = config
        self.expected_names = expected_tensor_names(config)
        self._transport = make_transport(config.refit_transport)
        self.lifecycle = EngineLifecycle(
            f"engine group '{name}'",
            sleeps=config.sleep_when_idle,
            sleep=lambda: self.workers.run_all(VllmEngineWorker.finish_generation),
            wake=self._wake,
            discard_sleep=(lambda: self.workers.run_all(VllmEngineWorker.finish_generation, True))
            if config.sleep_level == 2
            else None,
        )
        self.workers = WorkerGroup(
            name,
            VllmEngineWorker,
            placement,
            init_args=(config,),
            bundle_indices=bundle_indices,
            resource_fraction=resource_fraction,
            omp_num_threads=omp_num_threads,
            busy_per_node=busy_per_node,
            **engine_actor_options(config),
        )

    @property
    def num_engines(self) -> int:
        return self.workers.world_size

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        """Shard the prompts over the engines. Fewer prompts than engines: the batch is padded with one-token
        prompts whose samples are dropped (every data-parallel rank needs a row)."""
        self.lifecycle.check_generate()
        count = len(prompts)
        if count == 0:
            return GenerationOutput([], num_prompts=0, n=sampling.n)
        pads = max(0, self.num_engines - count)
        batch = {
            "prompts": [list(p) for p in prompts] + [[0]] * pads,
            "prompt_index": list(range(count + pads)),
        }
        uneven = (count + pads) % self.num_engines != 0
        tokens = sum(len(p) for p in prompts) + count * sampling.n * sampling.max_new_tokens
        merged = self.workers.shard_and_run(
            VllmEngineWorker.generate_shard, batch, sampling, allow_uneven=uneven, work=Work(tokens=tokens)
        )
        samples: list[GeneratedSample] = [s for s in merged["samples"] if s.prompt_index < count]
        return GenerationOutput(
            samples=samples,
            num_prompts=count,
            n=sampling.n,
            num_prompts_truncated=int(sum(merged["num_prompts_truncated"])),
            num_prompts_rejected=int(sum(merged["num_prompts_rejected"])),
        )

    # ---------------------------------------------------------------------------------------------------- refit
    @property
    def num_receivers(self) -> int:
        return self.num_engines

    def update_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]) -> RefitStats:
        """Stream HF-named tensors from this process into every engine (the refit loop, shared-memory files)."""
        return refit(LocalWeights(named_tensors), self, self._transport, bucket_bytes=self.config.refit_bucket_bytes)

    def load_payload(self, payload: Payload) -> None:
        """Every engine loads one refit payload."""
        self.lifecycle.check_load()
        self.workers.run_all(VllmEngineWorker.load_payload, payload)

    def load_payload_async(self, payload: Payload) -> GroupFuture:
        """`load_payload` without waiting (collective transport: the engines must be receiving while the sender
        sends)."""
        self.lifecycle.check_load()
        return self.workers.run_all_async(VllmEngineWorker.load_payload, payload)

    def join_refit_group_async(self, transport: CollectiveTransport) -> GroupFuture:
        return self.workers.run_all_async(VllmEngineWorker.join_refit_group, transport)

    def finish_refit(self, complete: bool = True) -> None:
        self.workers.run_all(VllmEngineWorker.finish_refit, complete)
        if complete:
            self.lifecycle.refitted()

    # ---------------------------------------------------------------------------------------------------- memory
    def _wake(self, tags: Sequence[str]) -> None:
        self.workers.run_all(
            VllmEngineWorker.wake_weights if tuple(tags) == (WEIGHTS,) else VllmEngineWorker.prepare_for_generation
        )

    def prepare_for_refit(self) -> None:
        """Wake the engines' weights (the refit loop, before its first bucket; a no-op unless asleep), then open
        every engine's reload session for the refit's buckets."""
        self.lifecycle.wake_weights()
        self.workers.run_all(VllmEngineWorker.begin_refit)

    def prepare_for_generation(self) -> None:
        """Wake the engines' weights and KV cache; a no-op, without a round trip, for engines that are awake."""
        self.lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        """Put the engines to sleep (colocated; `refit_follows`: see `VllmBackend.finish_generation`); a no-op,
        without a round trip, for engines that never sleep."""
        self.lifecycle.sleep(refit_follows)

    def sleep_events(self) -> list[list[tuple[str, float]]]:
        """Each engine's record of its sleep-mode calls (the CPU stand-in's; [] on GPUs)."""
        return self.workers.run_all(VllmEngineWorker.sleep_events)

    def worker_uss_bytes(self) -> list[list[int]]:
        return self.workers.run_all(VllmEngineWorker.worker_uss_bytes)

    def shutdown(self) -> None:
        """Stop every engine cleanly (vLLM worker processes, shared-memory segments), then kill the actors; a dead
        engine, or one still blocked in a failed refit's broadcast, is killed without."""
        self.workers.shutdown(clean=VllmEngineWorker.shutdown)
