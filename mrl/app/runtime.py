"""What every algorithm loop runs on: the model folder, the Ray cluster, the policy group and the rollout engine.

The loops (mrl/algorithms) receive a `Runtime` as their `Workers` and never touch Ray, ranks or devices themselves.

Model source (`policy.build` or `policy.model_name`): mrl/app/starting_model.py. From a Megatron checkpoint the
engine starts from its hf/ config alone (random weights) and is refitted from the policy before anything else runs; a
command without a policy (`mrl eval`) starts a frozen one for that refit and stops it after.

Start: the policy group, a reward model's group and the engines start side by side (threads of this process, each
waiting on its Ray actors: imports and model building take seconds); a failure in one stops the others. Colocated,
the policy and the reward model build their workers only once the engine has started and gone to sleep: vLLM sizes
its KV cache from the device memory it finds free while it profiles, and refuses to start (or asserts) when another
process changes it meanwhile (vllm/v1/worker/gpu_worker.py), so the engine starts on a clean device, releases its
memory, and only then do the other groups build (their actors import meanwhile: `WorkerGroup(wait_before_init=...)`).

Placement: `cluster.num_nodes x cluster.devices_per_node` bundles, each holding one GPU when the Ray cluster has
GPUs (each rank then uses the device Ray gave it: mrl/parallel/devices.py). Colocated (the default): the policy's
ranks and the engines share the bundles, each taking half of a bundle's resources (a third each with a reward model);
the engine gets the policy's weights by
refit after every step (mrl/inference/refit.py), as shared-memory files written by the policy's rank 0 (on GPUs:
device buffers the engine maps by CUDA IPC). An engine
on devices of its own (`generation.colocated: false`) receives them by broadcast in a group of the policy's rank 0
and the engines, made on the first refit. PPO's critic and distillation's teacher share the policy's bundles as a
reward model does (a share each), or the teacher takes the cluster's last `distillation.num_devices` bundles whole.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch

from converters.hf_io import load_hf_config
from mrl.app.engine_restarts import RestartingEngine, announce, engine_died, restart_refusal
from mrl.app.errors import configuration_failure
from mrl.app.model_source import ModelSource, classify_model_path
from mrl.app.preflight import check_engine_model
from mrl.app.starting_model import load_tokenizer, policy_padded_vocab, resolve_model
from mrl.config.schema import MrlConfig
from mrl.cpu import isa
from mrl.distributed import Placement, RayCluster, WorkerDiedError
from mrl.distributed.env import worker_threads
from mrl.inference.factory import engine_spans_nodes
from mrl.inference.interface import RolloutEngine
from mrl.inference.lifecycle import EngineState
from mrl.inference.refit import RefitStats, refit
from mrl.inference.transports import CollectiveTransport, WeightTransport, collective, make_transport
from mrl.policy.interface import ReleasesMemory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from mrl.policy.group import Policy
    from mrl.policy.worker import PolicySpec

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The started workers of one run; `shutdown()` stops them all (also after a failure). A command starts only
    the parts it needs: `policy` is None for `mrl eval`, `engine` for `mrl sft` and `mrl score`."""

    cfg: MrlConfig
    source: ModelSource
    tokenizer: "PreTrainedTokenizerBase"
    cluster: RayCluster
    placement: Optional[Placement] = None
    policy: Optional["Policy"] = None  # also the refit's weight source (`mrl.inference.refit.WeightSource`)
    engine: Optional[RolloutEngine] = None
    reward_model: Optional[Any] = None  # a frozen reward model's worker group (env.reward_model), on the same bundles
    critic: Optional["Policy"] = None  # PPO's value model (grpo.advantage_estimator: gae), trainable, same bundles
    teacher: Optional["Policy"] = None  # distillation's frozen teacher: the same bundles, or its own (num_devices)
    _broadcast: Optional[CollectiveTransport] = None
    _local: Optional[WeightTransport] = None
    engine_restarts: int = 0
    """Engines replaced after a death so far (mrl/app/engine_restarts.py)."""
    trains: bool = False
    """A trainable policy refits the engine (then a colocated vLLM engine may discard its weights asleep)."""

    @property
    def model_dir(self) -> Path:
        """The model's config.json and tokenizer (what every export and checkpoint copies beside the weights)."""
        return self.source.config_dir

    def refit(self, on_sent: Optional[Callable[[], None]] = None) -> RefitStats:
        """Stream the policy's weights into the engine (see the module docstring for the transport); `on_sent`: once
        the policy has sent them all (`mrl.inference.refit.refit`). An engine that dies meanwhile is replaced and
        the refit done again (mrl/app/engine_restarts.py)."""
        while True:
            try:
                return self._refit_once(on_sent)
            except WorkerDiedError as error:
                self._replace_engine(error)  # then the refit again, into the new engines

    def _refit_once(self, on_sent: Optional[Callable[[], None]]) -> RefitStats:
        assert self.policy is not None and self.engine is not None, "refit needs a policy and an engine"
        # Colocated: the policy hands its optimizer states and gradients over before the engine wakes its weights
        # (the refit's first step); its weights too, after the export, when configured (policy.offload_when_generating)
        handover = self.cfg.generation.colocated and hasattr(self.policy, "release_memory")
        if handover:
            cast(ReleasesMemory, self.policy).release_memory()
            if self.critic is not None:  # the critic trained too: its optimizer states and gradients go as well
                self.critic.release_memory()
        stats = refit(
            self.policy,
            self.engine,
            self._transport(),
            on_sent=on_sent,
            bucket_bytes=self.cfg.generation.refit_bucket_mb << 20,
        )
        if handover and self.cfg.policy.offload_when_generating.weights:
            cast(ReleasesMemory, self.policy).release_memory()
        return stats

    def restart_engine(self, error: WorkerDiedError) -> None:
        """Replace the engines after `error`, the death of one of them, and give them the policy's weights; raise
        `error` when it is another group's, or the engine is not to be replaced (mrl/app/engine_restarts.py)."""
        self._replace_engine(error)
        if self.policy is not None:
            self.refit()

    def _replace_engine(self, error: WorkerDiedError) -> None:
        """New engines in place of the group `error` says died (no weights yet where a policy will refit them)."""
        if not engine_died(error, self.engine):
            raise error
        self._count_restart(error)
        engine = cast(RestartingEngine, self.engine)
        _stop_engine(engine.current)  # the dead group is killed whatever its clean-up says
        self._broadcast = None  # a new broadcast group with the new engines, on the next refit
        share = group_share(self.cfg, engine=True, others=self._others())
        # From the config alone when the policy refits them next; from the model's files for a run without one.
        engine.current = self._new_engine(share, load_weights=self.policy is None)
        _arm_watchdogs(self, only=engine.current)

    def _new_engine(
        self, share: float, *, load_weights: bool, sleep: bool = False, starting: bool = False
    ) -> RolloutEngine:
        """Engines started on the placement (`sleep`: then put to sleep, the colocated start-up's order). Engines that
        die meanwhile are started again, each time one restart more (`_count_restart`; `starting`: the run's first
        engines, whose weights a Megatron source's policy brings after the start)."""
        while True:
            engine: Optional[RolloutEngine] = None
            try:
                engine = _build_engine(self, share, load_weights=load_weights)  # a group that fails stops itself
                if sleep:
                    engine.finish_generation()
                return engine
            except WorkerDiedError as error:  # the only group built here is the engines'
                if engine is not None:
                    _stop_engine(engine)
                self._count_restart(error, starting=starting)

    def _count_restart(self, error: WorkerDiedError, *, starting: bool = False) -> None:
        """One restart more after `error`, said on a line; raise `error` when the engines are not to be restarted
        (mrl/app/engine_restarts.py `restart_refusal`)."""
        reachable = starting or self.policy is not None or not self.source.is_megatron
        refusal = restart_refusal(self.cfg, self.engine_restarts, weights_reachable=reachable, starting=starting)
        if refusal:
            print(f"[mrl] the engine is not restarted: {refusal}", file=sys.stderr, flush=True)
            raise error
        self.engine_restarts += 1
        how = (
            "(the run is starting)"
            if starting
            else "with the policy's current weights"
            if self.policy is not None
            else "from the model's files"
        )
        announce(error, self.engine_restarts, self.cfg.generation.max_restarts, how=how)

    def _transport(self) -> WeightTransport:
        """The run's weight-sync mode (mrl/inference/transports/base.py), chosen once: a local one for colocated
        engines and the Megatron engine, else a broadcast group with the engines (again only after they were
        replaced). It owns the sender strategy; the refit loop and the policy only ask it."""
        if self.cfg.generation.colocated or self.cfg.generation.backend != "vllm":
            if self._local is None:  # one object for the run: a CUDA IPC sender keeps its buffers under its name
                # The workers' devices decide, not this process's: the placement's bundles hold GPUs or not.
                cuda = self.placement is not None and self.placement.on_gpus and self.cfg.generation.backend == "vllm"
                self._local = make_transport("cuda_ipc" if cuda else "shm_file")
            return self._local
        if self._broadcast is None:
            assert self.policy is not None and self.engine is not None  # _refit_once, the only caller, checked them
            self._broadcast = collective.connect(
                self.policy,
                self.engine,  # type: ignore[arg-type]  # vLLM's engine group; RolloutEngine declares no collective
            )
        return self._broadcast

    def sides(self, *, sharing: bool = False) -> list[Any]:
        """The started groups beside the policy and the engine (reward model, critic, teacher); `sharing`: only those
        on the policy's bundles."""
        parts = {"reward_model": self.reward_model, "critic": self.critic, "teacher": self.teacher}
        return [p for name, p in parts.items() if p is not None and not (sharing and _own_devices(self.cfg, name))]

    def _others(self) -> int:
        """How many groups beside the policy and the engine share the bundles."""
        return len(self.sides(sharing=True))

    def shutdown(self) -> None:
        for part in (self.engine, *self.sides(), self.policy):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as error:  # noqa: BLE001 -- keep shutting the rest down
                    log.warning("shutdown: %s", error)
        self.cluster.shutdown()


