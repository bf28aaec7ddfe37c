"""What capturing the rollout's hidden states (drafter training data) costs: one long-tail
rollout on SmolLM2 with `capture_hidden` on and off, alternated.

  python benchmarks/hidden_capture.py [--settings=plain,learned,ngram] [--output=FILE]

Prints JSON. The rollout: --rows reasoning prompts whose per-row caps are drawn from a
Pareto law (most rows end early, a few run to --cap), as benchmarks/rollout.py's long tail,
at temperature 0, so both sides emit the same tokens (checked) and their wall times cover
the same work. Per setting (plain decoding; adaptive SD for the tail with the learned
drafter or the model-free one), both sides' program pools are precompiled, then an untimed
round and --repeats timed rounds, A B / B A (`ab.alternate`, mirrored); medians and the
paired median of capture / off wall time. Off, plain and model-free rollouts keep no
hidden state at all, and learned ones keep it only until the SD switch (the drafter's
prefill reads it), so capture's cost is the record in every step after that, the
compactions that carry it and its harvest to the host.
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ab, questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2", "Target: `smollm2` or a path (.gguf file, "
                             "HF dir, converted checkpoint dir).")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Warmed-up drafter dir.")
_SETTINGS = flags.DEFINE_list("settings", ["plain", "learned", "ngram"],
                              "Rollouts to measure: plain decoding, or adaptive SD drafting "
                              "with the learned or the model-free drafter.")
_ROWS = flags.DEFINE_integer("rows", 16, "Rows in the rollout.", lower_bound=1)
_CAP = flags.DEFINE_integer("cap", 256, "Length cap of the rollout.", lower_bound=1)
_CAP_MIN = flags.DEFINE_integer("cap_min", 32, "Smallest drawn per-row cap.", lower_bound=1)
_CAP_ALPHA = flags.DEFINE_float("cap_alpha", 1.5, "Pareto shape of the drawn per-row caps.",
                                lower_bound=0.1)
_STRATEGY = flags.DEFINE_string("strategy", "4_1_5", "SD strategy (DEPTH_TOPK_VERIFY).")
_THRESHOLD = flags.DEFINE_integer("sd_threshold", 4, "SD on at <= this many live rows.",
                                  lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed A B rounds per setting.", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")
SETTINGS = ("plain", "learned", "ngram")


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def drawn_caps(rows: int) -> np.ndarray:
  """Per-row caps: Pareto(--cap_alpha) from --cap_min, clipped at --cap."""
  rng = np.random.default_rng(_SEED.value)
  drawn = _CAP_MIN.value * (1 + rng.pareto(_CAP_ALPHA.value, rows))
  return np.minimum(drawn.astype(np.int64), _CAP.value)


def check_flags() -> None:
  from tlt_jax.errors import UserInputError
  unknown = [s for s in _SETTINGS.value if s not in SETTINGS]
  if unknown or not _SETTINGS.value:
    raise UserInputError(f"--settings={','.join(_SETTINGS.value)}: expected some of "
                         f"{','.join(SETTINGS)}")
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")


def side_summary(runs) -> dict:
  seconds = [s for s, _ in runs]
  return {"seconds_median": statistics.median(seconds), "seconds": seconds}


def main(argv):
  del argv
  check_flags()
  import jax.numpy as jnp

  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.weights import rollout_layout
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.spec_config import SpecConfig
  from tlt_jax.rollout.strategy import SpecStrategy
  from tlt_jax.rollout.weights import DraftWeights

  asked = questions.load({"main": (questions.MAIN_TASKS, _ROWS.value, _SEED.value)})
  model = load_model(_MODEL.value, dtype=jnp.float32)
  params = rollout_layout(model.params)   # the rollout's per-layer layout, made once
  drafter, vocab_ids = load_drafter(_DRAFTER.value, model.config)
  weights = DraftWeights(drafter, None if vocab_ids is None else jnp.asarray(vocab_ids))
  prompts = [model.tokenizer.chat_prompt(q) for q in asked["main"]]
  caps = drawn_caps(_ROWS.value)
  eos = tuple(model.tokenizer.eos_token_ids)
  strategy = SpecStrategy.parse(_STRATEGY.value)

  def rollout_args(setting: str) -> dict:
    spec = None if setting == "plain" else SpecConfig(
        kind=setting, strategy=strategy, threshold=_THRESHOLD.value, patience=10)
    return dict(max_new_tokens=caps, sampling=SamplingParams(temperature=0.0), eos_ids=eos,
                spec=spec, drafter=weights if setting == "learned" else None)

  def timed(setting: str, capture: bool, seed: int):
    start = time.perf_counter()
    result = generate(params, model.config, prompts, seed=seed, capture_hidden=capture,
                      **rollout_args(setting))
    return time.perf_counter() - start, result

  report = {"model": f"{_MODEL.value} (fp32)", "rows": _ROWS.value,
            "loadavg_1m": {"before": os.getloadavg()[0]},
            "caps": {"pareto_alpha": _CAP_ALPHA.value, "min": _CAP_MIN.value,
                     "p50": int(np.median(caps)), "max": int(caps.max())},
            "strategy": _STRATEGY.value, "sd_threshold": _THRESHOLD.value,
            "repeats": _REPEATS.value, "settings": []}
  for setting in _SETTINGS.value:
    log(f"{setting}: precompiling both sides")
    for capture in (False, True):
      precompile(params, model.config, prompts, capture_hidden=capture,
                 **rollout_args(setting))
    rounds = ab.alternate({side: functools.partial(timed, setting, side == "capture")
                           for side in ("off", "capture")}, _REPEATS.value, mirror=True)
    off, on = ab.side(rounds, "off"), ab.side(rounds, "capture")
    for (_, a), (_, b) in zip(off, on):
      if [o.token_ids for o in a.outputs] != [o.token_ids for o in b.outputs]:
        raise AssertionError(f"{setting}: capture changed the tokens")
    stats = on[-1][1].stats
    captured = [o.hidden_states for o in on[-1][1].outputs]
    entry = {"setting": setting, "off": side_summary(off), "capture": side_summary(on),
             "capture_over_off_paired_median": ab.paired_median([s for s, _ in on],
                                                                [s for s, _ in off]),
             "generated_tokens": stats["generated_tokens"],
             "batch_buckets": stats["rollout/batch_buckets"],
             "spec_enabled_frac": stats.get("spec/enabled_frac"),
             "captured_mib": sum(h.nbytes for h in captured) / 2 ** 20,
             "new_programs_timed": sum(r.stats["compile/new_programs"]
                                       for _, r in off + on)}
    log(str(entry))
    report["settings"].append(entry)
  report["loadavg_1m"]["after"] = os.getloadavg()[0]
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
