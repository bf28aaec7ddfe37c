"""The policy update: gradients accumulated over packed micro-batches, then one optax step.

Each token carries its mini-batch aggregation weight (`losses.sequence_weights`), so the
sum of micro-batch losses is the mini-batch loss exactly and accumulation needs no
rescaling. With a compute dtype (bfloat16) each forward runs in it over the float32 master
weights, while gradients and AdamW state stay float32 (`precision`). Programs:
`accumulate_grads` and `score_rows` per micro-batch shape, `apply_grads` once; all are
counted by `compiled_programs` and built ahead by `precompile_training`. Under
data-parallel rules each data shard accumulates its own gradient and the optimizer step
sums them, one all-reduce per optimizer step (`sharding.data_parallel`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax.compiles import CompileCounter
from tlt_jax.distributed.collectives import to_host
from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params
from tlt_jax.rl import logprobs
from tlt_jax.rl.batching import (Sequences, TrainRows, empty_rows, gather_response_values,
                                  micro_batches, pack_tight, possible_shapes)
from tlt_jax.rl.config import LossConfig
from tlt_jax.rl.logprobs import score_rows
from tlt_jax.rl.losses import policy_loss, sequence_weights
from tlt_jax.rl.precision import compute_params
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import data_parallel
from tlt_jax.sharding.rules import MeshRules, param_logical_axes, tree_shardings


@flax.struct.dataclass
class PolicyState:
  params: Params
  opt_state: optax.OptState
  step: jax.Array            # int32: optimizer steps taken


def init_policy_state(params: Params, ctx: "UpdateContext") -> PolicyState:
  """Fresh optimizer state, placed like the params (see `place_state`)."""
  init = lambda p: place_state(PolicyState(params=p, opt_state=ctx.optimizer.init(p),
                                           step=jnp.int32(0)),
                               ctx.optimizer, ctx.config, ctx.rules)
  return jax.jit(init)(params)


def place_state(state: PolicyState, optimizer: optax.GradientTransformation,
                config: ModelConfig | None, rules: MeshRules | None) -> PolicyState:
  """Pins (inside a jitted function) the params and every param-shaped optimizer buffer to
  the params' rule-given shardings, the rest replicated. Without it XLA picks the outputs'
  layouts itself: the next call then sees new input shardings and compiles again, and the
  rollout's programs too, once the params come back laid out differently."""
  if rules is None:
    return state
  shardings = tree_shardings(param_logical_axes(config), state.params, rules)
  replicated = NamedSharding(rules.mesh, PartitionSpec())
  pin = jax.lax.with_sharding_constraint
  return PolicyState(
      params=jax.tree.map(pin, state.params, shardings),
      opt_state=optax.tree_map_params(optimizer, pin, state.opt_state, shardings,
                                      transform_non_params=lambda x: pin(x, replicated)),
      step=pin(state.step, replicated))


def _micro_loss(params, rows: TrainRows, config, sampling, loss, rules, remat, compute_dtype):
  # The cast is inside the differentiated function: the gradient reaches the master weights
  # in their own dtype.
  logp, entropy = logprobs.token_logprobs(compute_params(params, compute_dtype), config, rows,
                                          sampling, rules, remat)
  value, metrics = policy_loss(
      logp, rows.old_logp, rows.advantages, rows.loss_weights, rows.metric_weights, loss,
      ref_logp=rows.ref_logp if loss.uses_reference else None, entropy=entropy,
      rollout_logp=rows.rollout_logp)
  # How far the trainer's log-probs are from the rollout's (verl's rollout-correction
  # metrics); meaningful on the first update of a step, before the params move.
  diff = jnp.where(rows.metric_weights > 0, jnp.abs(logp - rows.rollout_logp), 0.0)
  metrics["rollout/logprob_diff_mean"] = jnp.sum(rows.metric_weights * diff)
  metrics["rollout/logprob_diff_max"] = jnp.max(diff)
  metrics["actor/loss"] = value
  return value, metrics


@functools.partial(jax.jit, static_argnames=("config", "sampling", "loss", "rules", "remat",
                                             "compute_dtype"),
                   donate_argnames=("grads",))
