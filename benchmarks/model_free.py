"""Model-free and hybrid drafting on SmolLM2: plain, learned, model-free and hybrid SD, side
by side in one run.

  python benchmarks/model_free.py [--drafter=assets/drafter_smollm2] [--output=FILE]

Prints JSON. Rollouts of G (--group_size) samples of held-out reasoning-gym math prompts,
at each temperature and live batch size B, SD on from the first step. A group larger than
B runs as G/B consecutive rollouts of B of its samples, the later ones reading the earlier
ones' responses as draft context (siblings that finished first); B >= G runs B/G groups
at once. Variants:
  plain; learned (the drafter alone); ngram_prompt (each row's own prompt and text);
  ngram_siblings (+ the group's other samples); ngram_epoch (+ an earlier epoch's responses
  to the prompt: a plain rollout of the same groups at another seed); hybrid (the learned
  drafter and ngram_epoch's context, each row picking per verify step).
After precompiling every variant's programs and one warm-up of each, a round runs every
variant once, in turn (alternated), --repeats rounds. Per variant: medians of tokens/s and
accept length, and the median over rounds of its tokens/s over plain's in the same round
(paired ratios); its verify step's time (`step_ms_median`, from SD chunks at the full
batch, which span about the same contexts for every variant: the prompt to the first
row's end) and the drafter's time in model-free steps (`draft_cost_measured`, the d of
benchmarks/research/model_free_ceiling.py's hybrid bound, when both verify the same chain).
`goals` checks issue 17's targets at each setting.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab, questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2", "Target: `smollm2` or a path.")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Warmed-up drafter dir.")
_BATCHES = flags.DEFINE_list("batches", ["1", "4", "16"], "Live batch sizes.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["1", "0"], "Sampling temperatures.")
_GROUP = flags.DEFINE_integer("group_size", 8, "Samples per prompt (G).", lower_bound=1)
_STRATEGY = flags.DEFINE_string("strategy", "4_1_5", "SD chain DEPTH_1_DEPTH+1 of the "
                                "learned and hybrid variants (hybrid drafts are chains).")
_NGRAM_STRATEGY = flags.DEFINE_string(
    "ngram_strategy", None, "The model-free variants' strategy (a tree of the matches' "
    "continuations with TOPK > 1); default --strategy.")
_MAX_NGRAM = flags.DEFINE_integer("max_ngram", 4, "Longest suffix matched.", lower_bound=1)
_DRAFT_COST = flags.DEFINE_float("draft_cost", 0.2, "Hybrid: a learned draft's time in "
                                 "verify passes (tlt_jax.rollout.hybrid.HybridConfig).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per row.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternated rounds per setting.", lower_bound=1)
_PRECOMPILE = flags.DEFINE_bool("precompile", True, "Compile every variant's programs before "
                                "timing, so that no timed run compiles.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")
_VARIANTS = flags.DEFINE_list("variants", None, "Run only these variants (plain always "
                              "runs: the paired ratios' base); default all.")
_PROMPTS = flags.DEFINE_integer("prompts", None, "Prompts (groups); default enough for the "
                                "largest batch, at least 1.", lower_bound=1)

VARIANTS = ("plain", "learned", "ngram_prompt", "ngram_siblings", "ngram_epoch", "hybrid")
# What each variant's rows draft from: (drafter kind, the group's rows, earlier siblings'
# and an earlier epoch's responses).
_SOURCES = {"plain": (None, False, False), "learned": ("learned", False, False),
            "ngram_prompt": ("ngram", False, False), "ngram_siblings": ("ngram", True, False),
            "ngram_epoch": ("ngram", True, True), "hybrid": ("hybrid", True, True)}


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def calls_of(num_groups: int, group_size: int, batch: int) -> list[list[tuple[int, int]]]:
  """The rollouts a setting runs, each a list of (group, sample) rows: B/G whole groups at
  once, or each group's samples B at a time."""
  samples = [(g, i) for g in range(num_groups) for i in range(group_size)]
  return [samples[k:k + batch] for k in range(0, len(samples), batch)]


