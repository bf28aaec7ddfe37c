"""The rollout stage: each prompt sampled `group_size` times through the rollout engine.

Rows of a group are adjacent, so a group's responses are rows g*G .. g*G + G - 1. The
engine compacts the live rows and switches speculative decoding on for the tail; this
module only lays the groups out and keeps what the later stages need.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import Params
from tlt_jax.rl.precision import compute_params
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
from tlt_jax.rollout.weights import DraftWeights, place_rollout
from tlt_jax.rollout.precompile import precompile
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding.rules import MeshRules


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """Everything the engine needs besides params and prompts."""
  group_size: int
  max_new_tokens: int
  sampling: SamplingParams
  eos_ids: tuple[int, ...]
  spec: SpecConfig | None = None
  buckets: BucketSpec = BucketSpec()
  chunk_steps: int = 16
  attention_impl: str = "auto"
  # The cache of every rollout fits rows this long (max prompt + max new tokens): one cache
  # length, so one set of programs, whatever a step's longest prompt.
  min_row_tokens: int = 0
  # The rollout replica's mesh and sharding rules (`weights.place_rollout`); None: one device.
  rules: MeshRules | None = None
  # Hand back the target's hidden states of every rollout (`GroupRollouts.hidden_states`),
  # as drafter training data; off, the rollout keeps none of them past its SD switch.
  capture_hidden: bool = False
  # The most rows a rollout holds at once (`engine.generate`); None: every row at once.
  max_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class GroupRollouts:
  """Responses of P prompts x G samples, row-major by group."""
  prompts: list[list[int]]           # [P * G], each prompt repeated G times
  responses: list[list[int]]         # [P * G]
  logprobs: list[np.ndarray]         # [P * G] rollout log-probs of the response tokens
  truncated: np.ndarray              # [P * G] bool: ran to the length cap
  prompt_index: np.ndarray           # [P * G] which of the P prompts
  stats: dict
  # With `RolloutSettings.capture_hidden`: per row, the target's hidden states of prompt +
  # response but its last token, [prompt_len + response_len - 1, E]
  # (`engine.GenerationOutput.hidden_states`); else None.
  hidden_states: list[np.ndarray] | None = None

  @property
  def response_lengths(self) -> np.ndarray:
    return np.array([len(r) for r in self.responses], np.int64)

  def select_groups(self, groups: Sequence[int], group_size: int) -> "GroupRollouts":
    rows = [g * group_size + k for g in groups for k in range(group_size)]
    return GroupRollouts(prompts=[self.prompts[r] for r in rows],
                         responses=[self.responses[r] for r in rows],
                         logprobs=[self.logprobs[r] for r in rows],
                         truncated=self.truncated[rows], prompt_index=self.prompt_index[rows],
                         stats=self.stats,
                         hidden_states=None if self.hidden_states is None else [
                             self.hidden_states[r] for r in rows])


def concat_rollouts(parts: Sequence[GroupRollouts]) -> GroupRollouts:
  """Groups of several rollouts (DAPO refills) as one; stats are the first part's."""
  return GroupRollouts(
      prompts=[p for part in parts for p in part.prompts],
      responses=[r for part in parts for r in part.responses],
      logprobs=[lp for part in parts for lp in part.logprobs],
      truncated=np.concatenate([part.truncated for part in parts]),
      prompt_index=np.concatenate([part.prompt_index for part in parts]),
      stats=parts[0].stats,
      hidden_states=None if parts[0].hidden_states is None else [
          h for part in parts for h in part.hidden_states])


def lay_out_for_rollout(params: Params, config: ModelConfig, settings: RolloutSettings,
                        compute_dtype: str | None = None) -> Params:
  """The policy in the engine's layout: in compute_dtype (None: as it is; a bfloat16 copy
  of float32 master weights, `precision`), per layer, on the rollout's mesh
  (`weights.place_rollout`). Every step gives the same shapes and shardings, so the
  rollout's compiled programs serve each new policy as they are."""
  return place_rollout(compute_params(params, compute_dtype), config, None, settings.rules)[0]


def sample_groups(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]],
                  settings: RolloutSettings, seed: int, drafter: DraftWeights | None = None,
                  memory: SpecMemory | None = None) -> GroupRollouts:
  """Each prompt sampled `group_size` times; drafter and memory: the learned drafter's
  weights and what SD learned in earlier steps (see `engine.generate`)."""
  rows = [list(p) for p in prompts for _ in range(settings.group_size)]
  result = generate(params, config, rows, max_new_tokens=settings.max_new_tokens,
                    sampling=settings.sampling, eos_ids=settings.eos_ids, seed=seed,
                    buckets=settings.buckets, chunk_steps=settings.chunk_steps,
                    spec=settings.spec, drafter=drafter, memory=memory,
                    attention_impl=settings.attention_impl,
                    min_row_tokens=settings.min_row_tokens, rules=settings.rules,
                    capture_hidden=settings.capture_hidden, max_rows=settings.max_rows)
  return GroupRollouts(
      prompts=rows,
      responses=[o.token_ids for o in result.outputs],
      logprobs=[np.asarray(o.logprobs, np.float32) for o in result.outputs],
      truncated=np.array([o.finish_reason == "length" for o in result.outputs]),
      prompt_index=np.repeat(np.arange(len(prompts)), settings.group_size),
      stats=result.stats,
      hidden_states=([o.hidden_states for o in result.outputs] if settings.capture_hidden
                     else None))


def precompile_rollouts(params: Params, config: ModelConfig, num_prompts: int,
                        max_prompt_len: int, settings: RolloutSettings,
                        drafter: DraftWeights | None = None) -> int:
  """Compiles every program a rollout of `num_prompts` prompts (of up to `max_prompt_len`
  tokens, each sampled `group_size` times) can dispatch, before the first step; returns how
  many were new."""
  rows = [[p] * max_prompt_len for p in range(num_prompts) for _ in range(settings.group_size)]
  return precompile(params, config, rows, max_new_tokens=settings.max_new_tokens,
                    sampling=settings.sampling, eos_ids=settings.eos_ids,
                    buckets=settings.buckets, chunk_steps=settings.chunk_steps,
                    spec=settings.spec, drafter=drafter,
                    attention_impl=settings.attention_impl,
                    min_row_tokens=settings.min_row_tokens, rules=settings.rules,
                    capture_hidden=settings.capture_hidden, max_rows=settings.max_rows)
