"""One speculative step's time on SmolLM2, per drafter kind and live batch: the verify
pass and everything around it, without the rollout's other costs.

  python benchmarks/spec_step.py [--batches=4,16] [--temperature=1] [--output=FILE]

Prints JSON. For each live batch B: B samples of one held-out reasoning-gym math prompt (a
GRPO group), SD on from the first step with the chain --strategy, drafted by the shipped
learned drafter and by the model-free chain over the group's text. Each kind's rollout
runs until its first SD chunk, whose input state is kept; then that chunk (--chunk_steps
verify steps) is run again from the kept state, the kinds alternated, --repeats times.
Same state, same draws: every repeat does the same work, so the medians compare code, not
contexts (benchmarks/ab_commits.py runs this script on two commits). Per kind: ms per
verify step (median) and the steps a chunk ran.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import ab, questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from experiments import cli  # noqa: E402
from tlt_jax.errors import UserInputError  # noqa: E402

_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Warmed-up drafter dir.")
_BATCHES = flags.DEFINE_list("batches", ["4", "16"], "Live batch sizes.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0: greedy).",
                                  lower_bound=0)
_STRATEGY = flags.DEFINE_string("strategy", "4_1_5", "SD chain DEPTH_1_DEPTH+1.")
_CHUNK_STEPS = flags.DEFINE_integer("chunk_steps", 8, "Verify steps per timed chunk.",
                                    lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 21, "Timed chunks per kind, alternated.",
                                lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")


@contextlib.contextmanager
def first_chunk_kept(speculative, kept: dict, kind: str):
  """While open, the engine's first `spec_chunk` call keeps a copy of its arguments."""
  import jax
  run = speculative.spec_chunk

  def keep(*args, **kwargs):
    if kind not in kept:   # the state is donated: keep a copy
      kept[kind] = (args[:-1], jax.tree.map(lambda x: x.copy(), args[-1]), kwargs)
    return run(*args, **kwargs)

  speculative.spec_chunk = keep
  try:
    yield
  finally:
    speculative.spec_chunk = run


def main(argv):
  del argv
  from tlt_jax.rollout.strategy import SpecStrategy
  strategy = SpecStrategy.parse(_STRATEGY.value, "--strategy")
  if strategy.topk != 1:
    raise UserInputError(f"--strategy={_STRATEGY.value}: must be a chain (TOPK 1), "
                             "the one shape both kinds draft")
  if not all(b.isdigit() and int(b) > 0 for b in _BATCHES.value):
    raise UserInputError(f"--batches={','.join(_BATCHES.value)}: must be positive integers")
  batches = [int(b) for b in _BATCHES.value]
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax
  import jax.numpy as jnp

  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.weights import rollout_layout
  from tlt_jax.rollout import engine, speculative
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.spec_config import SpecConfig
  from tlt_jax.rollout.weights import DraftWeights
  from tlt_jax.rollout.sampling import SamplingParams

  model = load_model("smollm2", dtype=jnp.float32)
  params, config = rollout_layout(model.params), model.config
  drafter, vocab_ids = load_drafter(_DRAFTER.value, config)
  asked = questions.load({"main": (questions.MAIN_TASKS, 1, _SEED.value)})["main"]
  prompt = model.tokenizer.chat_prompt(asked[0])
  sampling = SamplingParams(temperature=_TEMPERATURE.value)
  # Each kind's SD config fields and drafter weights.
  kinds = {"learned": ({}, DraftWeights(drafter, jnp.asarray(vocab_ids))),
           "ngram": ({"kind": "ngram"}, None)}
  report = {"model": "smollm2 (fp32)", "strategy": strategy.name,
            "temperature": _TEMPERATURE.value, "chunk_steps": _CHUNK_STEPS.value,
            "repeats": _REPEATS.value, "batches": []}
  for batch in batches:
    kept = {}
    for kind, (fields, weights) in kinds.items():
      print(f"batch {batch}, {kind}: rollout to its first SD chunk", file=sys.stderr,
            flush=True)
      with first_chunk_kept(engine.speculative, kept, kind):
        generate(params, config, [prompt] * batch, max_new_tokens=8 * _CHUNK_STEPS.value,
                 sampling=sampling, eos_ids=tuple(model.tokenizer.eos_token_ids), seed=0,
                 spec=SpecConfig(strategy=strategy, threshold=batch, patience=0, **fields),
                 drafter=weights, group_ids=[0] * batch)

    def chunk(kind):
      args, state, kwargs = kept[kind]
      state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
      start = time.perf_counter()
      out = jax.block_until_ready(speculative.spec_chunk(
          *args, state, **dict(kwargs, chunk_steps=_CHUNK_STEPS.value)))
      seconds = time.perf_counter() - start   # the step count is read off the clock
      return seconds, int(jnp.max(out.spec_steps - kept[kind][1].spec_steps))

    # A warm-up round (it compiles), then the kinds in turn.
    rounds = ab.alternate({kind: lambda _, kind=kind: chunk(kind) for kind in kinds},
                          _REPEATS.value)
    report["batches"].append({"batch": batch, **{
        kind: {"ms_per_step_median": statistics.median(
                   seconds * 1e3 / steps for seconds, steps in ab.side(rounds, kind)),
               "steps_per_chunk": rounds[-1][kind][1]}
        for kind in kinds}})
  emit(report, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