def draft_inputs(call, done: dict, epoch: dict | None, group_size: int, siblings: bool,
                 batch: int) -> tuple[list[int], list[list[int]]]:
  """group_ids (one group per prompt when `siblings`, else one per row) and each row's extra
  draft text: its share (samples i % B == its place) of its group's responses finished in
  earlier rollouts (`done`, when `siblings`) and of the earlier epoch's (`epoch`). The
  shares put each response of the group in exactly one row's extra."""
  width = min(batch, group_size)
  groups, extras = [], []
  for place, (g, i) in enumerate(call):
    groups.append(g if siblings else place)
    extra = []
    for j in range(group_size):
      if j % width != i % width:
        continue
      if siblings and (g, j) in done:
        extra += done[g, j]
      if epoch is not None:
        extra += epoch[g, j]
    extras.append(extra)
  return groups, extras


_CHUNK_STEPS = 16   # verify steps per SD chunk (generate's chunk_steps)


def full_chunk_seconds(stats: dict, batch: int) -> list[float]:
  """Seconds of each SD chunk that ran `_CHUNK_STEPS` verify steps at the full `batch`:
  begun with every row live and already speculating (not the chunk that started SD, which
  also prefills the drafter; a trace point is recorded before that boundary's compaction
  and switch), ended with some row still live (a chunk stops early only when all are
  done)."""
  points = [(seconds, spec, live) for (seconds, _, _, spec), (_, live)
            in zip(stats["rollout/context"], stats["rollout/live_rows"])]
  return [end - begin for (begin, spec, live_before), (end, _, live_after)
          in zip(points, points[1:]) if spec and live_before == batch and live_after > 0]


