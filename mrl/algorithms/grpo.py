"""GRPO: the single-controller loop, reading like the algorithm.

Objective (Shao et al. 2024, with the choices of mrl.objectives.loss and .advantages): for each prompt sample a
group of G responses from the current policy (the engine, refitted after every step), score them with a verifiable
reward, advantage A_i = group-normalised reward, and minimise the clipped surrogate
    L = -mean_t min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_k(pi || pi_ref),  r_t = pi/pi_old
over the batch, split into `policy.train_global_batch_size` rows per optimizer step. pi_old is the trainer's
logprob of the sampled tokens before the step's updates (its difference with the engine's logprobs is the
train/inference mismatch, logged every step as train/token_mult_prob_error and train/gen_kl_error); a step of one
update takes it from its training forward, one forward fewer. With loss.ratio_level = sequence, r is GSPO's one
ratio per sequence, the geometric mean of its token ratios, clipped per sequence (mrl.objectives.loss).
PPO (grpo.advantage_estimator: gae) and on-policy distillation (a `distillation` section) run this loop with A per
token instead: GAE's with a critic trained on the same samples, or the teacher's logprob minus the student's
(mrl/algorithms/ppo.py states both in full).

Departures: a group whose rewards are all equal has zero advantage; with grpo.dynamic_sampling such groups are
dropped instead of refilled (DAPO refills; here the step is just smaller). With grpo.max_off_policy_steps = 1 the
samples come from the policy one update older than pi_old (generation overlaps training, mrl/algorithms/ahead.py);
the loss's importance weights pi_old / pi_engine correct for it (loss.importance_sampling, required then).
Validation (before the first step, every grpo.val_every steps and after the last) samples the held-out problems
with the eval settings; a run without validation data skips it and says so once. An update whose loss or gradients
are not finite is skipped, and so is the refit after a step of only such updates (mrl/algorithms/guards.py). A
step that could learn nothing (every prompt too long, every group's rewards equal, no sample kept) warns with the
cause and the fix; grpo.max_idle_steps such steps in a row stop the run, exit 2 (mrl/algorithms/health.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from mrl.algorithms import ppo
from mrl.algorithms.agent import agent_rollouts
from mrl.algorithms.ahead import RolloutsAhead
from mrl.algorithms.env_metrics import per_env_metrics
from mrl.algorithms.evaluate import write_samples
from mrl.algorithms.guards import NonFiniteGuard
from mrl.algorithms.health import (
    EnvironmentErrorGuard,
    IdleGuard,
    env_reads_answers,
    health_metrics,
    step_causes,
)
from mrl.algorithms.interfaces import LoopCheckpoints, Workers
from mrl.algorithms.loop import end_step
from mrl.algorithms.mixed_rollouts import mixed_rollouts, validate_all
from mrl.algorithms.rollout import Rollouts, generate_and_score
from mrl.algorithms.updates import train_in_minibatches
from mrl.config.schema import MrlConfig
from mrl.data.dataloader import PromptDataLoader
from mrl.data.tasks import TaskData, encode_prompts
from mrl.environments.base import Environment
from mrl.environments.mixed import MixedEnvironment
from mrl.environments.server_env import ServerEnvironment
from mrl.inference.factory import sampling_config
from mrl.logging.metrics import MetricsLogger
from mrl.objectives.advantages import dynamic_sampling_keep, grpo_advantages, overlong_penalty
from mrl.objectives.loss import GENERATION_LOGPROBS, PREV_LOGPROBS, REF_LOGPROBS, GRPOLoss
from mrl.objectives.mismatch import mismatch_metrics
from mrl.policy.interface import RankBatch

#: The console's line per step; with the step's time, its two largest phases (where a slow step's time went).
KEY_METRICS = (
    "train/reward",
    "train/token_mult_prob_error",
    "val/accuracy",
    "timing/step",
    "timing/generation",
    "timing/train",
)


def kept_rows(keep: torch.Tensor, dp_size: int) -> torch.Tensor:
    """The rollout rows a step trains on: the kept ones, the first repeated until the count divides `dp_size`."""
    kept = keep.nonzero().squeeze(1)
    return torch.cat([kept, kept[:1].repeat(-len(kept) % dp_size)])


def training_rows(rollouts: Rollouts, advantages: torch.Tensor, keep: torch.Tensor, dp_size: int) -> RankBatch:
    """The kept samples as policy rows; advantages broadcast over tokens. Rows are added with an all-zero loss mask
    until the count divides the data-parallel size (they change neither loss nor gradient)."""
    index = kept_rows(keep, dp_size)
    mask = rollouts.loss_mask[index].clone()
    mask[int(keep.sum()) :] = 0
    adv = advantages[index][:, None].expand_as(mask).contiguous()
    lengths = None if rollouts.lengths is None else rollouts.lengths[index]
    routing = None if rollouts.routing is None else rollouts.routing[index]  # router replay's engine choices
    return RankBatch(
        rollouts.input_ids[index],
        mask,
        {"advantages": adv, GENERATION_LOGPROBS: rollouts.generation_logprobs[index]},
        lengths=lengths,
        routing=routing,
    )


def run_validation(cfg: MrlConfig, workers: Workers, env: Environment, data: TaskData, step: int) -> dict[str, float]:
    """Validation metrics of the current policy (its samples go to <run.output_dir>/val_samples/step_<N>.jsonl;
    multi-turn episodes: their mean reward and the fraction of reward 1, no samples file). Both wake the engine;
    it sleeps again after (colocated: the policy trains or saves next); not after a failure, which ends the run (a
    sleep of a dead engine would report its death in 'finish_generation' instead of where it died)."""
    metrics, result = validate_all(cfg, workers.engine, workers.tokenizer, env, data)
    workers.engine.finish_generation()
    if result is not None:
        write_samples(Path(cfg.run.output_dir) / "val_samples" / f"step_{step}.jsonl", result.samples)
    return metrics


def produce_rollouts(
    cfg: MrlConfig,
    workers: Workers,
    env: Environment,
    data: TaskData,
    problems,
    step: int,
    logger: MetricsLogger,
    policy_version: int,
) -> tuple[Rollouts, dict[str, float]]:
    """Step `step`'s samples from the engine (which holds the weights after step `policy_version`), scored."""
    m: dict[str, float] = {}
    problems, prompts = encode_prompts(problems, workers.tokenizer, data, cfg)
    sampling = sampling_config(cfg, step, turn_end_id=data.template.turn_end_id(workers.tokenizer))
    with logger.timer("generation", m):
        workers.engine.prepare_for_generation()  # colocated on GPUs: the engine takes its memory back
        if isinstance(env, ServerEnvironment):  # multi-turn episodes against a resource server
            rollouts, env_metrics = agent_rollouts(
                env, workers.engine, workers.tokenizer, data.template, problems, prompts, sampling
            )
            m.update(env_metrics)
        elif isinstance(env, MixedEnvironment) and env.servers:  # servers' episodes beside single-turn samples
            rollouts, env_metrics = mixed_rollouts(
                env, workers.engine, workers.tokenizer, data, problems, prompts, sampling
            )
            m.update(env_metrics)
        else:
            rollouts = generate_and_score(workers.engine, env, workers.tokenizer, problems, prompts, sampling)
        m.update(_generation_memory())
        workers.engine.finish_generation(refit_follows=True)  # ... and releases it while the policy trains
    rollouts.policy_version = policy_version
    m["train/prompt_tokens_max"] = float(max((len(p) for p in prompts), default=0))
    return rollouts, m