def accumulate_grads(params: Params, grads: Params, rows: TrainRows, *, config: ModelConfig,
                     sampling: SamplingParams, loss: LossConfig,
                     rules: MeshRules | None = None, remat: bool = False,
                     compute_dtype: str | None = None) -> tuple[Params, dict[str, jax.Array]]:
  """grads + d(micro-batch loss)/d(params), and the micro-batch's metric sums; the forward
  runs in compute_dtype (None: the params' dtype), the gradient comes in the params'. With
  several data shards, `grads` has a leading data axis and each shard adds to its own
  slice: over the data axis only the metrics are reduced (`zero_grads`, `apply_grads`)."""
  def micro(params, rows, rules):
    return jax.grad(_micro_loss, has_aux=True)(params, rows, config, sampling, loss, rules,
                                               remat, compute_dtype)
  if data_parallel.data_shards(rules) == 1:
    micro_grads, metrics = micro(params, rows, rules)
    return jax.tree.map(jnp.add, grads, micro_grads), metrics

  def in_shard(params, grads, rows, rules):
    micro_grads, metrics = micro(params, rows, rules)
    return (jax.tree.map(lambda g, m: g + m[None], grads, micro_grads),
            _metrics_over_shards(metrics))
  sharded, whole = data_parallel.SHARDED, data_parallel.WHOLE
  return data_parallel.per_shard(in_shard, rules, in_specs=(whole, sharded, sharded),
                                 out_specs=(sharded, whole))(params, grads, rows)


def _is_max(metric: str) -> bool:
  """Whether a metric combines over micro-batches and shards by max (else by sum)."""
  return metric.endswith("_max")


