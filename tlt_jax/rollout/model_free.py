"""The model-free drafter: drafts from each row's group text (`ngram.py`), no weights.

A chain of the tokens that followed the row's longest suffix match in its group's text, or
with topk > 1 a tree of the likeliest continuations; verified by the same pass and the same
rules as learned drafts (greedy: the target argmax; sampling: recursive rejection of point
masses). Its state is the `ngram.DraftContext`, which grows by every emitted token.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from tlt_jax.rollout import ngram
from tlt_jax.rollout.decode import DecodeState
from tlt_jax.rollout.drafting import Draft, DraftInputs, Verified, VerifyTree
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecStrategy


@dataclasses.dataclass(frozen=True)
class ModelFreeDrafter:
  ngram_config: ngram.NgramConfig = ngram.NgramConfig()

  def draft(self, context: ngram.DraftContext, base: DecodeState, strategy: SpecStrategy,
            sampling: SamplingParams) -> tuple[VerifyTree, jax.Array]:
    """The step's tree and whether each row's chain follows a full `max_ngram` match
    (the hybrid's pick and counts read it)."""
    if strategy.topk > 1:
      *nodes, matched = ngram.propose_tree(context, strategy.depth, strategy.topk,
                                           strategy.verify_tokens - 1, self.ngram_config)
      tree = _tree(base.last_tokens, nodes)
    else:
      # Sampled rows prefer their own text among equally long matches (`propose_chain`).
      drafts, matched = ngram.propose_chain(context, strategy.depth, self.ngram_config,
                                            own_first=not sampling.greedy)
      tree = _chain(base.last_tokens, drafts)
    return tree, matched >= self.ngram_config.max_ngram

  def propose(self, key, inputs: DraftInputs, context: ngram.DraftContext,
              base: DecodeState, strategy: SpecStrategy, sampling: SamplingParams
              ) -> tuple[ngram.DraftContext, Draft]:
    del key, inputs   # draws nothing, reads no weights
    tree, full_match = self.draft(context, base, strategy, sampling)
    return context, Draft(tree, learned_rows=jnp.zeros_like(full_match), full_match=full_match)

  def commit(self, context: ngram.DraftContext, strategy: SpecStrategy,
             verified: Verified) -> ngram.DraftContext:
    del strategy
    return ngram.append(context, verified.emitted, verified.new_tokens)

  def chunk_body(self, step: Callable, more: Callable, strategy: SpecStrategy) -> Callable:
    return lambda carry: step(self, carry)


def _chain(root: jax.Array, drafts: jax.Array) -> VerifyTree:
  """The root [B] followed by a chain of point-mass drafts [B, D]."""
  b, d = drafts.shape
  steps = jnp.broadcast_to(jnp.arange(d + 1, dtype=jnp.int32), (b, d + 1))
  causal = jnp.tril(jnp.ones((d + 1, d + 1), bool))
  return VerifyTree(tokens=jnp.concatenate([root[:, None], drafts], axis=1), depths=steps,
                    parents=jnp.maximum(steps - 1, 0),
                    mask=jnp.broadcast_to(causal, (b, d + 1, d + 1)), draft_probs=None)


def _tree(root: jax.Array, drafts: tuple[jax.Array, ...]) -> VerifyTree:
  """The root [B] above `ngram.propose_tree`'s point-mass nodes."""
  tokens, depths, parents, ancestors = drafts
  b, n = tokens.shape
  mask = jnp.zeros((b, n + 1, n + 1), bool).at[:, :, 0].set(True).at[:, 1:, 1:].set(ancestors)
  with_root = lambda root_value, x: jnp.concatenate([root_value, x], axis=1)
  return VerifyTree(tokens=with_root(root[:, None], tokens),
                    depths=with_root(jnp.zeros((b, 1), depths.dtype), depths),
                    parents=with_root(jnp.zeros((b, 1), parents.dtype), parents), mask=mask,
                    draft_probs=None)