def _generation_memory() -> dict[str, float]:
    """Where the controller process uses a GPU (an in-process Megatron engine): the device's memory in use as
    generation ends, every process's (the policy's resident part beside the engine: `mrl plan`'s generate column),
    and this process's allocator peak since the last step's; nothing elsewhere."""
    if not torch.cuda.is_initialized():
        return {}
    free, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"memory/generation_device_used_gib": (total - free) / 2**30, "memory/generation_engine_peak_gib": peak}


def learn(
    cfg: MrlConfig, workers: Workers, rollouts: Rollouts, step: int, loss_fn: GRPOLoss, logger: MetricsLogger
) -> dict[str, float]:
    """reward -> advantage -> logprobs -> train on step `step`'s rollouts. Returns the step's training metrics."""
    m: dict[str, float] = {}
    n = cfg.grpo.num_generations_per_prompt
    with logger.timer("reward", m):
        rewards = rollouts.rewards
        if cfg.grpo.overlong_buffer:
            rewards = rewards + overlong_penalty(
                rollouts.response_lengths,
                max_length=cfg.generation.max_new_tokens,
                buffer=cfg.grpo.overlong_buffer,
                penalty=cfg.grpo.overlong_penalty,
            )
        grouped = rewards.view(-1, n)  # [P, G]
        advantages = grpo_advantages(
            grouped, leave_one_out=cfg.grpo.leave_one_out, normalize_std=cfg.grpo.normalize_std
        ).view(-1)
        keep = _groups_kept(grouped, cfg.grpo.dynamic_sampling).repeat_interleave(n)
        keep &= rollouts.loss_mask.sum(dim=1) > 0
        batch = training_rows(rollouts, advantages, keep, _data_parallel(workers))
    m.update(_rollout_metrics(rollouts, keep))
    m.update(per_env_metrics("train", rollouts, n))
    m.update(health_metrics(rollouts, grouped, reads_answers=env_reads_answers(cfg)))
    m["train/staleness"] = float(step - 1 - rollouts.policy_version)  # updates between generating and training
    if not bool(keep.any()):  # nothing to learn from (every group uniform, or every sample lost): no update
        return m
    mismatch: dict[str, float] = {}
    with logger.timer("logprobs", m):
        # pi_old must stay fixed over the step's updates; PPO's KL reward and distillation read it before any
        if len(batch) > _rows_per_update(cfg, workers) or ppo.needs_old_logprobs(cfg):
            batch.token_data[PREV_LOGPROBS] = workers.policy.logprobs(batch)
            mismatch = mismatch_metrics(
                batch.token_data[GENERATION_LOGPROBS], batch.token_data[PREV_LOGPROBS], batch.loss_mask
            )
        if loss_fn.needs_reference or ppo.needs_reference(cfg):
            batch.token_data[REF_LOGPROBS] = workers.policy.logprobs(batch, reference=True)
    row_rewards = rewards[kept_rows(keep, _data_parallel(workers))]  # the batch's rows' rewards
    if not _token_advantages(cfg, workers, batch, row_rewards, step, logger, m):
        return m  # the critic's warm-up: the policy does not train
    with logger.timer("train", m):
        train = train_in_minibatches(workers.policy, batch, loss_fn, _rows_per_update(cfg, workers))
    m.update({f"train/{k}": v for k, v in train.items()})
    # One update per step: pi_old is the training forward's own logprobs (the policy has not moved yet; no second
    # forward), and the mismatch is the loss's (token_mult_prob_error / gen_kl_error weighted like the loss: per
    # sequence at sequence level). Several updates: the per-token means over the batch before any update.
    # Asynchronous: they measure the engine/trainer mismatch plus one update of staleness.
    m.update({f"train/{k}": v for k, v in mismatch.items() if k != "num_tokens"})
    return m


