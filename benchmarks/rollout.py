"""Rollout speed on SmolLM2 with a warmed-up drafter: plain decoding vs speculative decoding.

  python benchmarks/rollout.py [--drafter=assets/drafter_smollm2] [--output=FILE]

Prints JSON. Part 1: fixed batches (1, 4, 16) at T=0 and T=1, SD on from the first step,
plain and SD alternated (A B A B ...) after both sides' program pools are compiled and a warm-up
run of each, so no timed run compiles; medians and paired ratios; batch 1 runs --batch1_prompts
prompts one after another.
Part 2: a long-tail rollout (64 rows of reasoning prompts whose response lengths are
long-tailed by natural EOS and by per-row caps drawn from a Pareto law, as in RL rollouts
where most responses end early and a few run to the limit): wall time plain vs adaptive SD
(switched on for the tail), alternated the same way. Part 3 (--accept_prompts): accept
length over a wider prompt set, no timing.

Questions come from reasoning-gym (held-out seeds); `--write_questions=F` saves them and
`--questions_json=F` reads them back, for a machine without reasoning-gym (the GPU check,
benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab, questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2", "Target: `smollm2` or a path (.gguf file, "
                             "HF dir, converted checkpoint dir).")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Warmed-up drafter dir.")
_ATTENTION = flags.DEFINE_enum("attention_impl", "auto", ["auto", "reference", "pallas", "triton"],
                               "Attention kernel (auto: Pallas on GPU, jnp elsewhere).")
_BATCHES = flags.DEFINE_list("batches", ["1", "4", "16"], "Fixed batch sizes.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
_STRATEGIES = flags.DEFINE_list("strategies", ["4_1_5"],
                                "SD strategies tried per setting (the best is reported).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per row, fixed batches.")
_BATCH1_PROMPTS = flags.DEFINE_integer(
    "batch1_prompts", 4, "Batch 1 runs this many prompts one after another (one prompt alone "
    "makes a noisy accept length); its figures sum over them.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Alternated A/B repeats per setting.")
_TAIL_ROWS = flags.DEFINE_integer("tail_rows", 64, "Rows in the long-tail rollout (0: skip it).",
                                  lower_bound=0)
_TAIL_CAP = flags.DEFINE_integer("tail_cap", 512, "Length cap of the long-tail rollout.")
_TAIL_CAP_MIN = flags.DEFINE_integer("tail_cap_min", 48, "Smallest drawn per-row cap.")
_TAIL_CAP_ALPHA = flags.DEFINE_float(
    "tail_cap_alpha", 1.5, "Pareto shape of the drawn per-row caps (clipped at --tail_cap); "
    "0 gives every row --tail_cap.", lower_bound=0.0)
_TAIL_REPEATS = flags.DEFINE_integer("tail_repeats", 2, "Alternated repeats, long tail.")
_TAIL_STRATEGY = flags.DEFINE_string(
    "tail_strategy", "4_1_5", "SD strategy for the tail, or a comma-separated pool for the "
    "bandit (BEG-MAB), which keeps learning across the warm-up and the repeats.")
_TAIL_THRESHOLD = flags.DEFINE_integer("tail_threshold", 8, "SD on at <= this many live rows.")
_TAIL_TEMPERATURE = flags.DEFINE_float(
    "tail_temperature", 0.0, "Long-tail sampling temperature. At 0 both sides emit identical "
    "tokens (SD is exact), so their wall times compare the same work.")
_PRECOMPILE = flags.DEFINE_bool(
    "precompile", True, "Compile both sides' whole program pools before timing, so no timed "
    "run compiles. --noprecompile compiles only what the warm-up runs reach (where compiles "
    "are slow, e.g. a GPU with minutes to spare); a timed run that compiles shows in "
    "new_programs_timed.")
_SKIP_FIXED = flags.DEFINE_bool("skip_fixed", False, "Skip the fixed batches.")
_ACCEPT_PROMPTS = flags.DEFINE_integer(
    "accept_prompts", 24, "Part 3 (0 skips it): accept length alone, over this many prompts "
    "spread over six reasoning-gym tasks, SD on from the first step, at each temperature.",
    lower_bound=0)
_ACCEPT_STRATEGIES = flags.DEFINE_list("accept_strategies", ["8_8_32", "8_4_16", "4_1_5"],
                                       "Strategies of part 3.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _drawn_caps(rows: int):
  """Per-row caps: Pareto(alpha) from --tail_cap_min, clipped at --tail_cap."""
  if _TAIL_CAP_ALPHA.value == 0:
    return np.full(rows, _TAIL_CAP.value)
  rng = np.random.default_rng(_SEED.value)
  drawn = _TAIL_CAP_MIN.value * (1 + rng.pareto(_TAIL_CAP_ALPHA.value, rows))
  return np.minimum(drawn.astype(np.int64), _TAIL_CAP.value)


def _tail_share(stats: dict, threshold: int) -> float:
  """Fraction of a rollout's wall time at <= threshold live rows, from its live-rows trace.

  SD can only shorten this part, so with a tail speedup s the whole rollout gains at most
  1 / (1 - f + f / s) (Amdahl)."""
  total = stats["total_s"]
  tail_from = next((t for t, live in stats["rollout/live_rows"] if live <= threshold), total)
  return (total - tail_from) / total


_ACCEPT_TASKS = questions.MAIN_TASKS + ["leg_counting", "simple_equations", "letter_counting"]


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax
  import jax.numpy as jnp

  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.weights import rollout_layout
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.bandit import BanditConfig, parse_strategies
  from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
  from tlt_jax.rollout.weights import DraftWeights

  # Parts 1-2 need 64 (batch 16 and the long tail's rows); part 3 its own task mix.
  asked = questions.load({
      "main": (questions.MAIN_TASKS, max(64, _TAIL_ROWS.value), _SEED.value),
      "accept": (_ACCEPT_TASKS, _ACCEPT_PROMPTS.value, _SEED.value + 1)})
  model = load_model(_MODEL.value, dtype=jnp.float32)
  # The rollout's per-layer layout once, as the RL loop makes it once per weight version
  # (batch-1 settings run one generate per prompt).
  params = rollout_layout(model.params)
  tokenizer = model.tokenizer
  drafter, vocab_ids = load_drafter(_DRAFTER.value, model.config)
  vocab_ids = None if vocab_ids is None else jnp.asarray(vocab_ids)
  weights = DraftWeights(drafter, vocab_ids)
  # Each setting's SD memory (its bandit learns across that setting's rollouts), by spec;
  # the specs are kept with them, so an id is never reused.
  memories = {}
  memory_of = lambda spec: None if spec is None else memories.setdefault(
      id(spec), (spec, SpecMemory(spec)))[1]
  drafter_of = lambda spec: None if spec is None else weights
  eos = tuple(tokenizer.eos_token_ids)
  prompts = [tokenizer.chat_prompt(q) for q in asked["main"]]

  def spec_for(strategy, threshold, patience, flag):
    strategies = parse_strategies(strategy, flag)
    choice = (dict(strategy=strategies[0]) if len(strategies) == 1
              else dict(bandit=BanditConfig(strategies, seed=_SEED.value)))
    return SpecConfig(threshold=threshold, patience=patience, **choice)

  def timed(batch_prompts, sampling, spec, max_new, seed):
    start = time.perf_counter()
    result = generate(params, model.config, batch_prompts, max_new_tokens=max_new,
                      sampling=sampling, eos_ids=eos, seed=seed, spec=spec,
                      drafter=drafter_of(spec), memory=memory_of(spec),
                      attention_impl=_ATTENTION.value)
    return time.perf_counter() - start, result

  def timed_one_by_one(batch_prompts, sampling, spec, max_new, seed):
    """Each prompt as its own batch-1 rollout, in turn; stats summed over them."""
    start = time.perf_counter()
    results = [timed([prompt], sampling, spec, max_new, seed)[1] for prompt in batch_prompts]
    seconds = time.perf_counter() - start
    total = lambda key: sum(r.stats.get(key, 0) for r in results)
    stats = {"generated_tokens": total("generated_tokens"),
             "tokens_per_s": total("generated_tokens") / seconds,
             "compile/new_programs": total("compile/new_programs")}
    if spec is not None:
      verify_steps = total("spec/verify_steps")
      emitted = sum(r.stats["spec/accept_len"] * r.stats["spec/verify_steps"] for r in results)
      stats.update({"spec/verify_steps": verify_steps, "spec/accept_len": emitted / verify_steps})
    return seconds, types.SimpleNamespace(stats=stats)

  def precompile_both(rollouts, sampling, spec, max_new):
    """Both sides' whole program pools for these rollouts (lists of prompts), so that
    timed runs compile nothing (different draws reach other windows and buckets)."""
    if not _PRECOMPILE.value:
      return 0
    return sum(precompile(params, model.config, batch_prompts, max_new_tokens=max_new,
                          sampling=sampling, eos_ids=eos, spec=side,
                          drafter=drafter_of(side),
                          attention_impl=_ATTENTION.value)
               for batch_prompts in rollouts for side in (None, spec))

  def alternate(batch_prompts, sampling, spec, max_new, repeats, run=timed):
    """Warm-up both sides, then A B A B ... (each round's number its seed); returns
    per-side lists of (seconds, result)."""
    rounds = ab.alternate(
        {side: functools.partial(run, batch_prompts, sampling, side_spec, max_new)
         for side, side_spec in (("plain", None), ("sd", spec))}, repeats)
    return ab.side(rounds, "plain"), ab.side(rounds, "sd")

  def release_programs():
    """Drops earlier settings' compiled programs: each setting, the long tail and each
    accept rollout compile their own, and every executable keeps ~200 memory maps, so the
    whole run kept would reach the kernel's vm.max_map_count (65530) and LLVM fails to
    allocate."""
    jax.clear_caches()
    gc.collect()

  def summary(runs):
    tokens = [res.stats["generated_tokens"] for _, res in runs]
    out = {"seconds_median": statistics.median(s for s, _ in runs),
           "tokens_per_s_median": statistics.median(t / s for (s, _), t in zip(runs, tokens))}
    accept = [res.stats.get("spec/accept_len") for _, res in runs]
    if accept[0] is not None:
      out["accept_len_median"] = statistics.median(accept)
      out["verify_steps"] = runs[-1][1].stats["spec/verify_steps"]
    return out

  report = {"model": f"{_MODEL.value} (fp32, {jax.default_backend()})",
            "attention_impl": _ATTENTION.value, "drafter": _DRAFTER.value,
            "draft_vocab": None if vocab_ids is None else int(vocab_ids.shape[0]),
            "fixed": [], "long_tail": None, "accept": []}
  if not _SKIP_FIXED.value:
    for temperature in (float(t) for t in _TEMPERATURES.value):
      sampling = SamplingParams(temperature=temperature)
      for batch in (int(b) for b in _BATCHES.value):
        for strategy in _STRATEGIES.value:
          log(f"fixed batch={batch} T={temperature} strategy={strategy}")
          release_programs()
          spec = spec_for(strategy, batch, 0, "--strategies")
          rollouts = ([[p] for p in prompts[:_BATCH1_PROMPTS.value]] if batch == 1
                      else [prompts[:batch]])
          precompiled = precompile_both(rollouts, sampling, spec, _NEW_TOKENS.value)
          if batch == 1:
            plain, sd = alternate(prompts[:_BATCH1_PROMPTS.value], sampling, spec,
                                  _NEW_TOKENS.value, _REPEATS.value, run=timed_one_by_one)
          else:
            plain, sd = alternate(prompts[:batch], sampling, spec, _NEW_TOKENS.value,
                                  _REPEATS.value)
          # Throughput ratio: under sampling the two sides draw different tokens (and EOS at
          # different times), so their wall times cover different amounts of work.
          speedup = ab.paired_median([s[1].stats["tokens_per_s"] for s in sd],
                                     [p[1].stats["tokens_per_s"] for p in plain])
          entry = {"batch": batch, "temperature": temperature, "strategy": strategy,
                   "prompts": _BATCH1_PROMPTS.value if batch == 1 else batch,
                   "plain": summary(plain), "sd": summary(sd),
                   "speedup_paired_median": speedup,
                   "precompiled_programs": precompiled,
                   "new_programs_timed": sum(r[1].stats["compile/new_programs"]
                                             for r in plain + sd)}
          log(json.dumps(entry))
          report["fixed"].append(entry)

  if _TAIL_ROWS.value:
    release_programs()
    caps = _drawn_caps(_TAIL_ROWS.value)
    log(f"long tail: {_TAIL_ROWS.value} rows, caps p50 {int(np.median(caps))} max {max(caps)}")
    sampling = SamplingParams(temperature=_TAIL_TEMPERATURE.value)
    tail_spec = spec_for(_TAIL_STRATEGY.value, _TAIL_THRESHOLD.value, 10, "--tail_strategy")
    tail_prompts = prompts[:_TAIL_ROWS.value]
    # Both sides' whole program pools (every batch bucket, window and strategy the rollout
    # may reach) are compiled before anything is timed, so a bandit exploring never compiles.
    precompile_start = time.perf_counter()
    precompiled = {side: precompile(params, model.config, tail_prompts,
                                    max_new_tokens=caps, sampling=sampling, eos_ids=eos,
                                    spec=spec, drafter=drafter_of(spec),
                                    attention_impl=_ATTENTION.value)
                   if _PRECOMPILE.value else 0
                   for side, spec in (("plain", None), ("adaptive_sd", tail_spec))}
    log(f"precompiled {precompiled} programs in {time.perf_counter() - precompile_start:.0f}s")
    plain, sd = alternate(tail_prompts, sampling, tail_spec, caps, _TAIL_REPEATS.value)
    lengths = sorted(len(o.token_ids) for o in plain[-1][1].outputs)
    report["long_tail"] = {
        "rows": _TAIL_ROWS.value, "cap": _TAIL_CAP.value, "strategy": _TAIL_STRATEGY.value,
        "drawn_caps": {"pareto_alpha": _TAIL_CAP_ALPHA.value, "min": _TAIL_CAP_MIN.value,
                       "p50": int(np.median(caps)),
                       "rows_at_cap": int(np.sum(caps == _TAIL_CAP.value))},
        "temperature": _TAIL_TEMPERATURE.value,
        "sd_threshold": _TAIL_THRESHOLD.value,
        "response_len": {"p50": lengths[len(lengths) // 2],
                         "p90": lengths[int(len(lengths) * .9)], "max": lengths[-1]},
        "plain": summary(plain), "adaptive_sd": summary(sd),
        "sd_enabled_frac": sd[-1][1].stats.get("spec/enabled_frac"),
        "speedup_paired_median": ab.paired_median([p[0] for p in plain], [s[0] for s in sd]),
        "plain_wall_frac_at_threshold": statistics.median(
            _tail_share(p[1].stats, _TAIL_THRESHOLD.value) for p in plain),
        "sd_strategy_chunks": sd[-1][1].stats["spec/strategy_chunks"],
        "precompiled_programs": precompiled,
        "new_programs_timed": sum(r[1].stats["compile/new_programs"] for r in plain + sd),
        "bandit": (None if tail_spec.bandit is None
                   else memory_of(tail_spec).bandit.summary()),
        "live_rows_plain": plain[-1][1].stats["rollout/live_rows"],
        "live_rows_sd": sd[-1][1].stats["rollout/live_rows"],
    }
    log(json.dumps(report["long_tail"]))
  if _ACCEPT_PROMPTS.value:
    accept_prompts = [tokenizer.chat_prompt(q)
                      for q in asked["accept"][:_ACCEPT_PROMPTS.value]]
    for temperature in (float(t) for t in _TEMPERATURES.value):
      for strategy in _ACCEPT_STRATEGIES.value:
        log(f"accept T={temperature} strategy={strategy}")
        release_programs()
        result = generate(params, model.config, accept_prompts,
                          max_new_tokens=_NEW_TOKENS.value,
                          sampling=SamplingParams(temperature=temperature), eos_ids=eos,
                          seed=1, attention_impl=_ATTENTION.value, drafter=weights,
                          spec=spec_for(strategy, len(accept_prompts), 0, "--accept_strategies"))
        entry = {"temperature": temperature, "strategy": strategy,
                 "prompts": len(accept_prompts), "tasks": _ACCEPT_TASKS,
                 "accept_len": result.stats["spec/accept_len"],
                 "verify_steps": result.stats["spec/verify_steps"],
                 "generated_tokens": result.stats["generated_tokens"]}
        log(json.dumps(entry))
        report["accept"].append(entry)
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
