"""Speculative decoding's three parts, kept apart: a static config, weights, host state.

`SpecConfig` is frozen and hashable (strategies, schedule, drafter kind and settings) and
holds no arrays; the learned drafter's weights reach `generate` as a `DraftWeights`
argument (a new drafter every RL step is a new argument, not a new config or program);
what speculative decoding learns across rollouts (the bandit's rewards, the hybrid's batch
counts) is a `SpecMemory` its caller owns and checkpoints (`state_dict` /
`load_state_dict`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from tlt_jax.errors import UserInputError
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import hybrid as hybrid_lib
from tlt_jax.rollout import ngram
from tlt_jax.rollout.bandit import BanditConfig, StrategyBandit
from tlt_jax.rollout.drafting import Drafter
from tlt_jax.rollout.learned_drafter import LearnedDrafter
from tlt_jax.rollout.model_free import ModelFreeDrafter
from tlt_jax.rollout.strategy import DRAFTER_KINDS, SpecStrategy
from tlt_jax.rollout.weights import DraftWeights
from tlt_jax.sharding.rules import MeshRules

MAX_SD_THRESHOLD = 256   # the largest batch bucket: SD above it never pays
DEFAULT_DRAFT_TEMPERATURE_RATIO = 0.7


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative decoding for the tail: on below `threshold` live rows for `patience` steps.

  Either one fixed `strategy`, or a `bandit` whose strategies a BEG-MAB picks among per
  chunk by live batch size. A strategy may name its drafter kind (`ngram:4_1_5`), so a pool
  can mix kinds; unnamed ones are `kind`'s: "learned" (needs `DraftWeights`), "ngram"
  (model-free, from each row's group text, `ngram_config`) or "hybrid" (both; each row
  picks per step, `hybrid`).
  Sampled trees draw at `draft_temperature_ratio` times the sampling temperature (exact at
  any ratio; a sharper q puts more of a node's draws on the tokens the target favours)."""
  strategy: SpecStrategy | None = None
  bandit: BanditConfig | None = None
  kind: str = "learned"
  threshold: int = 32
  patience: int = 10
  draft_temperature_ratio: float = DEFAULT_DRAFT_TEMPERATURE_RATIO
  ngram_config: ngram.NgramConfig = ngram.NgramConfig()
  hybrid: hybrid_lib.HybridConfig = hybrid_lib.HybridConfig()

  def __post_init__(self):
    if (self.strategy is None) == (self.bandit is None):
      raise UserInputError("SpecConfig: give exactly one of strategy and bandit")
    if self.kind not in DRAFTER_KINDS:
      raise UserInputError(f"drafter kind {self.kind!r}: expected one of "
                           f"{', '.join(DRAFTER_KINDS)}")
    for s in self.strategies:
      if self.kind_of(s) == "hybrid" and s.topk > 1:
        # Its two drafts share one verify shape, so its learned drafts are chains too.
        raise UserInputError(f"--strategy={s.name}: hybrid drafting verifies chains "
                             "(DEPTH_1_DEPTH+1)")
    self.validate_schedule(self.threshold, self.patience)
    if not 0 < self.draft_temperature_ratio <= 4:
      raise UserInputError(f"--draft_temperature_ratio={self.draft_temperature_ratio}: must "
                           "be in (0, 4]")

  def kind_of(self, strategy: SpecStrategy) -> str:
    """The drafter kind of a strategy: its own, else the config's."""
    return strategy.drafter or self.kind

  @property
  def strategies(self) -> tuple[SpecStrategy, ...]:
    """Every strategy a rollout may run: its programs and cache margin cover them all."""
    return self.bandit.strategies if self.bandit is not None else (self.strategy,)

  @property
  def kinds(self) -> str:
    """The drafter kinds of the strategies, as stats name them ("learned+ngram": a pool)."""
    kinds = {self.kind_of(s) for s in self.strategies}
    return "+".join(k for k in DRAFTER_KINDS if k in kinds)

  @property
  def learned(self) -> bool:
    """Whether some strategy drafts with the learned drafter (then `DraftWeights` are due)."""
    return any(self.kind_of(s) != "ngram" for s in self.strategies)

  @property
  def model_free(self) -> bool:
    """Whether some strategy drafts model-free (then rows read their group's text)."""
    return any(self.kind_of(s) != "learned" for s in self.strategies)

  def check_weights(self, drafter: DraftWeights | None) -> None:
    """Learned drafting needs the drafter's weights; model-free drafting takes none."""
    for s in self.strategies:
      if self.kind_of(s) != "ngram" and drafter is None:
        raise UserInputError(f"--strategy={s.name}: needs a learned drafter (--drafter=DIR)")
    if drafter is not None and not self.learned:
      raise UserInputError("drafter weights given, but every strategy drafts model-free "
                           "(--drafter=ngram): drop the weights or name a learned strategy")

  def drafter(self, strategy: SpecStrategy, config: ModelConfig, attention_impl: str,
              rules: MeshRules | None) -> Drafter:
    """The drafter that drafts `strategy`'s steps: one source, or with both the hybrid in
    the strategy's kind (every source stays in step whichever kind drafts)."""
    learned = LearnedDrafter(config, attention_impl, rules, self.draft_temperature_ratio)
    model_free = ModelFreeDrafter(self.ngram_config)
    if self.learned and self.model_free:
      return hybrid_lib.HybridDrafter(learned, model_free, self.hybrid, self.kind_of(strategy))
    return learned if self.learned else model_free

  @staticmethod
  def validate_schedule(threshold: int, patience: int) -> None:
    if not 1 <= threshold <= MAX_SD_THRESHOLD:
      raise UserInputError(f"--sd_threshold={threshold}: must be in [1, {MAX_SD_THRESHOLD}]")
    if patience < 0:
      raise UserInputError(f"--sd_patience={patience}: must be >= 0")


class SpecMemory:
  """What speculative decoding learns across rollouts, owned by the caller (the RL learner
  keeps one for the run and checkpoints it): the bandit's reward windows and the hybrid's
  batch counts by arm. A `generate` call given none starts both afresh."""

  def __init__(self, spec: SpecConfig):
    self.bandit = StrategyBandit(spec.bandit) if spec.bandit is not None else None
    self.picks = hybrid_lib.PickMemory() if spec.learned and spec.model_free else None

  def state_dict(self) -> dict[str, Any]:
    return {"bandit": None if self.bandit is None else self.bandit.state_dict(),
            "picks": None if self.picks is None else self.picks.state_dict()}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    if self.bandit is not None and state.get("bandit") is not None:
      self.bandit = StrategyBandit.from_state_dict(self.bandit.config, state["bandit"])
    if self.picks is not None and state.get("picks") is not None:
      self.picks.load_state_dict(state["picks"])