def _token_advantages(
    cfg: MrlConfig,
    workers: Workers,
    batch: RankBatch,
    rewards: torch.Tensor,
    step: int,
    logger: MetricsLogger,
    m: dict[str, float],
) -> bool:
    """PPO's or distillation's per-token advantages into `batch` (mrl/algorithms/ppo.py; `rewards` [N]: each batch
    row's), the critic's updates, their metrics into `m`; whether the policy trains this step (not in the critic's
    warm-up). GRPO's own per-sample advantages stay as they are."""
    if workers.critic is not None:  # PPO: GAE's advantages, then the critic's updates
        with logger.timer("critic", m):
            m.update(ppo.gae_step(cfg, workers.critic, batch, rewards, _rows_per_update(cfg, workers)))
        if ppo.in_critic_warmup(cfg, step):
            m["train/critic_warmup"] = 1.0
            return False
    if workers.teacher is not None:  # distillation: the teacher's logprobs of the student's tokens
        with logger.timer("teacher", m):
            m.update(ppo.distillation_step(cfg, workers.teacher, batch))
    return True


def refit_engine(
    workers: Workers, logger: MetricsLogger, on_sent: Callable[[], None] | None = None
) -> dict[str, float]:
    """Stream the policy's weights into the engine; the refit's metrics (`on_sent`: `Workers.refit`'s)."""
    m: dict[str, float] = {}
    with logger.timer("refit", m):
        refit = workers.refit(on_sent)
    m.update({f"train/refit_{k.split('/')[1]}": v for k, v in refit.as_metrics().items() if k != "timing/refit"})
    return m


