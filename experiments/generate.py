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

from experiments import budget_flags, cli, sd_flags
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
_BANDIT_STATE = flags.DEFINE_string(
    "bandit_state", None, "Bandit state JSON: read first if it exists, rewritten after the "
    "rollout, so the bandit keeps learning across runs.")
_ATTENTION = flags.DEFINE_enum("attention_impl", "auto",
                               ["auto", "reference", "pallas", "triton", "cpu"],
                               "Attention kernel: auto = Pallas on GPU; on CPU the C++ kernel "
                               "for decode and verification, jnp for prefill.")
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


def load_memory(spec):
  """What SD learns across rollouts (`SpecMemory`): the bandit's state from --bandit_state
  when that file exists."""
  from tlt_jax.rollout.bandit import StrategyBandit
  from tlt_jax.rollout.spec_config import SpecMemory

  path = _BANDIT_STATE.value
  if path is not None and (spec is None or spec.bandit is None):
    raise UserInputError("--bandit_state needs a pool of strategies in --strategy"
                         if spec is not None else
                         "--bandit_state needs --drafter (speculative decoding is off)")
  memory = None if spec is None else SpecMemory(spec)
  if path is None or not os.path.exists(path):
    return memory
  try:
    with open(path) as f:
      state = json.load(f)
    memory.bandit = StrategyBandit.from_state_dict(spec.bandit, state)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserInputError(f"--bandit_state={path}: cannot read ({e})") from None
  except UserInputError as e:
    raise UserInputError(f"--bandit_state={path}: {e}") from None
  return memory


def max_rows_for(model, drafter, token_lists, spec) -> int | None:
  """The rollout's row budget: --rollout_max_rows, or the rows --kv_cache_memory_fraction
  of the device memory left after the loaded weights holds (None: every row at once)."""
  import jax

  from tlt_jax.rollout.budget import row_bytes, rows_within
  from tlt_jax.rollout.buckets import BucketSpec
  from tlt_jax.rollout.engine import cache_length

  if not budget_flags.KV_FRACTION.value:
    return budget_flags.MAX_ROWS.value or None
  buckets = BucketSpec()
  longest = max(len(t) for t in token_lists)
  cache_len = cache_length(longest + _MAX_NEW.value, buckets.prompt_length(longest), spec,
                           buckets)
  weights = sum(x.nbytes for x in jax.tree.leaves((model.params, drafter)))
  device_bytes, _ = budget_flags.device_memory()
  per_row = row_bytes(model.config, cache_len, _MAX_NEW.value, model.params["embed"].dtype,
                      spec is not None and spec.learned)
  rows = rows_within(budget_flags.KV_FRACTION.value * (device_bytes - weights), per_row)
  if rows < 1:
    raise UserInputError(f"--kv_cache_memory_fraction={budget_flags.KV_FRACTION.value}: "
                         f"holds no row of {per_row / 2**20:.1f} MiB")
  return rows


def main(argv):
  del argv
  import jax.numpy as jnp

  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams

  sampling = SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                            top_k=_TOP_K.value)
  # Cheap checks before the model loads: a bad flag should not cost a minute.
  spec = sd_flags.spec_from_flags(_SEED.value)
  budget_flags.check_budget_flags()
  memory = load_memory(spec)
  prompts = read_prompts(_PROMPTS.value)
  cli.check_output_file(_OUTPUT.value, "--output_json")
  if _BANDIT_STATE.value:
    cli.check_output_file(_BANDIT_STATE.value, "--bandit_state")
  start = time.perf_counter()
  print(f"loading {_MODEL.value} ...", file=sys.stderr)
  model = load_model(_MODEL.value, dtype=jnp.dtype(_DTYPE.value))
  drafter = sd_flags.drafter_from_flags(spec, model.config, jnp.dtype(_DTYPE.value))
  load_s = time.perf_counter() - start
  token_lists = tokenize_prompts(prompts, model.tokenizer, model.config.vocab_size, _CHAT.value)
  eos_ids = set(model.config.eos_token_ids)
  if model.tokenizer is not None:
    eos_ids |= set(model.tokenizer.eos_token_ids)
  rollout = dict(max_new_tokens=_MAX_NEW.value, sampling=sampling, eos_ids=tuple(eos_ids),
                 spec=spec, drafter=drafter, attention_impl=_ATTENTION.value,
                 max_rows=max_rows_for(model, drafter, token_lists, spec))
  precompiled = {}
  if _PRECOMPILE.value:
    print("precompiling the rollout's programs ...", file=sys.stderr)
    start = time.perf_counter()
    programs = precompile(model.params, model.config, token_lists, **rollout)
    precompiled = {"compile/precompiled_programs": programs,
                   "compile/precompile_s": time.perf_counter() - start}
  print(f"generating {len(token_lists)} prompts x {_MAX_NEW.value} tokens ...", file=sys.stderr)
  result = generate(model.params, model.config, token_lists, seed=_SEED.value, memory=memory,
                    **rollout)
  outputs = []
  for out in result.outputs:
    content = [t for t in out.token_ids if t not in eos_ids]
    text = model.tokenizer.decode(content) if model.tokenizer is not None else None
    outputs.append({"token_ids": out.token_ids, "text": text, "logprobs": out.logprobs,
                    "finish_reason": out.finish_reason})
  stats = dict(result.stats, **precompiled, load_s=load_s, model=_MODEL.value,
               dtype=_DTYPE.value)
  cli.write_json_atomic(_OUTPUT.value, {"outputs": outputs, "stats": stats})
  if _BANDIT_STATE.value:
    cli.write_json_atomic(_BANDIT_STATE.value, memory.bandit.state_dict())
  print(f"wrote {_OUTPUT.value}: {stats['generated_tokens']} tokens, "
        f"{stats['tokens_per_s']:.1f} tokens/s "
        f"({'compiled before' if _PRECOMPILE.value else 'including compile'})", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
