"""The optimizer shared by the policy and the drafter: AdamW after global-norm clipping, on a
warm-up + (cosine or constant) learning-rate schedule."""
from __future__ import annotations

import optax

from tlt_jax.errors import UserInputError

SCHEDULES = ("cosine", "constant")


def make_optimizer(lr: float, total_steps: int, warmup_steps: int = 0,
                   min_lr_ratio: float = 0.1, weight_decay: float = 0.01,
                   clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   schedule: str = "cosine") -> optax.GradientTransformation:
  """AdamW(b1, b2) after clipping the update's global norm to `clip_norm`.

  `cosine` decays to lr * min_lr_ratio by `total_steps`; `constant` holds lr after warm-up
  (verl's default for RL). The schedule is read with `learning_rate(optimizer_step)`."""
  adamw = optax.adamw(learning_rate_schedule(lr, total_steps, warmup_steps, min_lr_ratio,
                                             schedule),
                      b1=b1, b2=b2, weight_decay=weight_decay)
  if not clip_norm > 0:
    raise UserInputError(f"--grad_clip={clip_norm}: must be > 0")
  return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def learning_rate_schedule(lr: float, total_steps: int, warmup_steps: int = 0,
                           min_lr_ratio: float = 0.1, schedule: str = "cosine"
                           ) -> optax.Schedule:
  if not lr > 0:
    raise UserInputError(f"--lr={lr}: must be > 0")
  if total_steps < 1:
    raise UserInputError(f"--steps={total_steps}: must be >= 1")
  if not 0 <= warmup_steps <= total_steps:
    raise UserInputError(f"--warmup_steps={warmup_steps}: must be in [0, {total_steps}]")
  if schedule not in SCHEDULES:
    raise UserInputError(f"--lr_schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
  if schedule == "constant":
    after = optax.constant_schedule(lr)
  else:
    after = optax.cosine_decay_schedule(lr, max(total_steps - warmup_steps, 1),
                                        alpha=min_lr_ratio)
  if not warmup_steps:  # optax warns on a zero-step warm-up
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after],
                              [warmup_steps])