def _rollout_metrics(rollouts: Rollouts, keep: torch.Tensor) -> dict[str, float]:
    return {
        "train/reward": float(rollouts.rewards.mean()),
        "train/reward_errors": float(rollouts.num_reward_errors),
        "train/response_length": float(rollouts.response_lengths.float().mean()),
        "train/sequence_length_max": float(
            rollouts.input_ids.shape[1] if rollouts.lengths is None else rollouts.lengths.max()
        ),
        "train/truncated_fraction": float(rollouts.truncated.float().mean()),
        "train/prompts_rejected": float(rollouts.num_prompts_rejected),
        "train/kept_samples": float(keep.sum()),
        **{f"train/{key}": value for key, value in rollouts.counts.items()},
    }


def _groups_kept(grouped_rewards: torch.Tensor, dynamic_sampling: bool) -> torch.Tensor:
    """[P] bool: the groups trained on; with dynamic sampling only those whose rewards are not all equal."""
    if not dynamic_sampling:
        return torch.ones(len(grouped_rewards), dtype=torch.bool)
    keep = torch.zeros(len(grouped_rewards), dtype=torch.bool)
    keep[dynamic_sampling_keep(grouped_rewards)] = True
    return keep


def _data_parallel(workers: Workers) -> int:
    """What a step's rows must be a multiple of: the data-parallel sizes of the groups that take them (the policy's,
    and a critic's or teacher's in a layout of its own)."""
    groups = [workers.policy, workers.critic, workers.teacher]
    return math.lcm(*(group.data_parallel_size for group in groups if group is not None))


def _rows_per_update(cfg: MrlConfig, workers: Workers) -> int:
    """Rows of one optimizer step: `policy.train_global_batch_size`, a multiple of the data-parallel size."""
    dp = _data_parallel(workers)
    return max(cfg.policy.train_global_batch_size, dp) // dp * dp


@dataclass
class _Run:
    """What GRPO's two schedules share: the run's parts, its data stream and loss, where it starts, its stops."""

    cfg: MrlConfig
    workers: Workers
    env: Environment
    val_env: Environment
    data: TaskData
    logger: MetricsLogger
    ckpt: LoopCheckpoints
    loader: PromptDataLoader
    loss_fn: GRPOLoss
    state: Optional[dict]  # the checkpoint resumed from (None: a fresh start)
    guard: NonFiniteGuard
    idle: IdleGuard
    env_errors: EnvironmentErrorGuard

    @property
    def start(self) -> int:
        return int(self.state["step"]) if self.state else 0

    @property
    def last(self) -> int:
        return self.cfg.grpo.max_num_steps

    def produce(self, step: int, problems, version: int) -> tuple[Rollouts, dict[str, float]]:
        return produce_rollouts(self.cfg, self.workers, self.env, self.data, problems, step, self.logger, version)

    def done(self, step: int) -> bool:
        return step == self.last or self.loader.passes_done(self.cfg.grpo.max_num_epochs)

    def validation_due(self, step: int, done: bool) -> bool:
        return done or bool(self.cfg.grpo.val_every and step % self.cfg.grpo.val_every == 0)

    def validate(self, step: int) -> dict[str, float]:
        return run_validation(self.cfg, self.workers, self.val_env, self.data, step)

    def learn(self, step: int, rollouts: Rollouts, metrics: dict[str, float]) -> bool:
        """Train on the step's rollouts and judge the step (non-finite, idle); whether its update was skipped."""
        metrics.update(learn(self.cfg, self.workers, rollouts, step, self.loss_fn, self.logger))
        skipped = self.guard.observe(step, metrics)  # a non-finite step changed no weight: nothing to refit
        causes = step_causes(self.cfg, metrics, rollouts)
        self.idle.observe(step, causes)
        self.env_errors.observe(step, metrics, rollouts)
        metrics["train/health_warnings"] = float(len(causes))
        metrics["train/idle"] = float(any(cause.idle for cause in causes))
        return skipped

    def end_step(self, step: int, metrics: dict[str, float], started: float, done: bool, in_flight) -> bool:
        """Log, stop (non-finite first, then idle: before the save, an idle step's checkpoint would only renumber
        the start), save when due with the rollouts in flight (`in_flight()`), and whether the loop ends."""
        metrics["train/engine_restarts"] = float(self.workers.engine_restarts)

        def state() -> dict:
            return {"dataloader": self.loader.state_dict(), "in_flight": in_flight()}

        return end_step(
            step,
            self.last,
            metrics,
            started=started,
            done=done,
            logger=self.logger,
            ckpt=self.ckpt,
            stops=[self.guard, self.env_errors, self.idle],
            state=state,
        )


