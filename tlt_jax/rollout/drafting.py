"""The drafter seam: what every draft source gives the verify pass, and what it gets back.

A speculative step is propose -> verify -> accept -> commit (`speculative.spec_step`).
A `Drafter` is a static, hashable object (its settings) whose state is a pytree carried in
`SpecState.draft`; its weights, if any, come in as a rollout argument (`DraftInputs`), so a
new drafter is a new argument, never a new program. Three implement it: the learned EAGLE
drafter (`learned_drafter.py`), the model-free drafter over each row's group text
(`model_free.py`) and the hybrid of both (`hybrid.py`).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax

from tlt_jax.models.transformer import Params
from tlt_jax.rollout.decode import DecodeState
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights


class VerifyTree(NamedTuple):
  """What one verify pass checks, from any draft source: verify index 0 is the root (the
  pending token), parents precede children, siblings in the order acceptance tries them."""
  tokens: jax.Array        # [B, V]
  depths: jax.Array        # [B, V]: 0 for the root
  parents: jax.Array       # [B, V]: verify index of each node's parent (the root's: 0)
  mask: jax.Array          # [B, V, V]: node i attends to node j (its ancestors and itself)
  draft_probs: jax.Array | None   # [B, V, Vd]: q each node's children were drawn from, on
                                  # the drafter's vocabulary; None: point masses (and
                                  # greedy, which reads no q)


class Draft(NamedTuple):
  """One step's proposal: the tree, and what acceptance and the hybrid's counts read."""
  tree: VerifyTree
  learned_rows: jax.Array          # [B] bool: rows the learned drafter drafted
  full_match: jax.Array            # [B] bool: a model-free chain after a full-length match
  point_mass: jax.Array | None = None   # [B, V] bool: with draft_probs, nodes whose
                                        # children are point masses all the same


class DraftInputs(NamedTuple):
  """What a drafter reads besides its state: the target's params (the learned drafter
  embeds with them), the learned drafter's weights and its draft head (None without one)."""
  params: Params
  weights: DraftWeights | None
  head: Any


class Verified(NamedTuple):
  """A verified step, as a drafter's `commit` sees it."""
  hidden: jax.Array          # [B, V, E]: the target's last hidden state at every node
  path: jax.Array            # [B, depth + 1]: verify index of the emitted tokens' nodes
  emitted: jax.Array         # [B, depth + 1]: the accepted drafts, then the bonus token
  num_accepted: jax.Array    # [B]: drafts accepted
  new_tokens: jax.Array      # [B]: tokens the step emitted (0 for finished rows)
  live: jax.Array            # [B]: rows live at the step's start
  tries: jax.Array | None    # [B, depth, topk]: sampled walks' tries by level and rank
  accepts: jax.Array | None
  draft: Draft               # what was proposed


class Drafter(Protocol):
  """A draft source. `propose` drafts a step's tree from the drafter's state (and the
  decode state it reads: root tokens, committed lengths, done rows); `commit` brings the
  state past the step's emitted tokens. `chunk_body` runs a chunk's steps (most drafters:
  `step` as given)."""

  def propose(self, key: jax.Array, inputs: DraftInputs, state: Any, base: DecodeState,
              strategy: SpecStrategy, sampling: SamplingParams) -> tuple[Any, Draft]: ...

  def commit(self, state: Any, strategy: SpecStrategy, verified: Verified) -> Any: ...

  def chunk_body(self, step: Callable[["Drafter", Any], Any], more: Callable[[Any], Any],
                 strategy: SpecStrategy) -> Callable[[Any], Any]: ...