def goals(entry: dict, rounds: list[dict], temperature: float, batch: int) -> dict:
  """Issue 17's targets at one setting, those whose variants ran; speeds compared as the
  median over rounds of the two variants' tokens/s ratio in the same round."""
  paired = lambda a, b: ab.paired_median([r[a]["tokens_per_s"] for r in rounds],
                                         [r[b]["tokens_per_s"] for r in rounds])
  ran = lambda *vs: all(v in entry for v in vs)
  out = {}
  if ran("hybrid", "learned", "ngram_epoch"):
    # Within noise: at most 5% below the better one.
    out["hybrid_ge_best_of_learned_and_model_free"] = min(
        paired("hybrid", "learned"), paired("hybrid", "ngram_epoch")) >= 0.95
  if ran("hybrid", "learned"):
    out["hybrid_over_learned"] = paired("hybrid", "learned")
    if batch >= 4:
      out["hybrid_ge_1.2x_learned"] = out["hybrid_over_learned"] >= 1.2
  if temperature == 1 and ran("ngram_siblings"):
    out["ngram_siblings_accept_ge_2"] = entry["ngram_siblings"]["accept_len_median"] >= 2.0
  return out


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax
  import jax.numpy as jnp

  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.errors import UserInputError
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.weights import rollout_layout
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.hybrid import HybridConfig
  from tlt_jax.rollout.ngram import NgramConfig
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
  from tlt_jax.rollout.strategy import SpecStrategy
  from tlt_jax.rollout.weights import DraftWeights

  batches = [int(b) for b in _BATCHES.value]
  variants = VARIANTS if _VARIANTS.value is None else ("plain",) + tuple(
      v for v in VARIANTS if v != "plain" and v in _VARIANTS.value)
  unknown = sorted(set(_VARIANTS.value or ()) - set(VARIANTS))
  if unknown:
    raise UserInputError(f"--variants: unknown {','.join(unknown)} (known: "
                         f"{','.join(VARIANTS)})")
  group = _GROUP.value
  for b in batches:
    if b < 1 or (b % group if b >= group else group % b):
      raise UserInputError(f"--batches={b}: must divide --group_size={group} or be a "
                           "multiple of it")
  num_prompts = _PROMPTS.value or max(1, max(batches) // group)
  if group * num_prompts < max(batches):
    raise UserInputError(f"--prompts={num_prompts}: {group * num_prompts} rows, fewer than "
                         f"--batches={max(batches)}")
  strategy = SpecStrategy.parse(_STRATEGY.value)
  ngram_strategy = (strategy if _NGRAM_STRATEGY.value is None
                    else SpecStrategy.parse(_NGRAM_STRATEGY.value, "--ngram_strategy"))
  asked = questions.load({"main": (questions.MAIN_TASKS, num_prompts, _SEED.value)})["main"]
  model = load_model(_MODEL.value, dtype=jnp.float32)
  params = rollout_layout(model.params)   # the rollout's layout, once for every rollout
  tokenizer = model.tokenizer
  drafter, vocab_ids = load_drafter(_DRAFTER.value, model.config)
  weights = DraftWeights(drafter, None if vocab_ids is None else jnp.asarray(vocab_ids))
  eos = tuple(tokenizer.eos_token_ids)
  prompts = [tokenizer.chat_prompt(q) for q in asked]
  ngram_config = NgramConfig(max_ngram=_MAX_NGRAM.value)
  sd = dict(strategy=strategy, patience=0)
  # Per kind: the SD config, the drafter weights it needs and its memory, which carries a
  # picking hybrid's batch counts from one call of a setting to the next.
  with_memory = lambda spec, drafter: dict(spec=spec, drafter=drafter, memory=SpecMemory(spec))
  make_specs = lambda batch: {
      "plain": dict(spec=None),
      "learned": dict(spec=SpecConfig(threshold=batch, **sd), drafter=weights),
      "ngram": dict(spec=SpecConfig(kind="ngram", ngram_config=ngram_config, threshold=batch,
                                    patience=0, strategy=ngram_strategy)),
      "hybrid": with_memory(SpecConfig(
          kind="hybrid", ngram_config=ngram_config, threshold=batch,
          hybrid=HybridConfig(draft_cost=_DRAFT_COST.value), **sd), weights)}

  def rollout_args(call, kind, siblings, use_epoch, done, epoch, batch):
    args = dict(max_new_tokens=_NEW_TOKENS.value, eos_ids=eos, chunk_steps=_CHUNK_STEPS)
    if kind in ("ngram", "hybrid"):
      args["group_ids"], args["draft_context"] = draft_inputs(
          call, done, epoch if use_epoch else None, group, siblings, batch)
    return args

  def run(variant, batch, sampling, seed, epoch, specs, compile_only=False):
    """One variant's rollouts of the setting, in turn: seconds, tokens, accept, shares."""
    kind, siblings, use_epoch = _SOURCES[variant]
    sd_args = specs[kind or "plain"]
    spec = sd_args["spec"]
    done, seconds, tokens, steps, emitted, new_programs = {}, 0.0, 0, 0, 0.0, 0
    learned_steps, chunk_seconds = 0.0, []
    for k, call in enumerate(calls_of(num_prompts, group, batch)):
      rows = [prompts[g] for g, _ in call]
      args = rollout_args(call, kind, siblings, use_epoch, done, epoch, batch)
      if compile_only:
        new_programs += precompile(params, model.config, rows, sampling=sampling,
                                   spec=spec, drafter=sd_args.get("drafter"), **args)
        # Full-length stand-ins: the draft pool's length bucket depends on the text lengths
        # (a shorter real response can land in a smaller bucket: counted in new_programs).
        done.update({row: [0] * _NEW_TOKENS.value for row in call})
        continue
      start = time.perf_counter()
      result = generate(params, model.config, rows, sampling=sampling,
                        seed=seed * 1000 + k, **sd_args, **args)
      seconds += time.perf_counter() - start
      stats = result.stats
      tokens += stats["generated_tokens"]
      new_programs += stats["compile/new_programs"]
      for (g, i), out in zip(call, result.outputs):
        done[g, i] = out.token_ids
      if spec is not None:
        steps += stats["spec/verify_steps"]
        emitted += stats["spec/accept_len"] * stats["spec/verify_steps"]
        learned_steps += (stats["spec/verify_share_by_drafter"].get("learned", 0.0)
                          * stats["spec/verify_steps"])
        chunk_seconds += full_chunk_seconds(stats, batch)
    out = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
           "new_programs": new_programs, "responses": done}
    if steps:
      out.update(accept_len=emitted / steps, learned_share=learned_steps / steps)
    if chunk_seconds:
      out["step_ms"] = 1e3 * statistics.median(chunk_seconds) / _CHUNK_STEPS
    if compile_only:
      log(f"  {variant}: {new_programs} programs compiled")
    else:
      log(f"  {variant}: {out['tokens_per_s']:.1f} tok/s"
          + (f", accept {out['accept_len']:.2f}" if steps else ""))
    return out

  report = {"model": f"{_MODEL.value} (fp32, {jax.default_backend()})",
            "drafter": _DRAFTER.value, "strategy": strategy.name,
            "ngram_strategy": ngram_strategy.name, "group_size": group,
            "prompts": num_prompts, "max_new_tokens": _NEW_TOKENS.value,
            "hybrid_draft_cost": _DRAFT_COST.value,
            "hybrid_pick_memory": "carried from call to call within a setting", "settings": []}
  for temperature in (float(t) for t in _TEMPERATURES.value):
    sampling = SamplingParams(temperature=temperature)
    # The earlier epoch: a plain rollout of every group at another seed.
    rows = min(max(batches), group * num_prompts)
    epoch = run("plain", rows, sampling, 999, None, make_specs(rows))
    epoch = epoch["responses"]
    for batch in batches:
      log(f"T={temperature} batch={batch}")
      # Each executable keeps ~200 memory maps: a whole run's would reach vm.max_map_count
      # (65530) and LLVM fails to allocate (as benchmarks/rollout.py found).
      jax.clear_caches()
      gc.collect()
      compiled, specs = 0, make_specs(batch)
      if _PRECOMPILE.value:
        compiled = sum(run(v, batch, sampling, 0, epoch, specs, compile_only=True)
                       ["new_programs"] for v in variants)
      # A warm-up round, then every variant in turn, each round's number its seed.
      rounds = ab.alternate({v: functools.partial(run, v, batch, sampling, epoch=epoch,
                                                  specs=specs) for v in variants},
                            _REPEATS.value)
      entry = {"temperature": temperature, "batch": batch, "precompiled_programs": compiled,
               "new_programs_timed": sum(x["new_programs"] for r in rounds for x in r.values())}
      for v in variants:
        runs = [r[v] for r in rounds]
        entry[v] = {"tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in runs),
                    "speedup_paired_median": ab.paired_median(
                        [x["tokens_per_s"] for x in runs],
                        [x["tokens_per_s"] for x in ab.side(rounds, "plain")]),
                    # Nonzero: a timed run compiled (its figures measure the compiler too).
                    "new_programs_timed": sum(x["new_programs"] for x in runs)}
        if "accept_len" in runs[0]:
          entry[v]["accept_len_median"] = statistics.median(x["accept_len"] for x in runs)
        if v.startswith("hybrid"):
          entry[v]["learned_share_median"] = statistics.median(x["learned_share"] for x in runs)
        timed = [x["step_ms"] for x in runs if "step_ms" in x]
        if timed:
          entry[v]["step_ms_median"] = statistics.median(timed)
      # The drafter's time in model-free verify steps (the hybrid's d), paired by round;
      # only where both verify the same shape (the hybrid's chains are --strategy's).
      timed_rounds = [r for r in rounds if all("step_ms" in r.get(v, {})
                                               for v in ("learned", "ngram_epoch"))]
      if timed_rounds and ngram_strategy == strategy:
        entry["draft_cost_measured"] = ab.paired_median(
            [r["learned"]["step_ms"] for r in timed_rounds],
            [r["ngram_epoch"]["step_ms"] for r in timed_rounds]) - 1
      entry["goals"] = goals(entry, rounds, temperature, batch)
      log(json.dumps(entry))
      report["settings"].append(entry)
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
