"""Long-context rollout: cost per token and peak memory by cache length, plain and SD.

  python benchmarks/long_context.py [--model=tiny|smollm2|PATH] [--drafter=DIR]
      [--cache_lengths=1024,2048,4096,8192] [--output_json=FILE]

Prints one JSON object. Each cache length L runs in a child process of its own (so its peak
RSS, and on a GPU its device peak, belong to that length alone): a rollout of --rows prompts
of min(--prompt_len, L/2) tokens whose caps halve from row to row, the longest filling the
cache. Compaction shrinks the batch as rows finish, decode chunks attend over page x 2^k
windows, and SD switches on (after --sd_patience steps) once one row is left, so the
drafter prefill at the switch runs over that row's long context. Plain and SD rollouts
alternate after a warm-up rollout of each side (it compiles their programs); figures are
medians. Per-token time at L is a chunk's seconds per emitted token while the longest row
is in the last window (L/2, L] (one live row), from the engine's `rollout/context` trace.
Also per L: the SD switch's drafter prefill against the target's prefill of the same rows
of ~L tokens (issue 18: within 2x), alternated, compile excluded.

The default model is a tiny random Llama with a random drafter (greedy, no EOS: both sides
emit the same tokens); acceptance is not the point, the costs are.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import emit  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_MODEL = flags.DEFINE_string("model", "tiny", "`tiny` (a random 4-layer Llama, hidden 128) "
                             "or what load_model takes: `smollm2`, a .gguf file, a model dir.")
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter dir; default: a random drafter.")
_CACHE_LENGTHS = flags.DEFINE_list("cache_lengths", ["1024", "2048", "4096", "8192"],
                                   "Cache lengths measured, each in its own process.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens (at most half the "
                                   "cache length).", lower_bound=1)
_ROWS = flags.DEFINE_integer("rows", 4, "Rows per rollout; row i's cap is the longest's / 2^i.",
                             lower_bound=1)
_STRATEGY = flags.DEFINE_string("strategy", "4_1_5", "SD strategy.")
_SD_PATIENCE = flags.DEFINE_integer("sd_patience", 16, "Steps at one live row before SD.",
                                    lower_bound=0)
_CHUNK_STEPS = flags.DEFINE_integer("chunk_steps", 16, "Decode steps per chunk.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternated plain/SD rollouts per length.",
                                lower_bound=1)
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 2, "Rows of the switch-prefill "
                                     "comparison (0 skips it).", lower_bound=0)
_ATTENTION = flags.DEFINE_enum("attention_impl", "auto", ["auto", "reference", "pallas", "triton"],
                               "Attention kernel (auto: Pallas on GPU, jnp elsewhere).")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt and random-model seed.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON here.")
_CHILD = flags.DEFINE_integer("child_length", None, "Internal: measure this cache length in "
                              "this process and print its JSON line.")


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _lengths() -> list[int]:
  try:
    lengths = [int(n) for n in _CACHE_LENGTHS.value]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 256:
    raise UserInputError(f"--cache_lengths={','.join(_CACHE_LENGTHS.value)}: need integers "
                         ">= 256")
  return lengths


def _peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(jnp):
  """(params, config, drafter, vocab_ids): the tiny random pair, or a loaded model."""
  import jax
  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.drafter import init_drafter_params
  if _MODEL.value == "tiny":
    config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=128,
                         intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=32, max_position_embeddings=max(_lengths()))
    params = transformer.init_params(config, jax.random.key(_SEED.value))
  else:
    from tlt_jax.models.loading import load_model
    model = load_model(_MODEL.value, dtype=jnp.float32)
    config, params = model.config, model.params
  if _DRAFTER.value is None:
    return params, config, init_drafter_params(config, jax.random.key(_SEED.value + 1)), None
  drafter, vocab_ids = load_drafter(_DRAFTER.value, config)
  return params, config, drafter, None if vocab_ids is None else jnp.asarray(vocab_ids)


def _per_token_ms(stats: dict, cache_length: int, speculative: bool) -> float:
  """Median ms per emitted token of the chunks run while the longest live row was in the
  last window, (L/2, L], and of the rollout's side (plain, or SD once switched on)."""
  trace = stats["rollout/context"]
  rates = [1e3 * (now - before) / emitted
           for (before, longest, _, _), (now, _, emitted, spec) in zip(trace, trace[1:])
           if longest > cache_length // 2 and emitted > 0 and spec == speculative]
  return statistics.median(rates)


def _rollout_figures(runs: list, cache_length: int, speculative: bool) -> dict:
  out = {"per_token_ms_last_window": statistics.median(
             _per_token_ms(r.stats, cache_length, speculative) for r in runs),
         "tokens_per_s": statistics.median(r.stats["tokens_per_s"] for r in runs),
         "seconds": statistics.median(r.stats["total_s"] for r in runs),
         "batch_buckets": runs[-1].stats["rollout/batch_buckets"],
         "new_programs_timed": sum(r.stats["compile/new_programs"] for r in runs)}
  if speculative:
    out.update({"accept_len": runs[-1].stats["spec/accept_len"],
                "sd_on_at_s": runs[-1].stats["spec/on_at_s"]})
  return out


def _measure_rollouts(params, config, spec, weights, cache_length: int) -> dict:
  """Plain and SD rollouts filling a cache of `cache_length`, alternated."""
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.speculative import cache_margin
  prompt_len = min(_PROMPT_LEN.value, cache_length // 2)
  longest = cache_length - prompt_len - cache_margin(spec.strategies)
  caps = [max(1, longest >> i) for i in range(_ROWS.value)]
  rng = np.random.default_rng(_SEED.value)
  prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in caps]
  args = dict(max_new_tokens=caps, sampling=SamplingParams(temperature=0.0),
              chunk_steps=_CHUNK_STEPS.value, attention_impl=_ATTENTION.value)
  # Greedy, no EOS, fixed caps: a warm-up rollout per side compiles every program the
  # timed ones run (new_programs_timed checks it).
  start = time.perf_counter()
  for s in (None, spec):
    generate(params, config, prompts, spec=s, drafter=s and weights, **args)
  log(f"  L={cache_length}: warm-up (compiles) {time.perf_counter() - start:.0f}s")
  runs = {"plain": [], "sd": []}
  for repeat in range(_REPEATS.value):
    for side, s in (("plain", None), ("sd", spec)):
      runs[side].append(generate(params, config, prompts, spec=s, drafter=s and weights,
                                 **args))
      log(f"  L={cache_length} {side} #{repeat}: {runs[side][-1].stats['total_s']:.1f}s")
  plain, sd = (_rollout_figures(runs[side], cache_length, side == "sd") for side in runs)
  return {"prompt_len": prompt_len, "caps": caps,
          "cache_length_used": runs["plain"][-1].stats["cache_length"],
          "plain": plain, "sd": sd,
          "sd_over_plain_per_token": (sd["per_token_ms_last_window"]
                                      / plain["per_token_ms_last_window"])}


def _measure_switch_prefill(params, config, spec, weights, cache_length: int) -> dict:
  """The SD switch's drafter prefill against the target prefill of the same rows (each of
  ~cache_length tokens), alternated; the first round compiles and is dropped."""
  import jax
  from tlt_jax.models.kv_cache import init_cache
  from tlt_jax.rollout import engine
  from tlt_jax.rollout.buckets import BucketSpec
  from tlt_jax.rollout.drafting import DraftInputs
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.speculative import cache_margin
  rows, buckets = _PREFILL_ROWS.value, BucketSpec()
  context = cache_length - cache_margin(spec.strategies) - 1
  rng = np.random.default_rng(_SEED.value + 1)
  prompts = [rng.integers(0, config.vocab_size, context).tolist() for _ in range(rows)]
  plan = engine.plan_rollout(prompts, 1, config, buckets, spec, ())
  tokens, lengths, live, _ = engine.sorted_rows(prompts, plan.batch, plan.prompt_len)
  prefill_len = engine.drafter_prefill_len(context, plan, buckets)
  static = dict(config=config, sampling=SamplingParams(temperature=0.0), eos_ids=(),
                max_new_tokens=1, attention_impl=_ATTENTION.value)
  target_s, switch_s = [], []
  for _ in range(_REPEATS.value + 1):
    start = time.perf_counter()
    state = jax.block_until_ready(engine.prefill(
        params, tokens, lengths, live, np.ones_like(lengths),
        init_cache(config, plan.batch, plan.cache_len, params["embed"].dtype, per_layer=True),
        jax.random.key(0), buckets=buckets, keep_hidden=True, rules=None, **static))
    target_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    jax.block_until_ready(engine.switch_to_speculation(
        DraftInputs(params, weights, None), config, spec.strategies, state, plan, prefill_len,
        False, _ATTENTION.value, None))
    switch_s.append(time.perf_counter() - start)
  target, switch = statistics.median(target_s[1:]), statistics.median(switch_s[1:])
  return {"rows": rows, "context": context, "prefill_len": prefill_len,
          "target_prefill_s": target, "drafter_prefill_s": switch,
          "drafter_over_target": switch / target}


def _child(cache_length: int) -> None:
  """Measures one cache length; prints its JSON on the last stdout line."""
  import jax
  import jax.numpy as jnp
  from tlt_jax.rollout.spec_config import SpecConfig
  from tlt_jax.rollout.strategy import SpecStrategy
  from tlt_jax.rollout.weights import DraftWeights, place_rollout
  params, config, drafter, vocab_ids = _load(jnp)
  spec = SpecConfig(threshold=1, patience=_SD_PATIENCE.value,
                    strategy=SpecStrategy.parse(_STRATEGY.value, "--strategy"))
  weights = DraftWeights(drafter, vocab_ids)
  baseline = _peak_rss_mib()
  result = {"cache_length": cache_length,
            **_measure_rollouts(params, config, spec, weights, cache_length)}
  # Taken before the prefill comparison, whose rows of ~L tokens are not the rollout's.
  result["memory"] = _memory(jax, baseline)
  if _PREFILL_ROWS.value:
    placed, placed_weights = place_rollout(params, config, weights, None)
    result["switch_prefill"] = _measure_switch_prefill(placed, config, spec, placed_weights,
                                                       cache_length)
    result["switch_prefill"]["memory"] = _memory(jax, baseline)
  print(json.dumps(result), flush=True)


def _memory(jax, baseline_mib: float) -> dict:
  """Peak RSS so far, and over `baseline_mib` (after setup); the device's peak where the
  backend reports one (GPU)."""
  device_stats = jax.devices()[0].memory_stats() or {}
  peak = _peak_rss_mib()
  return {"peak_rss_mib": peak, "peak_rss_over_setup_mib": peak - baseline_mib,
          "device_peak_mib": (device_stats["peak_bytes_in_use"] / 2**20
                              if "peak_bytes_in_use" in device_stats else None)}


def _run_child(cache_length: int) -> dict:
  log(f"cache length {cache_length}")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                         f"--child_length={cache_length}"], stdout=subprocess.PIPE, text=True)
  if proc.returncode:
    raise UserInputError(f"cache length {cache_length}: child exited {proc.returncode}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _growth(per_length: list[dict], figure) -> list[float]:
  """figure(L) / figure(previous L), per consecutive pair of lengths."""
  values = [figure(entry) for entry in per_length]
  return [b / a for a, b in zip(values, values[1:])]


def main(argv):
  del argv
  lengths = _lengths()
  if _CHILD.value is not None:
    _child(_CHILD.value)
    return
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output_json")
  import jax
  per_length = [_run_child(length) for length in lengths]
  per_token = lambda side: (lambda e: e[side]["per_token_ms_last_window"])
  report = {
      "model": f"{_MODEL.value} (fp32, {jax.default_backend()})",
      "drafter": _DRAFTER.value or "random", "strategy": _STRATEGY.value, "rows": _ROWS.value,
      "prompt_len": _PROMPT_LEN.value, "chunk_steps": _CHUNK_STEPS.value,
      "repeats": _REPEATS.value, "attention_impl": _ATTENTION.value,
      "method": "each cache length in its own process; plain and SD rollouts alternated "
                "after a warm-up rollout of each side, medians; per-token time from the engine's "
                "rollout/context trace, chunks whose longest row is in (L/2, L]; memory: "
                "the process's peak RSS (ru_maxrss) after both sides' rollouts (the "
                "switch_prefill entry's: after that comparison too), device peak where the "
                "backend reports one. Timings on a shared machine: noisy.",
      "per_length": per_length,
      "growth_per_doubling": {
          "plain_per_token": _growth(per_length, per_token("plain")),
          "sd_per_token": _growth(per_length, per_token("sd")),
          "peak_rss_over_setup": _growth(per_length,
                                         lambda e: e["memory"]["peak_rss_over_setup_mib"])},
  }
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