def grpo_train(
    cfg: MrlConfig,
    workers: Workers,
    env: Environment,
    data: TaskData,
    logger: MetricsLogger,
    ckpt: LoopCheckpoints,
    *,
    val_env: Environment | None = None,
) -> dict[str, float]:
    """The whole GRPO run (resumes from the newest checkpoint when there is one). Returns the final metrics.
    `val_env` scores validation (default `env`; with a reward model as the training reward, the task's verifier).
    `grpo.max_off_policy_steps: 1` generates step n+1 while step n trains (mrl/algorithms/ahead.py)."""
    if not data.val:
        print("[mrl] no validation problems (data.val / eval.data): validation is skipped", file=sys.stderr)
    run = _Run(
        cfg,
        workers,
        env,
        val_env or env,
        data,
        logger,
        ckpt,
        loader=PromptDataLoader(data.train, cfg.grpo.num_prompts_per_step, seed=cfg.run.seed),
        loss_fn=GRPOLoss(**cfg.loss.model_dump()),  # loss.* are GRPOLoss's fields
        state=ckpt.resume_newest(cfg.grpo.max_num_steps, "grpo.max_num_steps"),
        guard=NonFiniteGuard(cfg.policy.max_nonfinite_steps),
        idle=IdleGuard(cfg.grpo.max_idle_steps),
        env_errors=EnvironmentErrorGuard(cfg.grpo.max_env_error_fraction),
    )
    if run.state:
        run.loader.load_state_dict(run.state["dataloader"])
        workers.refit()  # the engine gets the resumed weights
    else:
        logger.log(run.validate(0), step=0)
    return _one_step_ahead(run) if cfg.grpo.max_off_policy_steps else _synchronous(run)


def _synchronous(run: _Run) -> dict[str, float]:
    """Each step generates from the weights after the step before, trains, then refits the engine."""
    final: dict[str, float] = {}
    for step in range(run.start + 1, run.last + 1):
        started = time.perf_counter()
        rollouts, metrics = run.produce(step, next(run.loader), step - 1)
        done = run.done(step)
        if not run.learn(step, rollouts, metrics):
            metrics.update(refit_engine(run.workers, run.logger))
        if run.validation_due(step, done):
            metrics.update(run.validate(step))
        final = metrics
        if run.end_step(step, metrics, started, done, in_flight=lambda: None):
            break
    return final


def _one_step_ahead(run: _Run) -> dict[str, float]:
    """Step n+1 generates (from the weights before step n) while step n trains; validation waits for it and refits
    the engine with the newest weights first (mrl/algorithms/ahead.py)."""
    ahead = RolloutsAhead(
        run.produce, lambda on_sent: refit_engine(run.workers, run.logger, on_sent), engine_version=run.start
    )
    if run.state:
        ahead.load_state_dict(run.state.get("in_flight"))
    final: dict[str, float] = {}
    try:
        for step in range(run.start + 1, run.last + 1):
            started = time.perf_counter()
            rollouts, metrics = ahead.take(step, lambda: next(run.loader))
            done = run.done(step)
            if not done:  # step + 1 generates (from the weights before this step) ...
                ahead.start(step + 1, next(run.loader), policy_version=step - 1)
            run.learn(step, rollouts, metrics)  # ... while this step trains
            if run.validation_due(step, done):
                metrics.update(ahead.update_engine(step))
                metrics.update(run.validate(step))
            final = metrics
            if run.end_step(step, metrics, started, done, in_flight=ahead.state_dict):
                break
    finally:
        ahead.close()
    return final
