"""Generate completions for a batch of prompts.

  python -m experiments.generate --model=smollm2 --prompts_json=prompts.json \
      --max_new_tokens=64 --temperature=0 --chat --output_json=out.json

--model is an HF dir, a converted checkpoint dir, a .gguf file, or `smollm2` (bundled).
--prompts_json holds a JSON list whose items are strings or lists of token ids.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from experiments import cli
from tlt_jax.errors import UserInputError

_MODEL = flags.DEFINE_string("model", "smollm2", "HF dir, converted checkpoint dir, .gguf file, "
                             "or 'smollm2'.")
_PROMPTS = flags.DEFINE_string("prompts_json", None, "JSON list of strings or token-id lists.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Where to write the outputs (JSON).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per prompt.",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 is greedy.",
                                  lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 disables.", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap string prompts in the model's chat template.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_DRAFTER = flags.DEFINE_string(
    "drafter", None, "Enables speculative decoding for the tail: a drafter dir (from "
    "experiments.train_drafter), or 'ngram' for model-free drafts (n-gram matches in the "
    "text of the prompt's group: rows with equal prompts).")
_MAX_NGRAM = flags.DEFINE_integer("max_ngram", None, "--drafter=ngram or --hybrid: longest "
                                  "suffix matched (default: "
                                  "tlt_jax.rollout.ngram.NgramConfig's).")
_HYBRID = flags.DEFINE_bool(
    "hybrid", False, "With --drafter=DIR: each row picks, per verify step, the learned "
    "drafter's chain or a model-free one, whichever has emitted more tokens per unit time "
    "for it so far (tlt_jax.rollout.hybrid).")
_HYBRID_MERGE = flags.DEFINE_bool(
    "hybrid_merge", False, "With --hybrid: the other design, one verify tree per step holding "
    "both chains (model-free over the first half of the strategy's depth, learned over the "
    "rest) instead of a per-row pick.")
_STRATEGY = flags.DEFINE_string(
    "strategy", "4_1_5", "SD strategy [KIND:]DEPTH_TOPK_VERIFYTOKENS, or a comma-separated "
    "pool of them: a bandit (BEG-MAB) then picks one per chunk by live batch size. KIND "
    "(learned, ngram, hybrid) lets one pool mix drafter kinds, e.g. "
    "--drafter=DIR --strategy=4_1_5,ngram:4_1_5; unnamed: --drafter's (hybrid with --hybrid).")
_BANDIT_EPSILON = flags.DEFINE_float("bandit_epsilon", 0.1, "Bandit exploration rate.")
_BANDIT_WINDOW = flags.DEFINE_integer("bandit_window", 300, "Rewards the bandit keeps per "
                                      "batch bucket and strategy.")
_BANDIT_STATE = flags.DEFINE_string(
    "bandit_state", None, "Bandit state JSON: read first if it exists, rewritten after the "
    "rollout, so the bandit keeps learning across runs.")
_SD_THRESHOLD = flags.DEFINE_integer("sd_threshold", 32, "SD turns on once at most this many "
                                     "rows are live ...")
_ATTENTION = flags.DEFINE_enum("attention_impl", "auto",
                               ["auto", "reference", "pallas", "triton", "cpu"],
                               "Attention kernel: auto = Pallas on GPU; on CPU the C++ kernel "
                               "for decode and verification, jnp for prefill.")
_SD_PATIENCE = flags.DEFINE_integer("sd_patience", 10, "... for this many decode steps.")
_DRAFT_TEMPERATURE_RATIO = flags.DEFINE_float(
    "draft_temperature_ratio", None, "Sampled trees (topk > 1) draw drafts at this times "
    "--temperature (exact at any ratio; below 1 tries more of the tokens the target favours; "
    "chains keep --temperature). Default: the engine's "
    "(tlt_jax.rollout.engine.DEFAULT_DRAFT_TEMPERATURE_RATIO).")
_PRECOMPILE = flags.DEFINE_bool(
    "precompile", False, "Compile every program the rollout can reach (each batch bucket, "
    "attention window and strategy) before it starts, so decoding never stops to compile and "
    "every bandit chunk is scored.")
flags.mark_flags_as_required(["prompts_json", "output_json"])


def read_prompts(path: str) -> list:
  try:
    with open(path) as f:
      prompts = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserInputError(f"--prompts_json={path}: cannot read ({e})") from None
  ok_item = lambda p: isinstance(p, str) or (
      isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in p))
  if not isinstance(prompts, list) or not prompts or not all(ok_item(p) for p in prompts):
    raise UserInputError(f"--prompts_json={path}: expected a non-empty JSON list of strings "
                         "or non-empty lists of token ids")
  return prompts


def tokenize_prompts(prompts: list, tokenizer, vocab_size: int, chat: bool) -> list[list[int]]:
  token_lists = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if tokenizer is None:
        raise UserInputError(f"--prompts_json item {i}: text prompt, but --model has no tokenizer")
      ids = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
             if chat else tokenizer.encode(prompt))
    else:
      ids = prompt
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise UserInputError(f"--prompts_json item {i}: token id {bad[0]} outside [0, {vocab_size})")
    token_lists.append(list(ids))
  return token_lists


def check_hybrid() -> None:
  """--hybrid pairs a learned drafter with model-free drafts."""
  if _HYBRID_MERGE.value and not _HYBRID.value:
    raise UserInputError("--hybrid_merge needs --hybrid")
  if not _HYBRID.value:
    return
  if _DRAFTER.value is None:
    raise UserInputError("--hybrid needs --drafter=DIR (a learned drafter to pair with "
                         "model-free drafts)")
  if _DRAFTER.value == "ngram":
    raise UserInputError("--hybrid: --drafter=ngram is model-free alone; give a learned "
                         "drafter dir")


def ngram_config():
  from tlt_jax.rollout.ngram import NgramConfig
  return NgramConfig() if _MAX_NGRAM.value is None else NgramConfig(_MAX_NGRAM.value)


def model_free_spec(strategy_choice: dict):
  """The SD configuration of --drafter=ngram (None for any other --drafter): it needs no
  model, so its flags are checked before the model loads."""
  from tlt_jax.rollout.engine import SpecConfig

  if _DRAFTER.value != "ngram":
    return None
  return SpecConfig(ngram_config=ngram_config(), threshold=_SD_THRESHOLD.value,
                    patience=_SD_PATIENCE.value, **strategy_choice)


def load_spec(config, dtype, strategy_choice: dict):
  """The SD configuration from --drafter/--strategy/--sd_*; None when SD is off."""
  from tlt_jax.drafter.trainer import speculation_config
  from tlt_jax.rollout.hybrid import HybridConfig

  sd_flags = [f for f in ("strategy", "sd_threshold", "sd_patience", "bandit_epsilon",
                          "bandit_window", "bandit_state", "draft_temperature_ratio",
                          "max_ngram")
              if flags.FLAGS[f].present]
  if _DRAFTER.value is None:
    if sd_flags:
      raise UserInputError(f"--{sd_flags[0]} needs --drafter (speculative decoding is off)")
    return None
  # Model-free drafts also when the pool names them (`ngram:4_1_5`).
  strategies = (strategy_choice["bandit"].strategies if "bandit" in strategy_choice
                else (strategy_choice["strategy"],))
  model_free = _HYBRID.value or any(s.drafter in ("ngram", "hybrid") for s in strategies)
  if _MAX_NGRAM.value is not None and not model_free:
    raise UserInputError("--max_ngram needs model-free drafts (--drafter=ngram, --hybrid, or "
                         "an ngram: strategy)")
  hybrid = dict(ngram_config=ngram_config()) if model_free else {}
  if _HYBRID.value:
    hybrid["hybrid"] = HybridConfig(merge=_HYBRID_MERGE.value)
  return speculation_config(_DRAFTER.value, config, dtype, threshold=_SD_THRESHOLD.value,
                            patience=_SD_PATIENCE.value, **strategy_choice, **hybrid,
                            **({} if _DRAFT_TEMPERATURE_RATIO.value is None else
                               dict(draft_temperature_ratio=_DRAFT_TEMPERATURE_RATIO.value)))


def load_bandit(bandit_config):
  """A fresh bandit, or the one saved in --bandit_state when that file exists."""
  from tlt_jax.rollout.bandit import StrategyBandit

  path = _BANDIT_STATE.value
  if path is None or not os.path.exists(path):
    return StrategyBandit(bandit_config)
  try:
    with open(path) as f:
      state = json.load(f)
    return StrategyBandit.from_state_dict(bandit_config, state)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserInputError(f"--bandit_state={path}: cannot read ({e})") from None
  except UserInputError as e:
    raise UserInputError(f"--bandit_state={path}: {e}") from None


def strategy_flags() -> dict:
  """--strategy and --bandit_*: SpecConfig's `strategy=` (one) or `bandit=` (a pool, with
  the state of --bandit_state when that file exists)."""
  from tlt_jax.rollout.bandit import BanditConfig, parse_strategies

  strategies = parse_strategies(_STRATEGY.value)
  bandit_flags = [f for f in ("bandit_epsilon", "bandit_window", "bandit_state")
                  if flags.FLAGS[f].present]
  if len(strategies) == 1:
    if bandit_flags:
      raise UserInputError(f"--{bandit_flags[0]} needs a pool of strategies in --strategy")
    return {"strategy": strategies[0]}
  return {"bandit": load_bandit(BanditConfig(strategies, epsilon=_BANDIT_EPSILON.value,
                                             window=_BANDIT_WINDOW.value, seed=_SEED.value))}


def main(argv):
  del argv
  import jax.numpy as jnp

  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import SpecConfig, generate
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams

  sampling = SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                            top_k=_TOP_K.value)
  # Cheap checks before the model loads: a bad flag should not cost a minute.
  check_hybrid()
  strategy_choice = strategy_flags()
  SpecConfig.validate_schedule(_SD_THRESHOLD.value, _SD_PATIENCE.value)
  spec = model_free_spec(strategy_choice)
  prompts = read_prompts(_PROMPTS.value)
  cli.check_output_file(_OUTPUT.value, "--output_json")
  if _BANDIT_STATE.value:
    cli.check_output_file(_BANDIT_STATE.value, "--bandit_state")
  start = time.perf_counter()
  print(f"loading {_MODEL.value} ...", file=sys.stderr)
  model = load_model(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
  load_s = time.perf_counter() - start
  if spec is None:
    spec = load_spec(model.config, jnp.dtype(_DTYPE.value), strategy_choice)
  token_lists = tokenize_prompts(prompts, model.tokenizer, model.config.vocab_size, _CHAT.value)
  eos_ids = set(model.config.eos_token_ids)
  if model.tokenizer is not None:
    eos_ids |= set(model.tokenizer.eos_token_ids)
  rollout = dict(max_new_tokens=_MAX_NEW.value, sampling=sampling, eos_ids=tuple(eos_ids),
                 spec=spec, attention_impl=_ATTENTION.value)
  precompiled = {}
  if _PRECOMPILE.value:
    print("precompiling the rollout's programs ...", file=sys.stderr)
    start = time.perf_counter()
    programs = precompile(model.params, model.config, token_lists, **rollout)
    precompiled = {"compile/precompiled_programs": programs,
                   "compile/precompile_s": time.perf_counter() - start}
  print(f"generating {len(token_lists)} prompts x {_MAX_NEW.value} tokens ...", file=sys.stderr)
  result = generate(model.params, model.config, token_lists, seed=_SEED.value, **rollout)
  outputs = []
  for out in result.outputs:
    content = [t for t in out.token_ids if t not in eos_ids]
    text = model.tokenizer.decode(content) if model.tokenizer is not None else None
    outputs.append({"token_ids": out.token_ids, "text": text, "logprobs": out.logprobs,
                    "finish_reason": out.finish_reason})
  stats = dict(result.stats, **precompiled, load_s=load_s, model=_MODEL.value,
               dtype=_DTYPE.value)
  cli.write_json_atomic(_OUTPUT.value, {"outputs": outputs, "stats": stats})
  if spec is not None and spec.bandit is not None and _BANDIT_STATE.value:
    cli.write_json_atomic(_BANDIT_STATE.value, spec.bandit.state_dict())
  print(f"wrote {_OUTPUT.value}: {stats['generated_tokens']} tokens, "
        f"{stats['tokens_per_s']:.1f} tokens/s "
        f"({'compiled before' if _PRECOMPILE.value else 'including compile'})", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
