"""Frozen configs of the RL step: one field per algorithm switch, validated on construction.

Names follow what users of verl / TRL know (`loss_agg_mode`, `clip_ratio_low/high`,
`kl_coef`, ...). All are hashable, so jitted functions take them as static arguments.
"""
from __future__ import annotations

import dataclasses

from tlt_jax.errors import UserInputError

ADVANTAGE_MODES = ("grpo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                  "seq_mean_token_sum_norm")
OVERLONG_MODES = ("none", "soft_penalty", "mask")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Group-relative advantages: `grpo` divides by the group's std (+ eps), `dr_grpo`
  (Dr. GRPO) only subtracts the group mean."""
  mode: str = "grpo"
  eps: float = 1e-6

  def __post_init__(self):
    if self.mode not in ADVANTAGE_MODES:
      raise UserInputError(f"--advantage={self.mode!r}: expected one of "
                           f"{', '.join(ADVANTAGE_MODES)}")
    if not self.eps > 0:
      raise UserInputError(f"--adv_eps={self.eps}: must be > 0")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The policy loss: PPO-clipped surrogate (+ dual clip), KL to a reference, entropy bonus.

  ratio = exp(logp - old_logp) is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
  (DAPO's clip-higher sets high > low); `clip_ratio_c` (> 1) caps the loss of
  negative-advantage tokens at -A * c (dual clip); None turns it off. `kl_coef` 0 turns the
  KL term off, and then no reference model is kept. `tis_cap` caps the rollout-vs-trainer
  importance weight exp(old_logp - rollout_logp) (truncated importance sampling); None off.
  """
  clip_ratio_low: float = 0.2
  clip_ratio_high: float = 0.2
  clip_ratio_c: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  loss_agg_mode: str = "token_mean"
  tis_cap: float | None = None

  def __post_init__(self):
    for name in ("clip_ratio_low", "clip_ratio_high"):
      if not 0 <= getattr(self, name) < 10:
        raise UserInputError(f"--{name}={getattr(self, name)}: must be in [0, 10)")
    if self.clip_ratio_low >= 1:
      raise UserInputError(f"--clip_ratio_low={self.clip_ratio_low}: must be < 1")
    if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
      raise UserInputError(f"--clip_ratio_c={self.clip_ratio_c}: must be > 1 (or unset)")
    if not self.kl_coef >= 0:
      raise UserInputError(f"--kl_coef={self.kl_coef}: must be >= 0")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise UserInputError(f"--kl_estimator={self.kl_estimator!r}: expected one of "
                           f"{', '.join(KL_ESTIMATORS)}")
    if not self.entropy_coef >= 0:
      raise UserInputError(f"--entropy_coef={self.entropy_coef}: must be >= 0")
    if self.loss_agg_mode not in LOSS_AGG_MODES:
      raise UserInputError(f"--loss_agg_mode={self.loss_agg_mode!r}: expected one of "
                           f"{', '.join(LOSS_AGG_MODES)}")
    if self.tis_cap is not None and not self.tis_cap >= 1:
      raise UserInputError(f"--tis_cap={self.tis_cap}: must be >= 1 (or unset)")

  @property
  def uses_reference(self) -> bool:
    return self.kl_coef > 0


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
  """What happens to responses that run to the length cap (DAPO).

  `soft_penalty` adds a reward penalty ramping linearly from 0 at
  `max_response_len - buffer_len` tokens to -`penalty_factor` at `max_response_len`;
  `mask` drops truncated responses (finish_reason "length") from the loss."""
  mode: str = "none"
  buffer_len: int = 32
  penalty_factor: float = 1.0

  def __post_init__(self):
    if self.mode not in OVERLONG_MODES:
      raise UserInputError(f"--overlong={self.mode!r}: expected one of "
                           f"{', '.join(OVERLONG_MODES)}")
    if self.buffer_len < 1:
      raise UserInputError(f"--overlong_buffer_len={self.buffer_len}: must be >= 1")
    if not self.penalty_factor >= 0:
      raise UserInputError(f"--overlong_penalty_factor={self.penalty_factor}: must be >= 0")
