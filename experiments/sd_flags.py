"""Speculative-decoding flags, defined once for every entry point that rolls out
(`experiments.generate`, `experiments.run`), and the SD config and drafter they give.

--drafter picks the draft source: a drafter dir (learned), `ngram` (model-free, from the
text of each prompt's group), or a dir with --hybrid (both, each row picking per step);
--strategy is one strategy or a pool the bandit picks from, whose items may name their
kind (`ngram:4_1_5`) so one pool mixes kinds.
"""
from __future__ import annotations

import os

from absl import flags

from tlt_jax.errors import UserInputError

DRAFTER = flags.DEFINE_string(
    "drafter", None, "Enables speculative decoding for the tail: a drafter dir (from "
    "experiments.train_drafter), or 'ngram' for model-free drafts (n-gram matches in the "
    "text of the prompt's group).")
HYBRID = flags.DEFINE_bool(
    "hybrid", False, "With --drafter=DIR: each row picks, per verify step, the learned "
    "drafter's chain or a model-free one, whichever has emitted more tokens per unit time "
    "for it so far (tlt_jax.rollout.hybrid).")
MAX_NGRAM = flags.DEFINE_integer("max_ngram", None, "--drafter=ngram or --hybrid: longest "
                                 "suffix matched (default: "
                                 "tlt_jax.rollout.ngram.NgramConfig's).")
STRATEGY = flags.DEFINE_string(
    "strategy", "4_1_5", "SD strategy [KIND:]DEPTH_TOPK_VERIFYTOKENS, or a comma-separated "
    "pool of them: a bandit (BEG-MAB) then picks one per chunk by live batch size. KIND "
    "(learned, ngram, hybrid) lets one pool mix drafter kinds, e.g. "
    "--drafter=DIR --strategy=4_1_5,ngram:4_1_5; unnamed: --drafter's (hybrid with --hybrid).")
BANDIT_EPSILON = flags.DEFINE_float("bandit_epsilon", 0.1, "Bandit exploration rate.")
BANDIT_WINDOW = flags.DEFINE_integer("bandit_window", 300, "Rewards the bandit keeps per "
                                     "batch bucket and strategy.")
SD_THRESHOLD = flags.DEFINE_integer("sd_threshold", 32, "SD turns on once at most this many "
                                    "rows are live ...")
SD_PATIENCE = flags.DEFINE_integer("sd_patience", 10, "... for this many decode steps.")
DRAFT_TEMPERATURE_RATIO = flags.DEFINE_float(
    "draft_temperature_ratio", None, "Sampled trees (topk > 1) draw drafts at this times "
    "the sampling temperature (exact at any ratio; below 1 tries more of the tokens the "
    "target favours; chains keep the temperature). Default: "
    "tlt_jax.rollout.spec_config.DEFAULT_DRAFT_TEMPERATURE_RATIO.")

_NEEDS_DRAFTER = ("strategy", "sd_threshold", "sd_patience", "bandit_epsilon", "bandit_window",
                  "draft_temperature_ratio", "max_ngram", "hybrid")


def spec_from_flags(seed: int):
  """The SD config (`SpecConfig`) of the flags, or None when SD is off; every flag checked,
  before any model loads."""
  from tlt_jax.rollout.bandit import BanditConfig, parse_strategies
  from tlt_jax.rollout.ngram import NgramConfig
  from tlt_jax.rollout.spec_config import SpecConfig

  given = [f for f in _NEEDS_DRAFTER if flags.FLAGS[f].present]
  if DRAFTER.value is None:
    if HYBRID.value:
      raise UserInputError("--hybrid needs --drafter=DIR (a learned drafter to pair with "
                           "model-free drafts)")
    if given:
      raise UserInputError(f"--{given[0]} needs --drafter (speculative decoding is off)")
    return None
  _check_drafter()
  strategies = parse_strategies(STRATEGY.value)
  bandit_given = [f for f in ("bandit_epsilon", "bandit_window") if flags.FLAGS[f].present]
  if len(strategies) == 1 and bandit_given:
    raise UserInputError(f"--{bandit_given[0]} needs a pool of strategies in --strategy")
  choice = ({"strategy": strategies[0]} if len(strategies) == 1 else
            {"bandit": BanditConfig(strategies, epsilon=BANDIT_EPSILON.value,
                                    window=BANDIT_WINDOW.value, seed=seed)})
  kind = "ngram" if DRAFTER.value == "ngram" else "hybrid" if HYBRID.value else "learned"
  extra = {} if DRAFT_TEMPERATURE_RATIO.value is None else {
      "draft_temperature_ratio": DRAFT_TEMPERATURE_RATIO.value}
  if MAX_NGRAM.value is not None:
    extra["ngram_config"] = NgramConfig(MAX_NGRAM.value)
  spec = SpecConfig(kind=kind, threshold=SD_THRESHOLD.value, patience=SD_PATIENCE.value,
                    **choice, **extra)
  if MAX_NGRAM.value is not None and not spec.model_free:
    raise UserInputError("--max_ngram needs model-free drafts (--drafter=ngram, --hybrid, or "
                         "an ngram: strategy)")
  if spec.learned and DRAFTER.value == "ngram":
    learned = next(s for s in spec.strategies if spec.kind_of(s) != "ngram")
    raise UserInputError(f"--strategy={learned.name}: needs a learned drafter (--drafter=DIR)")
  return spec


def _check_drafter() -> None:
  if HYBRID.value and DRAFTER.value == "ngram":
    raise UserInputError("--hybrid: --drafter=ngram is model-free alone; give a learned "
                         "drafter dir")
  if DRAFTER.value != "ngram" and not os.path.isdir(DRAFTER.value):
    raise UserInputError(f"--drafter={DRAFTER.value}: no such directory")


def drafter_from_flags(spec, model_config, dtype):
  """The learned drafter's weights (`DraftWeights`) from --drafter, when `spec` drafts with
  it; else None."""
  if spec is None or not spec.learned:
    return None
  import jax.numpy as jnp

  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.rollout.weights import DraftWeights
  params, vocab_ids = load_drafter(DRAFTER.value, model_config, dtype)
  return DraftWeights(params, None if vocab_ids is None else jnp.asarray(vocab_ids))
