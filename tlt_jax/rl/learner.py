"""The RL step: rollout -> rewards -> advantages -> reference log-probs -> update -> sync.

`Learner.step` reads top to bottom as that data flow; each stage is a small module of
tlt_jax/rl. The learner owns the mutable side of a run (policy state, prompt stream,
bandit), everything it needs to checkpoint and resume.
"""
from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tlt_jax.distributed.collectives import allgather_json, local_copy
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.tokenizer import Tokenizer
from tlt_jax.models.transformer import Params
from tlt_jax.rl import advantages as adv
from tlt_jax.rl.batching import Sequences
from tlt_jax.rl.config import AdvantageConfig, OverlongConfig
from tlt_jax.rl.rewards import RewardItem, RewardPool, require_some_scored
from tlt_jax.rl.idle_drafter import IdleDrafter
from tlt_jax.rl.replicas import Replicas, gather_scored
from tlt_jax.rl.rollout import GroupRollouts, RolloutSettings, lay_out_for_rollout, sample_groups
from tlt_jax.rl.scored import ScoredGroups, merge_scored, select
from tlt_jax.rl.update import (PolicyState, UpdateContext, program_totals, score_sequences,
                               update_policy)
from tlt_jax.rollout import engine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecMemory
from tlt_jax.rollout.weights import DraftWeights


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What one RL step does besides the model: how many prompts, how groups are scored and
  filtered."""
  prompts_per_step: int
  advantage: AdvantageConfig = AdvantageConfig()
  overlong: OverlongConfig = OverlongConfig()
  dynamic_sampling: bool = False
  max_rollout_batches: int = 4       # DAPO: generation batches drawn per step at most
  seed: int = 0


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _nothing() -> None:
  pass


class Learner:
  """One run's state and stages. `step(n)` runs RL step n (1-based).

  `between_phases` runs once a step, after the rollout's and the reference's buffers are
  freed and before the update allocates its own: the seam for host-level tuning, which the
  entry point owns (experiments pass `tlt_jax.runtime.host.return_free_heap`).
  """

  def __init__(self, *, config: ModelConfig, tokenizer: Tokenizer, state: PolicyState,
               ref_params: Params | None, stream, rollout: RolloutSettings,
               step_config: StepConfig, update: UpdateContext, rewards: RewardPool,
               drafter: DraftWeights | None = None,
               between_phases: Callable[[], None] = _nothing,
               replicas: Replicas = Replicas(), idle_drafter: IdleDrafter | None = None):
    self.config, self.tokenizer = config, tokenizer
    self.state, self.ref_params, self.stream = state, ref_params, stream
    self.rollout, self.step_config, self.update = rollout, step_config, update
    self.rewards = rewards
    self.between_phases = between_phases
    self.replicas = replicas
    # The learned drafter's weights (a rollout argument) and what SD learns across steps;
    # with an online drafter, the drafter trained on idle replicas that replaces it.
    self.drafter = drafter
    self.idle_drafter = idle_drafter
    self.spec_memory = None if rollout.spec is None else SpecMemory(rollout.spec)
    self.rollout_params = self.sync_weights(state.params)

  def host_state(self) -> dict[str, Any]:
    """What a checkpoint keeps besides the policy state (JSON-serializable): the prompt
    stream's position and what SD has learned, one entry per replica (each replica's bandit
    learns from its own rollouts). With several replicas a collective: every process calls
    it."""
    spec = None if self.spec_memory is None else self.spec_memory.state_dict()
    return {"stream": self.stream.state(), "spec": allgather_json(spec)}

  def restore(self, state: PolicyState, host_state: dict[str, Any]) -> None:
    """Continues from a checkpoint: its policy state and `host_state`; the rollout gets the
    restored policy."""
    self.state = state
    self.stream.restore(host_state["stream"])
    spec = host_state.get("spec")
    if isinstance(spec, list):               # one per replica (a dict: one for every replica)
      spec = spec[self.replicas.index]
    if self.spec_memory is not None and spec is not None:
      self.spec_memory.load_state_dict(spec)
    self.rollout_params = self.sync_weights(state.params)

  # ---- the step -------------------------------------------------------------------------

  def step(self, step: int) -> dict[str, Any]:
    record: dict[str, Any] = {"step": step}
    start = time.perf_counter()
    programs_before = compile_totals()

    scored = self.collect_groups(step, record)                     # rollout + rewards
    if self.idle_drafter is not None:                              # drafter gate + sync
      self.drafter, drafter_metrics = self.idle_drafter.at_step_end(
          step, record.get("spec/accept_len"))
      record.update(drafter_metrics)
    self.rollout_params = None    # the sync below lays the updated params out afresh
    group_size = self.rollout.group_size
    advantages = adv.group_advantages(scored.rewards, self.step_config.advantage)
    batch = scored.rollouts
    sequences = Sequences(batch.prompts, batch.responses)
    in_loss = self.loss_mask(batch)

    t = time.perf_counter()                                        # reference log-probs
    ref_logp = (score_sequences(self.ref_params, sequences, self.update)
                if self.update.loss.uses_reference else None)
    record["timing/reference_s"] = time.perf_counter() - t

    self.between_phases()         # the rollout's and reference's buffers are freed
    t = time.perf_counter()                                        # policy update
    self.state, update_metrics = update_policy(
        self.state, sequences, advantages.reshape(-1), batch.logprobs, ref_logp, in_loss,
        self.update, seed=self.step_seed(step, "update"))
    jax.block_until_ready(self.state.params)
    record["timing/train_s"] = time.perf_counter() - t
    record.update(update_metrics)

    t = time.perf_counter()                                        # weight sync
    self.rollout_params = jax.block_until_ready(self.sync_weights(self.state.params))
    record["timing/sync_s"] = time.perf_counter() - t

    record.update(self.batch_metrics(scored, group_size))
    record["actor/lr"] = float(self.learning_rate())
    record.update(compile_metrics(programs_before, compile_totals()))
    record["timing/step_s"] = time.perf_counter() - start
    trained = int(sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)))
    record["perf/tokens_per_s"] = trained / record["timing/step_s"]
    record["perf/train_tokens"] = trained
    record["mem/peak_rss_gib"] = peak_rss_gib()
    return record

  # ---- stages ---------------------------------------------------------------------------

  def collect_groups(self, step: int, record: dict[str, Any]) -> ScoredGroups:
    """Rollout and rewards; with DAPO dynamic sampling, more prompt batches are drawn until
    `prompts_per_step` groups have unequal rewards, or `max_rollout_batches` is hit and the
    batch is topped up with uninformative (zero-advantage) groups."""
    cfg = self.step_config
    fill = adv.GroupFill(target_groups=cfg.prompts_per_step,
                         max_draws=cfg.max_rollout_batches if cfg.dynamic_sampling else 1)
    draws: list[ScoredGroups] = []
    rollout_s = reward_s = 0.0
    while not fill.done:
      items = self.stream.next_batch()
      scored, times = self.sample_and_score(items, self.rollout,
                                            self.step_seed(step, f"rollout{len(draws)}"),
                                            idle_round=(step, len(draws)))
      rollout_s += times["rollout_s"]
      reward_s += times["reward_s"]
      if not draws:
        record.update(rollout_stats(scored.rollouts.stats))
        record.update(self.replica_metrics(times))
      draws.append(scored)
      informative = adv.informative_groups(draws[-1].rewards)
      fill = fill.add_draw(informative if cfg.dynamic_sampling else np.ones_like(informative))
    picked = fill.selection(pad=True)
    record.update({"timing/rollout_s": rollout_s, "timing/reward_s": reward_s,
                   "data/rollout_batches": picked.num_draws,
                   "data/prompts_drawn": sum(len(d.items) for d in draws),
                   "data/filler_groups": picked.num_padded,
                   "reward/timeouts": sum(d.timeouts for d in draws),
                   "reward/errors": sum(d.errors for d in draws)})
    first_error = next((d.first_error for d in draws if d.first_error), None)
    if first_error:
      print(f"warning: step {step}: a reward function failed: {first_error}", file=sys.stderr)
    return merge_scored([select(draws[d], [g], self.rollout.group_size)
                         for d, g in picked.groups])

  def sample_and_score(self, items: list, settings: RolloutSettings, seed: int,
                       idle_round: tuple[int, int] | None = None,
                       buffer_step: int | None = None) -> tuple[ScoredGroups, dict[str, Any]]:
    """This replica's block of `items` sampled and scored, then every replica's block
    gathered (`replicas.gather_scored`): all of `items`, scored, on every process. Also
    returns this replica's rollout and reward seconds, the gather's wait and each replica's
    rollout seconds. With an online drafter, a replica done before the others trains it
    until they are (`idle_round`: the step and its draw; its metrics come at the step
    end), or only buffers this replica's responses as step `buffer_step`'s."""
    mine = items[self.replicas.block(len(items))]
    t = time.perf_counter()
    rollouts = sample_groups(self.rollout_params, self.config, [i.prompt_ids for i in mine],
                             settings, seed=self.replicas.seed(seed), drafter=self.drafter,
                             memory=self.spec_memory)
    rollout_s = time.perf_counter() - t
    t = time.perf_counter()
    local = self.score(rollouts, mine, group_size=settings.group_size)
    reward_s = time.perf_counter() - t
    if self.idle_drafter is not None and idle_round is not None:
      self.idle_drafter.while_idle(*idle_round, rollouts, self.rollout_params)
    elif self.idle_drafter is not None and buffer_step is not None:
      self.idle_drafter.observe(buffer_step, rollouts)
    t = time.perf_counter()
    scored, per_replica = gather_scored(
        local, items, self.replicas, settings.group_size, settings.max_new_tokens,
        {"rollout_s": rollout_s, "tokens": rollouts.stats["generated_tokens"]})
    return scored, {"rollout_s": rollout_s, "reward_s": reward_s,
                    "gather_s": time.perf_counter() - t,
                    "replica_rollout_s": per_replica["rollout_s"],
                    "replica_tokens": per_replica["tokens"]}

  def replica_metrics(self, times: dict[str, Any]) -> dict[str, Any]:
    """With several replicas: the tokens all generated, each one's rollout seconds, the
    gather's wait here, and the replica-seconds spent waiting for the slowest (what the
    long tail leaves idle). The engine's other stats (tail, live rows, SD) stay this
    replica's own."""
    if self.replicas.count == 1:
      return {}
    per_replica = times["replica_rollout_s"]
    return {"rollout/generated_tokens": int(times["replica_tokens"].sum()),
            "rollout/replica_s": [float(s) for s in per_replica],
            "rollout/replica_idle_s": float(np.sum(per_replica.max() - per_replica)),
            "timing/gather_s": times["gather_s"]}

  def score(self, rollouts: GroupRollouts, items: Sequence,
            group_size: int | None = None) -> ScoredGroups:
    g = group_size or self.rollout.group_size
    eos = set(self.rollout.eos_ids)
    reward_items = []
    for row, response in enumerate(rollouts.responses):
      item = items[row // g]
      text = self.tokenizer.decode([t for t in response if t not in eos])
      reward_items.append(RewardItem(response=text, ground_truth=item.record.ground_truth,
                                     data_source=item.record.data_source,
                                     extra_info=item.record.extra_info))
    result = self.rewards.score(reward_items)
    require_some_scored(result, self.rewards.spec.name)
    penalty = adv.overlong_penalty(rollouts.response_lengths, self.rollout.max_new_tokens,
                                   self.step_config.overlong)
    shape = (len(items), g)
    return ScoredGroups(rollouts=rollouts, rewards=(result.rewards + penalty).reshape(shape),
                        accuracy=(result.scores >= 1.0).reshape(shape), items=list(items),
                        timeouts=result.timeouts, errors=result.errors,
                        first_error=result.first_error)

  def loss_mask(self, batch: GroupRollouts) -> np.ndarray:
    """Sequences in the loss: all, or (overlong `mask`) those that ended before the cap."""
    if self.step_config.overlong.mode == "mask":
      return ~batch.truncated
    return np.ones(len(batch.responses), bool)

  def sync_weights(self, params: Params) -> Params:
    """New policy -> the rollout engine, with no recompilation (`lay_out_for_rollout`);
    with several replicas each takes its own copy of the policy (`local_copy`)."""
    return lay_out_for_rollout(local_copy(params), self.config, self.rollout,
                               self.update.compute_dtype)

  def evaluate(self, val_items: Sequence, step: int) -> dict[str, float]:
    """Greedy answers to the held-out prompts: `val/reward`, `val/accuracy`, and both per
    data source (`val/accuracy/<source>`). With an online drafter each replica's answers,
    the current policy's with hidden states already computed, go to its drafter's buffer
    as step `step`'s: what step 1's idle replica replays, before any step has rolled out
    (a drafter never changes what the policy emits, so the answers stay a fair test)."""
    settings = dataclasses.replace(self.rollout, group_size=1, sampling=SamplingParams(0.0))
    scored, _ = self.sample_and_score(list(val_items), settings, seed=step, buffer_step=step)
    metrics = {"val/reward": float(scored.rewards.mean()),
               "val/accuracy": float(scored.accuracy.mean()),
               "val/prompts": len(val_items)}
    sources = np.array([i.record.data_source for i in val_items])
    for source in sorted(set(sources)):
      metrics[f"val/accuracy/{source}"] = float(scored.accuracy[sources == source].mean())
      metrics[f"val/reward/{source}"] = float(scored.rewards[sources == source].mean())
    return metrics

  # ---- helpers ---------------------------------------------------------------------------

  def step_seed(self, step: int, stage: str) -> int:
    """Stateless per-(step, stage) seeds: a resumed run draws exactly what it would have."""
    return int(np.random.SeedSequence([self.step_config.seed, step,
                                       *stage.encode()]).generate_state(1)[0])

  def learning_rate(self) -> float:
    return self.update.learning_rate(int(self.state.step))

  def batch_metrics(self, scored: ScoredGroups, group_size: int) -> dict[str, float]:
    lengths = scored.rollouts.response_lengths
    return {
        "reward/mean": float(scored.rewards.mean()),
        "reward/std": float(scored.rewards.std()),
        "reward/accuracy": float(scored.accuracy.mean()),
        "reward/informative_groups": int(adv.informative_groups(scored.rewards).sum()),
        "response_len/mean": float(lengths.mean()), "response_len/max": int(lengths.max()),
        "response_len/p50": float(np.percentile(lengths, 50)),
        "response_len/p90": float(np.percentile(lengths, 90)),
        "response_len/clip_frac": float(scored.rollouts.truncated.mean()),
    }


def compile_totals() -> dict[str, int]:
  """The rollout's and the update's programs so far: built, loaded from the persistent
  compilation cache, written to it (`CompileCounter.totals`)."""
  rollout, update = engine.program_totals(), program_totals()
  return {name: rollout[name] + update[name] for name in rollout}


def compile_metrics(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
  """`compile/programs` (built so far), and the step's `compile/new_programs` (built),
  `compile/cache_hits` (loaded from the persistent compilation cache instead) and
  `compile/cache_misses` (built and written to it)."""
  return {"compile/programs": after["programs"],
          "compile/new_programs": after["programs"] - before["programs"],
          "compile/cache_hits": after["cache_hits"] - before["cache_hits"],
          "compile/cache_misses": after["cache_misses"] - before["cache_misses"]}


def rollout_stats(stats: dict) -> dict[str, Any]:
  """The engine's rollout stats under DESIGN section 7's names."""
  out = {"rollout/tail_s": stats["rollout/tail_s"],
         "rollout/live_rows_trace": stats["rollout/live_rows"],
         "rollout/generated_tokens": stats["generated_tokens"],
         "rollout/tokens_per_s": stats["tokens_per_s"],
         "compile/rollout_new_programs": stats["compile/new_programs"]}
  # The row budget (--rollout_max_rows): rows held at most and the refills.
  out.update({key: stats[key] for key in ("rollout/max_rows", "rollout/peak_rows",
                                          "rollout/admission_waves", "rollout/kv_cache_bytes")})
  for key in ("spec/accept_len", "spec/enabled_frac", "spec/verify_steps", "spec/strategy"):
    if key in stats:
      out[key] = stats[key]
  return out