def _metrics_over_shards(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Every shard's metric sums combined over the data shards: one psum of the stacked sums
  and one pmax of the maxima (each collective costs a round trip)."""
  out = {}
  for reduce, keys in ((jax.lax.psum, [k for k in metrics if not _is_max(k)]),
                       (jax.lax.pmax, [k for k in metrics if _is_max(k)])):
    if keys:
      values = reduce(jnp.stack([metrics[k] for k in keys]), data_parallel.DATA_AXIS)
      out.update({k: values[i] for i, k in enumerate(keys)})
  return out


def zero_grads(params: Params, rules: MeshRules | None = None) -> Params:
  """The accumulator a mini-batch starts from (apply_grads consumes the last one), laid out
  like the params, as `accumulate_grads` returns it: every micro-batch then calls the same
  program (a jitted zeros_like would leave its layout to XLA, and the first call's
  differ). With several data shards: one slice per shard, on a leading data axis."""
  shards = data_parallel.data_shards(rules)
  if shards == 1:
    return jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding), params)
  return jax.tree.map(lambda p: jnp.zeros((shards, *p.shape), p.dtype,
                                          device=data_parallel.with_data_axis(p, rules)),
                      params)


@functools.partial(jax.jit, static_argnames=("optimizer", "config", "rules"),
                   donate_argnames=("state",))
def apply_grads(state: PolicyState, grads: Params, *, optimizer: optax.GradientTransformation,
                config: ModelConfig | None = None, rules: MeshRules | None = None
                ) -> tuple[PolicyState, jax.Array]:
  """One optimizer step; returns the new state (laid out as it came) and the gradient's
  global norm (before clipping). Data shards' gradients are summed first: the step's one
  all-reduce."""
  if data_parallel.data_shards(rules) > 1:
    grads = jax.tree.map(lambda g: jnp.sum(g, axis=0), grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = PolicyState(params=params, opt_state=opt_state, step=state.step + 1)
  return place_state(new_state, optimizer, config, rules), grad_norm


_COMPILES = CompileCounter((accumulate_grads, apply_grads, score_rows))


def compiled_programs() -> int:
  """Training programs compiled so far (process-wide)."""
  return _COMPILES.count


def program_totals() -> dict[str, int]:
  """Training programs so far, built and loaded from the persistent compilation cache
  (`CompileCounter.totals`)."""
  return _COMPILES.totals()


def precompile_training(state: PolicyState, ctx: "UpdateContext") -> int:
  """Compiles, without running them, the programs every update can dispatch: a
  micro-batch's gradient (and, when a step scores without one: the reference with KL on,
  the old policy with several updates a step, its log-probs) at each micro-batch shape,
  and the optimizer step. Returns how many were new. Compiling ahead of time fills the
  same cache the calls use."""
  before = compiled_programs()
  score = ctx.loss.uses_reference or ctx.update.updates_per_step > 1
  grads = zero_grads(state.params, ctx.rules)
  static = dict(config=ctx.config, sampling=ctx.sampling, rules=ctx.rules,
                compute_dtype=ctx.compute_dtype)
  for count, length, scored in possible_shapes(ctx.update.micro_batch_rows,
                                               ctx.update.train_seq_len, ctx.data_shards):
    rows = empty_rows(count, length, scored)
    accumulate_grads.lower(state.params, grads, rows, loss=ctx.loss, remat=ctx.update.remat,
                           **static).compile()
    if score:
      score_rows.lower(state.params, rows, **static).compile()
  apply_grads.lower(state, grads, optimizer=ctx.optimizer, config=ctx.config,
                    rules=ctx.rules).compile()
  return compiled_programs() - before


# ---- host side: epochs, mini-batches, micro-batches ---------------------------------------

@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """How a step's responses become optimizer steps: `ppo_epochs` passes over them, each in
  `num_mini_batches` optimizer steps, each accumulated over micro-batches of
  `micro_batch_rows` packed rows of `train_seq_len` slots. `skip_zero_advantage` leaves
  out of the forward and backward the sequences whose gradient is exactly zero
  (`moving_sequences`): the same step, less compute; the per-token metrics (entropy, clip
  fractions, ratios) are then over the tokens trained."""
  ppo_epochs: int = 1
  num_mini_batches: int = 1
  micro_batch_rows: int = 8
  train_seq_len: int = 256
  remat: bool = False
  skip_zero_advantage: bool = True

  def __post_init__(self):
    for name in ("ppo_epochs", "num_mini_batches", "micro_batch_rows"):
      if getattr(self, name) < 1:
        raise UserInputError(f"--{name}={getattr(self, name)}: must be >= 1")
    if self.train_seq_len < 2:
      raise UserInputError(f"--train_seq_len={self.train_seq_len}: must be >= 2")

  @property
  def updates_per_step(self) -> int:
    return self.ppo_epochs * self.num_mini_batches


@dataclasses.dataclass(frozen=True)
class UpdateContext:
  """The static side of an update: model, sampling, loss, optimizer, sharding."""
  config: ModelConfig
  sampling: SamplingParams
  loss: LossConfig
  update: UpdateConfig
  optimizer: optax.GradientTransformation
  learning_rate: optax.Schedule      # the optimizer's, by optimizer step, for metrics
  max_response_len: int
  rules: MeshRules | None = None
  # The dtype every forward computes in over the params (float32 master weights), e.g.
  # "bfloat16" on accelerators (`precision`); None: the params' own.
  compute_dtype: str | None = None

  def __post_init__(self):
    data_parallel.check_micro_batch_rows(self.update.micro_batch_rows, self.rules)

  @property
  def data_shards(self) -> int:
    """Shards that accumulate their own gradients (`sharding.data_parallel`)."""
    return data_parallel.data_shards(self.rules)


def _layout(sequences: Sequences, indices: Sequence[int], ctx: UpdateContext):
  return pack_tight(sequences, indices, ctx.update.train_seq_len, ctx.update.micro_batch_rows,
                    ctx.data_shards)


def moving_sequences(advantages: np.ndarray, in_loss: np.ndarray, loss: LossConfig
                     ) -> np.ndarray:
  """Which sequences can move the policy: those in the loss with a nonzero advantage, or
  all in the loss when a KL or entropy term gives every token a gradient. A zero-advantage
  token's clipped surrogate is 0 at every ratio, so its gradient is exactly 0: a GRPO group
  whose rewards all tie (and a DAPO filler group) adds nothing to the step but compute.
  Its tokens still count in the loss's normalizer (`sequence_weights` sees every sequence
  in the loss), so leaving it out changes the gradient only by summation order."""
  in_loss = np.asarray(in_loss, bool)
  if loss.kl_coef > 0 or loss.entropy_coef > 0:
    return in_loss
  return in_loss & (np.asarray(advantages) != 0)


def score_sequences(params: Params, sequences: Sequences, ctx: UpdateContext,
                    indices: Sequence[int] | None = None) -> list[np.ndarray | None]:
  """Per-sequence log-probs of every response token under `params` (no gradient), of the
  sequences `indices` (default all; the others' entries are None)."""
  indices = range(len(sequences)) if indices is None else indices
  if not len(indices):
    return [None] * len(sequences)
  layout = _layout(sequences, indices, ctx)
  values = [score_rows(params, rows, config=ctx.config, sampling=ctx.sampling,
                       rules=ctx.rules, compute_dtype=ctx.compute_dtype)
            for rows in micro_batches(layout, sequences, ctx.update.micro_batch_rows, {}, {},
                                      shards=ctx.data_shards)]
  return gather_response_values(layout, sequences, to_host(values))


def logprob_gap(trainer_logp: Sequence[np.ndarray], rollout_logp: Sequence[np.ndarray],
                in_loss: np.ndarray) -> dict[str, float]:
  """`rollout/logprob_diff_{mean,max}` over the tokens of sequences in the loss (none
  without such a sequence)."""
  diffs = [np.abs(a - b) for a, b, keep in zip(trainer_logp, rollout_logp, in_loss) if keep]
  if not diffs:
    return {}
  flat = np.concatenate(diffs)
  return {"rollout/logprob_diff_mean": float(flat.mean()),
          "rollout/logprob_diff_max": float(flat.max())}


def minibatch_grads(params: Params, sequences: Sequences, mini_batch: Sequence[int],
                    advantages: np.ndarray, per_token: dict[str, Sequence[np.ndarray]],
                    in_loss: np.ndarray, ctx: UpdateContext,
                    loss: LossConfig | None = None, trained: np.ndarray | None = None
                    ) -> tuple[Params, dict[str, float]]:
  """The gradient of one mini-batch's loss (sequences `mini_batch`), accumulated over its
  packed micro-batches, and its metric sums; with several data shards, each shard's part
  of it on a leading data axis, which `apply_grads` sums. Only the sequences `trained`
  marks (default: those in the loss) are computed; the loss's normalizer counts every
  sequence in the loss. `loss` overrides the program's LossConfig (the aggregation mode
  only shapes the host-side weights, never the program)."""
  n = len(sequences)
  trained = np.asarray(in_loss if trained is None else trained, bool)
  masked_lengths = np.array([len(r) for r in sequences.responses]) * in_loss
  weights = np.zeros(n, np.float32)
  weights[mini_batch] = sequence_weights(masked_lengths[mini_batch], ctx.loss.loss_agg_mode,
                                         ctx.max_response_len)
  computed = [i for i in mini_batch if trained[i]]
  tokens = max(int(masked_lengths[computed].sum()), 1)
  layout = _layout(sequences, computed, ctx)
  grads = zero_grads(params, ctx.rules)
  sums: list[dict[str, jax.Array]] = []
  filled = slots = 0
  for rows in micro_batches(layout, sequences, ctx.update.micro_batch_rows, per_token,
                            per_sequence={"advantages": advantages, "loss_weights": weights,
                                          "metric_weights": trained.astype(np.float32) / tokens},
                            shards=ctx.data_shards):
    grads, micro_metrics = accumulate_grads(params, grads, rows, config=ctx.config,
                                            sampling=ctx.sampling, loss=loss or ctx.loss,
                                            rules=ctx.rules, remat=ctx.update.remat,
                                            compute_dtype=ctx.compute_dtype)
    sums.append(micro_metrics)
    filled, slots = filled + int(np.count_nonzero(rows.segment_ids)), slots + rows.tokens.size
  sums = jax.device_get(sums)
  # With every sequence skipped the loss is exactly 0; the other sums have no token.
  merged = ({k: (max if _is_max(k) else sum)(m[k] for m in sums) for k in sums[0]} if sums
            else {"actor/loss": 0.0, "actor/pg_loss": 0.0})
  merged["train/micro_batches"] = len(sums)
  merged["train/rows"] = layout.num_rows
  merged["train/token_slots"], merged["train/slots"] = filled, slots   # the rest is padding
  return grads, merged


def update_policy(state: PolicyState, sequences: Sequences, advantages: np.ndarray,
                  rollout_logp: Sequence[np.ndarray], ref_logp: Sequence[np.ndarray] | None,
                  in_loss: np.ndarray, ctx: UpdateContext, seed: int
                  ) -> tuple[PolicyState, dict[str, float]]:
  """Every optimizer step of one RL step; returns the new state and the update's metrics
  (means over its optimizer steps).

  With one update per step the ratio's `old` side is the rollout's own log-probs (the
  params have not moved since the rollout); with several it is the trainer's log-probs
  before the first update, so every update sees one fixed `old` policy. Every optimizer
  step runs, even one whose sequences all have a zero gradient (weight decay moves)."""
  n = len(sequences)
  trained = (moving_sequences(advantages, in_loss, ctx.loss) if ctx.update.skip_zero_advantage
             else np.asarray(in_loss, bool))
  if ref_logp is None:
    ref_logp = [np.zeros(len(r), np.float32) for r in sequences.responses]
  metrics: dict[str, float] = {"train/skipped_sequences": int(np.sum(in_loss) - trained.sum())}
  if ctx.update.updates_per_step == 1:
    old_logp = rollout_logp
  else:
    old_logp = score_sequences(state.params, sequences, ctx, np.flatnonzero(trained))
    metrics.update(logprob_gap(old_logp, rollout_logp, trained))
  rng = np.random.default_rng(seed)
  per_token = {"old_logp": old_logp, "rollout_logp": rollout_logp, "ref_logp": ref_logp}
  step_sums: list[dict[str, float]] = []
  for _ in range(ctx.update.ppo_epochs):
    order = rng.permutation(n) if ctx.update.num_mini_batches > 1 else np.arange(n)
    for mini_batch in np.array_split(order, ctx.update.num_mini_batches):
      grads, merged = minibatch_grads(state.params, sequences, mini_batch, advantages,
                                      per_token, in_loss, ctx, trained=trained)
      state, grad_norm = apply_grads(state, grads, optimizer=ctx.optimizer, config=ctx.config,
                                     rules=ctx.rules)
      del grads   # before the next mini-batch's accumulator: two gradients at most, not three
      merged["actor/grad_norm"] = float(grad_norm)
      step_sums.append(merged)
  metrics.update(_step_metrics(step_sums, first_pass_gap=ctx.update.updates_per_step == 1))
  return state, metrics


def _step_metrics(step_sums: list[dict[str, float]], first_pass_gap: bool
                  ) -> dict[str, float]:
  """Optimizer steps' metric sums -> the step's: means over the steps that computed each
  (a step whose sequences were all skipped computes no actor/* sums), the fill over all,
  and (`first_pass_gap`) the rollout-vs-trainer gap of the first step, before the params
  moved."""
  metrics: dict[str, float] = {}
  if first_pass_gap and "rollout/logprob_diff_mean" in step_sums[0]:
    metrics.update({k: float(step_sums[0][k]) for k in
                    ("rollout/logprob_diff_mean", "rollout/logprob_diff_max")})
  slots = sum(s.pop("train/slots") for s in step_sums)
  filled = sum(s.pop("train/token_slots") for s in step_sums)
  if slots:   # the share of the update's computed slots that hold a token
    metrics["train/fill"] = filled / slots
  for key in dict.fromkeys(k for s in step_sums for k in s):
    if not key.startswith("rollout/"):
      metrics[key] = float(np.mean([s[key] for s in step_sums if key in s]))
  metrics["actor/updates"] = len(step_sums)
  return metrics
