"""Which way, and how fast, does online training move a warm drafter? The shipped drafter
fine-tuned on its target's own sampled responses exactly as the spot trainer does it (the
online buffer's packed batches, `trainer.train_step` with the spot trainer's AdamW) at
several peak learning rates and warm-ups, scored after each number of steps by the deploy
gate's estimate (expected accepted length of a depth-2 chain under sampling) on held-out
windows of the same responses.

  python benchmarks/research/online_drafter_lr.py [--lrs=3e-4,1e-4,3e-5] [--warmups=0,20]
      [--eval_at=1,2,4,8,16,32] [--prompts=48] [--model=smollm2|RUN/hf_export]
      [--tasks=gsm_symbolic,...] [--output=FILE]

Prints JSON: the deployed drafter's held-out score, then per (lr, warm-up) the candidate's
score and train loss at each evaluation step. Every setting trains on the same batches in
the same order. The responses come from the bundled SmolLM2 at T=1 (reasoning-gym prompts
held out from the drafter's training), with the rollout's own captured hidden states; with
--model=RUN/hf_export, from a policy RL has moved away from the one the drafter learned;
with --tasks naming tasks the drafter never saw, from a new domain.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import questions  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from absl import flags  # noqa: E402
from experiments import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", "smollm2", "Target: `smollm2` or a path (an RL run's "
                             "hf_export: a policy the drafter was not trained on).")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_smollm2", "Warmed-up drafter dir.")
_LRS = flags.DEFINE_list("lrs", ["3e-4", "1e-4", "3e-5"], "Peak learning rates.")
_WARMUPS = flags.DEFINE_list("warmups", ["0", "20"], "Linear warm-up steps.")
_EVAL_AT = flags.DEFINE_list("eval_at", ["1", "2", "4", "8", "16", "32"],
                             "Drafter steps after which the candidate is scored.")
_PROMPTS = flags.DEFINE_integer("prompts", 48, "Sampled responses.", lower_bound=8)
_TASKS = flags.DEFINE_list("tasks", questions.MAIN_TASKS, "reasoning-gym tasks of the prompts "
                           "(ones the drafter never saw: a policy that moved to a new domain).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Response cap.", lower_bound=8)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per packed row (the ablation's).")
_BATCH_ROWS = flags.DEFINE_integer("batch_rows", 2, "Packed rows per step (the ablation's).")
_HELDOUT = flags.DEFINE_float("heldout_fraction", 0.25, "Responses held out for scoring.")
_UNROLL = flags.DEFINE_integer("unroll", 2, "Loss passes and the scored chain depth.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON here.")
_SEED = flags.DEFINE_integer("seed", 12345, "Prompt seed (held out from drafter training).")


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def sampled_responses(model, params):
  """(prompt, response, hidden) triples of the target's T=1 rollout, hidden states captured."""
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.sampling import SamplingParams

  asked = questions.load({"main": (_TASKS.value, _PROMPTS.value, _SEED.value)})
  prompts = [model.tokenizer.chat_prompt(q) for q in asked["main"]]
  result = generate(params, model.config, prompts, seed=_SEED.value, capture_hidden=True,
                    max_new_tokens=_NEW_TOKENS.value, sampling=SamplingParams(temperature=1.0),
                    eos_ids=tuple(model.tokenizer.eos_token_ids))
  return [(p, o.token_ids, o.hidden_states) for p, o in zip(prompts, result.outputs)]


def finetune(drafter, target, batches, heldout, vocab_ids, lr: float, warmup: int, config):
  """The candidate's held-out score and train loss after each of --eval_at steps."""
  import jax
  import jax.numpy as jnp

  from tlt_jax import optim
  from tlt_jax.drafter import gate, trainer
  from tlt_jax.drafter.losses import CE_WEIGHT

  optimizer = optim.make_optimizer(lr, 100_000, warmup)
  state = trainer.init_train_state(jax.tree.map(jnp.copy, drafter), optimizer)
  eval_at, points = {int(s) for s in _EVAL_AT.value}, []
  for step, batch in enumerate(batches, 1):
    state, metrics = trainer.train_step(state, target, batch.rows, vocab_ids, batch.hidden,
                                        config=config, optimizer=optimizer,
                                        ce_weight=CE_WEIGHT, unroll=_UNROLL.value)
    if step in eval_at:
      totals, slots = gate.heldout_levels(state.params, target, heldout, vocab_ids,
                                          config=config, greedy=False, depth=_UNROLL.value)
      points.append({"step": step, "heldout_accept": gate.accept_from_levels(totals, slots),
                     "train_loss": float(metrics["loss"])})
      log(f"lr {lr:g} warm-up {warmup}: step {step} held-out accept "
          f"{points[-1]['heldout_accept']:.3f}")
  return points


def main(argv):
  del argv
  if _OUTPUT.value:
    cli.check_output_file(_OUTPUT.value, "--output")
  import jax.numpy as jnp

  from tlt_jax.drafter import gate
  from tlt_jax.drafter.buffer import BufferConfig, OnlineBuffer
  from tlt_jax.drafter.trainer import load_drafter
  from tlt_jax.models.loading import load_model
  from tlt_jax.rollout.weights import rollout_layout

  model = load_model(_MODEL.value, dtype=jnp.float32)
  drafter, vocab_ids = load_drafter(_DRAFTER.value, model.config)
  vocab_ids = None if vocab_ids is None else jnp.asarray(vocab_ids)
  began = time.perf_counter()
  samples = sampled_responses(model, rollout_layout(model.params))
  log(f"{len(samples)} responses sampled in {time.perf_counter() - began:.0f} s")
  buffer = OnlineBuffer(BufferConfig(seq_len=_SEQ_LEN.value, batch_rows=_BATCH_ROWS.value,
                                     heldout_fraction=_HELDOUT.value))
  for prompt, response, hidden in samples:
    buffer.add(1, prompt, response, hidden)
  heldout = [(b.rows, b.hidden) for b in buffer.heldout(1)]
  steps = max(int(s) for s in _EVAL_AT.value)
  batches = [buffer.batch(1) for _ in range(steps)]
  totals, slots = gate.heldout_levels(drafter, model.params, heldout, vocab_ids,
                                      config=model.config, greedy=False, depth=_UNROLL.value)
  runs = [{"lr": float(lr), "warmup": int(w),
           "points": finetune(drafter, model.params, batches, heldout, vocab_ids, float(lr),
                              int(w), model.config)}
          for lr in _LRS.value for w in _WARMUPS.value]
  lengths = sorted(len(r) for _, r, _ in samples)
  emit({"command": " ".join(["python benchmarks/research/online_drafter_lr.py", *sys.argv[1:]]),
        "model": _MODEL.value, "drafter": _DRAFTER.value, "responses": len(samples),
        "response_len": {"p50": lengths[len(lengths) // 2], "max": lengths[-1]},
        "heldout_slots": slots, "seq_len": _SEQ_LEN.value, "batch_rows": _BATCH_ROWS.value,
        "unroll": _UNROLL.value, "deployed_heldout_accept": gate.accept_from_levels(totals, slots),
        "runs": runs}, _OUTPUT.value)


if __name__ == "__main__":
  cli.run(main)