def _start_groups(runtime: Runtime, specs: dict[str, Optional[PolicySpec]], share: float, *, engine: bool) -> bool:
    """Start the engine (if `engine`) and a worker group per spec that is not None (the policy's, "policy", and those
    beside it) on the runtime's placement. The groups start side by side (each spends seconds importing and building
    its model); colocated, the others build theirs once the engine sleeps (see the module docstring). Returns
    whether they waited for it."""
    cfg, placement = runtime.cfg, runtime.placement
    assert placement is not None  # reserved by start_runtime first
    groups = any(spec is not None for spec in specs.values())
    asleep = _EngineAsleep() if engine and cfg.generation.colocated and groups else None
    wait = asleep.wait if asleep else None
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mrl-start") as pool:
        starting = {
            name: pool.submit(_start_policy, cfg, spec, placement, share, wait=wait, name=name)
            if spec is not None
            else None
            for name, spec in specs.items()
        }
        try:
            if engine:
                _start_engine(runtime, share, sleep=asleep is not None)
                if asleep:
                    asleep.set()
        except BaseException:
            if asleep:
                asleep.fail()  # the groups waiting on the failed engine give up ...
            _collect_started(runtime, starting, raising=False)  # ... a consequence: the engine's failure is raised
            raise
        _collect_started(runtime, starting)
    return asleep is not None


def _check_before_ray(cfg: MrlConfig, source: ModelSource, tokenizer: Any, *, policy: bool, engine: bool) -> Any:
    """Every check that reads files or the device, before Ray starts; returns the tokenizer (`tokenizer` when the
    command already loaded it)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg, source)
    if engine:
        check_engine_model(cfg, load_hf_config(source.config_dir))
    if not torch.cuda.is_available():
        isa.announce()
    elif policy:
        from mrl.app.plan import check_this_gpu

        # the layout against this GPU (cluster.memory_check); a device query, which makes no CUDA context here
        check_this_gpu(cfg, torch.cuda.get_device_properties(0).total_memory)
    return tokenizer


def start_runtime(
    cfg: MrlConfig,
    *,
    total_steps: int,
    policy: bool = True,
    engine: bool = True,
    reference: bool = False,
    padded_vocab: Optional[int] = None,
    source: Optional[ModelSource] = None,
    tokenizer: Any = None,
    critic: Optional[ModelSource] = None,
    critic_padded_vocab: Optional[int] = None,
) -> Runtime:
    """Start Ray, reserve the bundles, then the policy group and/or the engines (see the module docstring).
    `padded_vocab`: that of a checkpoint to resume; `source` replaces the configured model (a reward model's variant
    of it, `mrl rm`); `tokenizer`: `source`'s, when the command already loaded it for its checks; `critic`: PPO's
    value model to start beside the policy (`critic_padded_vocab`: its checkpoint's, when resuming). A
    `distillation` section starts its teacher beside a trainable policy."""
    source = source or resolve_model(cfg)
    feeder = engine and not policy and source.is_megatron  # a frozen policy brings the engine its weights
    main = (
        _policy_spec(
            cfg,
            source,
            total_steps=total_steps,
            with_reference=reference,
            trainable=policy,
            padded_vocab=policy_padded_vocab(cfg, source, padded_vocab),
        )
        if policy or feeder
        else None
    )
    scorer = _reward_model_spec(cfg) if policy and engine else None
    sides = {
        "reward_model": scorer,
        "critic": _critic_spec(cfg, critic, critic_padded_vocab) if policy and critic is not None else None,
        "teacher": _teacher_spec(cfg) if policy and engine else None,
    }
    sharing = [name for name, spec in sides.items() if spec is not None and not _own_devices(cfg, name)]
    tokenizer = _check_before_ray(cfg, source, tokenizer, policy=policy, engine=engine)
    cluster = RayCluster.from_config(cfg.cluster)
    runtime = Runtime(cfg, source, tokenizer, cluster, trains=policy)
    started = time.time()
    try:
        runtime.placement = reserve_placement(cfg, cluster)
        _models_on_every_node(runtime.placement, _model_folders(cfg, source))
        share = group_share(cfg, engine=engine, others=len(sharing))
        if _start_groups(runtime, {"policy": main, **sides}, share, engine=engine):
            _report_start_order(runtime, started)
        _arm_watchdogs(runtime)
        if engine and runtime.source.is_megatron:  # an engine started from the config alone gets the weights now
            runtime.refit()
        if feeder:
            assert runtime.policy is not None  # started: `main` is the feeder's spec
            runtime.policy.shutdown()
            runtime.policy = None
    except BaseException as error:
        runtime.shutdown()
        refused = configuration_failure(error)  # one that a re-run would meet again: no advice to re-run
        if refused is not None:
            raise refused from error
        raise
    return runtime


def _model_folders(cfg: MrlConfig, source: ModelSource) -> list[str]:
    """The model folders the workers read that are hub snapshots (mrl/app/hub_ids.py resolved them)."""
    from mrl.data.hub import is_snapshot

    folders = [str(source.config_dir)]
    if cfg.env.reward_model is not None:
        folders.append(cfg.env.reward_model.model)
    if cfg.distillation is not None:
        folders.append(cfg.distillation.teacher)
    return [folder for folder in folders if is_snapshot(folder)]


def _models_on_every_node(placement: Placement, folders: list[str]) -> None:
    """Every node of the placement holds the hub snapshots its workers will read before any of them starts: a node
    whose cache lacks one (HF_HOME not shared between nodes) fetches it by its commit. A no-op without hub models."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from mrl.data.hub import ensure_model_snapshot

    if not folders:
        return
    task = ray.remote(num_cpus=0, max_retries=0)(_ensure_snapshots)
    nodes = sorted({bundle.node_id for bundle in placement.bundles})
    done = ray.get(
        [
            task.options(
                name="mrl-fetch-models", scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(folders, ensure_model_snapshot)
            for node in nodes
        ]
    )
    for node, outcome in zip(nodes, done):
        if any(line != "present" for line in outcome):
            print(f"[mrl] node {node[:12]}: {'; '.join(outcome)}", file=sys.stderr, flush=True)


def _ensure_snapshots(folders: list[str], ensure: Any) -> list[str]:
    return [ensure(folder) for folder in folders]


def _policy_spec(
    cfg: MrlConfig,
    source: ModelSource,
    *,
    total_steps: int,
    padded_vocab: Optional[int],
    trainable: bool = True,
    with_reference: bool = False,
) -> "PolicySpec":
    """What every rank of a policy (or reward model) group builds and loads (`padded_vocab`: `_padded_vocab`'s)."""
    from mrl.policy.worker import PolicySpec

    megatron = None if source.megatron_dir is None else str(source.megatron_dir)
    return PolicySpec(
        hf_dir=str(source.config_dir),
        megatron_dir=megatron,
        policy=cfg.policy,
        seed=cfg.run.seed,
        total_steps=total_steps,
        with_reference=with_reference,
        trainable=trainable,
        padded_vocab=padded_vocab,
    )


def _reward_model_spec(cfg: MrlConfig) -> Optional["PolicySpec"]:
    """The frozen reward model scoring GRPO's rollouts (env.reward_model), HF or Megatron; None without one."""
    if cfg.env.reward_model is None:
        return None
    rm = classify_model_path(cfg.env.reward_model.model, key="env.reward_model.model")
    return _policy_spec(cfg, rm, total_steps=1, trainable=False, padded_vocab=policy_padded_vocab(cfg, rm, None))


def _critic_spec(cfg: MrlConfig, critic: ModelSource, padded_vocab: Optional[int]) -> "PolicySpec":
    """PPO's value model: trainable, the policy's settings with the critic's optimizer and (when given) layout."""
    spec = _policy_spec(cfg, critic, total_steps=cfg.grpo.max_num_steps, padded_vocab=padded_vocab)
    update = {"optimizer": cfg.ppo.critic.optimizer, "parallel": cfg.ppo.critic.parallel or cfg.policy.parallel}
    return replace(spec, policy=cfg.policy.model_copy(update=update))


def _own_devices(cfg: MrlConfig, group: str) -> bool:
    """Whether a group beside the policy sits on devices of its own (a teacher with distillation.num_devices)."""
    return group == "teacher" and cfg.teacher_devices > 0


def _teacher_spec(cfg: MrlConfig) -> Optional["PolicySpec"]:
    """Distillation's frozen teacher (distillation.teacher), HF or Megatron, in its own layout when given; None
    without one."""
    if cfg.distillation is None:
        return None
    teacher = classify_model_path(cfg.distillation.teacher, key="distillation.teacher")
    spec = _policy_spec(
        cfg, teacher, total_steps=1, trainable=False, padded_vocab=policy_padded_vocab(cfg, teacher, None)
    )
    if cfg.distillation.parallel is None:
        return spec
    return replace(spec, policy=cfg.policy.model_copy(update={"parallel": cfg.distillation.parallel}))


def reserve_placement(cfg: MrlConfig, cluster: RayCluster) -> Placement:
    """`cluster.num_nodes` x `cluster.devices_per_node` bundles, each with one GPU when the cluster has GPUs: a
    placement group per node, or one of them all when a vLLM engine spans nodes on GPUs (its Ray executor places the
    engine's workers in one group: mrl.inference.factory.engine_seats)."""
    gpus = cluster.has_gpus()
    one_group = gpus and cfg.generation.backend == "vllm" and engine_spans_nodes(cfg)
    return cluster.create_placement(
        f"{cfg.run.name}-workers",
        bundles_per_node=cfg.cluster.devices_per_node,
        num_nodes=cfg.cluster.num_nodes,
        cpus_per_bundle=cfg.cluster.cpus_per_worker,
        gpus_per_bundle=1.0 if gpus else 0.0,
        one_group=one_group,
    )


def group_share(cfg: MrlConfig, *, engine: bool, others: int = 0) -> float:
    """The part of a bundle each group takes: the policy, a colocated engine and the `others` (a reward model, a
    critic, a teacher) share it evenly."""
    return 1.0 / (1 + (engine and cfg.generation.colocated) + others)


def _report_start_order(runtime: Runtime, started: float) -> None:
    """One line with the colocated start-up's order, as measured: when the engine was asleep, when the first worker
    of the groups sharing its devices began to build (never before)."""
    assert runtime.engine is not None  # only after the colocated engine started and slept
    slept = max(t for state, t in runtime.engine.lifecycle.history if state is EngineState.ASLEEP)
    parts = [part.workers for part in (runtime.policy, *runtime.sides(sharing=True)) if part is not None]
    built = min(t for workers in parts for t in workers.init_started)
    done = max(workers.init_finished for workers in parts)
    print(
        f"[mrl] colocated start-up: engine up and asleep at +{slept - started:.1f} s, policy built from "
        f"+{built - started:.1f} s to +{done - started:.1f} s",
        file=sys.stderr,
    )


class _EngineAsleep:
    """Set once the colocated engine has started and gone to sleep; `wait()` raises if the engine failed instead."""

    def __init__(self) -> None:
        self._event, self._ok = threading.Event(), False

    def set(self) -> None:
        self._ok = True
        self._event.set()

    def fail(self) -> None:
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if not self._ok:
            raise RuntimeError("the colocated engine did not start, so the groups sharing its devices were not built")


def _arm_watchdogs(runtime: Runtime, only: Any = None) -> None:
    """Every worker group of the run (`only`: that part's) gets `run.watchdog`'s deadlines
    (mrl/distributed/deadlines.py): a call past its deadline ends the run naming the group, ranks and method, with
    their stacks. The Megatron engine runs in this process and has no group."""
    from mrl.distributed import Deadlines, WorkerGroup

    watchdog = runtime.cfg.run.watchdog
    if not watchdog.enabled:
        return
    deadlines = Deadlines(
        floor_s=watchdog.floor_s,
        tokens_per_s=watchdog.tokens_per_s,
        bytes_per_s=watchdog.mb_per_s * 1e6,
        overrides=dict(watchdog.overrides),
    )
    for part in (only,) if only is not None else (runtime.policy, runtime.engine, *runtime.sides()):
        group = getattr(part, "workers", None)
        if isinstance(group, WorkerGroup):
            group.deadlines = deadlines


def _start_policy(
    cfg: MrlConfig,
    spec: "PolicySpec",
    placement: Placement,
    share: float,
    *,
    wait: Optional[Callable[[], None]] = None,
    name: str = "policy",
) -> "Policy":
    """A group of the policy's kind: on the policy's bundles (sharing them), or a teacher on devices of its own."""
    from mrl.policy.group import Policy

    first, world = 0, cfg.policy_world_size
    if _own_devices(cfg, name):
        first, world = teacher_bundles(cfg)
        share, wait = 1.0, None  # its bundles are its own: no engine to wait for, the whole of each bundle
    return Policy(
        spec,
        placement,
        world_size=world,
        resource_fraction=share,
        **_threads(cfg),
        name=name,
        wait_before_init=wait,
        first_bundle=first,
    )


def teacher_bundles(cfg: MrlConfig) -> tuple[int, int]:
    """(first bundle, ranks) of a teacher on devices of its own: the cluster's last `distillation.num_devices`
    bundles, after the policy's and a non-colocated engine's."""
    total = cfg.cluster.num_nodes * cfg.cluster.devices_per_node
    return total - cfg.teacher_devices, cfg.teacher_devices


def _threads(cfg: MrlConfig) -> dict[str, Any]:
    threads, busy_per_node = worker_threads(cfg)
    return {"omp_num_threads": threads, "busy_per_node": busy_per_node}


def _start_engine(runtime: Runtime, share: float, *, sleep: bool = False) -> None:
    """vLLM engines in Ray actors on the placement, or the Megatron engine in this (driver) process; `sleep`: asleep
    once started (colocated: before the groups sharing its devices build). From a Megatron source the engine starts
    from the config alone (`start_runtime` refits it before anything can generate). vLLM engines that die, while
    starting too, are replaced (`Runtime.restart_engine`, `Runtime._new_engine`)."""
    engine = runtime._new_engine(share, load_weights=not runtime.source.is_megatron, sleep=sleep, starting=True)
    refill = runtime.refit if runtime.trains else None
    runtime.engine = RestartingEngine(engine, runtime.restart_engine, refill) if hasattr(engine, "workers") else engine


def _stop_engine(engine: Any) -> None:
    """Stop an engine group that died (its live engines cleanly, the rest killed), logging what its clean-up says."""
    try:
        engine.shutdown()
    except Exception as failure:  # noqa: BLE001 -- a dead group is killed whatever its clean-up says
        log.warning("shutdown of the dead engine group: %s", failure)


def _build_engine(runtime: Runtime, share: float, *, load_weights: bool) -> RolloutEngine:
    from mrl.inference.factory import build_generation

    return build_generation(
        runtime.cfg,
        str(runtime.model_dir),
        runtime.placement,
        colocated_share=share,
        load_weights=load_weights,
        refitted=runtime.trains,
    )


def _collect_started(runtime: Runtime, starting: dict[str, Optional[Future]], *, raising: bool = True) -> None:
    """Every group that started becomes the runtime's (so `shutdown` stops it); then the first failure is raised
    (`raising=False`: none, when the caller raises a failure of its own that caused theirs)."""
    failures = []
    for name, future in starting.items():
        if future is None:
            continue
        try:
            setattr(runtime, name, future.result())
        except BaseException as error:  # noqa: BLE001 -- collect every group before raising
            failures.append(error)
    if failures and raising:
        raise failures[0]
