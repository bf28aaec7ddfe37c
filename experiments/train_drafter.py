"""Warm up an EAGLE drafter on the target model's own responses.

  python -m experiments.train_drafter --model=smollm2 --out=runs/drafter_smollm2 \
      --num_prompts=384 --max_new_tokens=192 --temperature=0.8 --steps=300

Prompts come from reasoning-gym tasks (generated offline from --seed) plus a few chat
questions, wrapped in the model's chat template; the target samples a response to each.
The corpus is cached in OUT/corpus.json after every generation batch, so a rerun or
--resume skips generation and an interrupted generation continues where it stopped. OUT
then holds the drafter files (see tlt_jax/drafter/trainer.py) and metrics.json.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

from absl import flags

from experiments import cli
from tlt_jax.data.rl_sources import gym_prompt
from tlt_jax.data.tasks import build_questions, validate_tasks
from tlt_jax.drafter.corpus import read_corpus, read_json
from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_file

_MODEL = flags.DEFINE_string("model", "smollm2", "HF dir, converted checkpoint dir, .gguf file, "
                             "or 'smollm2'.")
_OUT = flags.DEFINE_string("out", None, "Output dir: corpus cache, drafter files, metrics.")
_TASKS = flags.DEFINE_list("tasks", ["gsm_symbolic", "basic_arithmetic", "chain_sum",
                                     "leg_counting", "chat"],
                           "reasoning-gym dataset names, and/or 'chat' for chat questions; "
                           "prompts are spread evenly over them.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 256, "Prompts to generate responses for.",
                                    lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Response tokens per prompt.",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.",
                                  lower_bound=0.0)
_EXTRA_CORPORA = flags.DEFINE_list(
    "extra_corpora", [], "corpus.json files of other train_drafter runs on the same model "
    "whose samples are added to this run's (e.g. greedy and sampled responses together).")
_GEN_BATCH = flags.DEFINE_integer("gen_batch", 64, "Prompts per generate call.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 300, "Total optimizer steps (resumed runs count the "
                              "steps already taken).", lower_bound=1)
_BATCH_ROWS = flags.DEFINE_integer("batch_rows", 8, "Packed rows per step.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "Tokens per packed row.", lower_bound=2)
_LR = flags.DEFINE_float("lr", 5e-4, "Peak learning rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "Linear warmup steps (default steps/20).",
                               lower_bound=0)
_DRAFT_VOCAB = flags.DEFINE_integer("draft_vocab_size", 16384, "Draft vocabulary: the most "
                                    "frequent response tokens; 0 keeps the full vocabulary.",
                                    lower_bound=0)
_UNROLL = flags.DEFINE_integer(
    "unroll", 2, "Loss passes: 1 trains on true features only; m > 1 also trains tree levels "
    "1..m-1 on the drafter's own predicted features, as drafting runs (cost: m x).",
    lower_bound=1)
_CE_WEIGHT = flags.DEFINE_float(
    "ce_weight", None, "Weight of the soft cross-entropy against the target's distribution "
    "beside the hidden-state regression; more favours acceptance when sampling. Default: "
    "tlt_jax.drafter.losses.CE_WEIGHT (EAGLE's).", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for prompts, sampling, init and batch order.")
_RESUME = flags.DEFINE_bool("resume", False, "Continue training from OUT's drafter checkpoint.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Start from this drafter export's weights and draft vocabulary (e.g. "
    "assets/drafter_smollm2), with a fresh optimizer and step count: how a shipped drafter, "
    "which carries no optimizer state, keeps training.")
_CORPUS_ONLY = flags.DEFINE_bool(
    "corpus_only", False, "Stop once OUT/corpus.json is complete (a corpus for "
    "--extra_corpora of another run); no hidden states, no training.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Steps per progress line.", lower_bound=1)
_SAVE_EVERY = flags.DEFINE_integer("save_every", 100, "Steps between checkpoints.",
                                   lower_bound=1)
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "Steps between held-out evaluations "
                                   "(every 20th sample is held out once there are 20).",
                                   lower_bound=1)
flags.mark_flags_as_required(["out"])
flags.register_validator("lr", lambda v: v > 0, message="--lr must be > 0")
flags.register_multi_flags_validator(
    ["warmup_steps", "steps"],
    lambda f: f["warmup_steps"] is None or f["warmup_steps"] <= f["steps"],
    message="--warmup_steps must be <= --steps")

CORPUS = "corpus.json"
HIDDEN = "hidden_states"  # .npy per split + .json naming what they were computed from
METRICS = "metrics.json"
# Precomputed target hidden states are kept on the host up to this size; beyond it each
# step runs the target forward itself.
_HIDDEN_CACHE_BYTES = 4 << 30


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def load_or_generate_corpus(model, out_dir: str) -> dict:
  """The cached corpus if it was made with these settings, completed if it is partial."""
  from tlt_jax.rollout.weights import rollout_layout
  from tlt_jax.rollout.engine import generate
  from tlt_jax.rollout.sampling import SamplingParams

  settings = {"model": _MODEL.value, "tasks": _TASKS.value, "num_prompts": _NUM_PROMPTS.value,
              "max_new_tokens": _MAX_NEW.value, "temperature": _TEMPERATURE.value,
              "seed": _SEED.value,
              "prompt": gym_prompt("{question}")}  # a corpus of other wording is stale
  path = os.path.join(out_dir, CORPUS)
  corpus = {"settings": settings, "samples": [], "skipped_prompts": 0, "generate_s": 0.0}
  if os.path.isfile(path):
    cached = read_json(path)
    if cached.get("settings") == settings and isinstance(cached.get("samples"), list):
      corpus = cached
      log(f"cached corpus {path}: {len(corpus['samples'])} samples")
    else:
      log(f"{path} was made with other settings; generating a new corpus")

  tokenizer = model.require_tokenizer()
  config = model.config
  prompts = []
  for task, question in build_questions(_TASKS.value, _NUM_PROMPTS.value, _SEED.value):
    ids = tokenizer.chat_prompt(question)
    if len(ids) + _MAX_NEW.value <= config.max_position_embeddings:
      prompts.append((task, ids))
  if not prompts:
    raise UserInputError(f"--max_new_tokens={_MAX_NEW.value}: no prompt fits the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")
  corpus["skipped_prompts"] = _NUM_PROMPTS.value - len(prompts)
  eos_ids = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
  sampling = SamplingParams(temperature=_TEMPERATURE.value)
  params = rollout_layout(model.params)   # the rollout's layout, once for every chunk
  while len(corpus["samples"]) < len(prompts):
    start = len(corpus["samples"])
    chunk = prompts[start:start + _GEN_BATCH.value]
    began = time.perf_counter()
    result = generate(params, config, [ids for _, ids in chunk],
                      max_new_tokens=_MAX_NEW.value, sampling=sampling, eos_ids=eos_ids,
                      seed=_SEED.value + start)
    corpus["generate_s"] += time.perf_counter() - began
    for (task, ids), out in zip(chunk, result.outputs):
      corpus["samples"].append({"task": task, "prompt_ids": ids, "response_ids": out.token_ids,
                                "finish_reason": out.finish_reason})
    cli.write_json_atomic(path, corpus)
    tokens = sum(len(s["response_ids"]) for s in corpus["samples"])
    log(f"generated {len(corpus['samples'])}/{len(prompts)} responses, {tokens} tokens, "
        f"{result.stats['tokens_per_s']:.0f} tokens/s in the last batch")
  return corpus


def _rows_hidden(target_params, rows, batch_rows: int, config):
  """Target hidden states for every packed row, computed once (the target is frozen)."""
  import jax
  import numpy as np

  from tlt_jax.drafter import trainer

  out = np.zeros(rows.tokens.shape + (config.hidden_size,), np.float32)
  began, reported = time.perf_counter(), 0
  for start in range(0, rows.num_rows, batch_rows):
    idx = np.arange(start, start + batch_rows) % rows.num_rows  # fixed shape: wrap around
    chunk = jax.tree.map(lambda a: a[idx], rows)
    hidden = np.asarray(trainer.target_hidden(target_params, chunk, config=config))
    n = min(batch_rows, rows.num_rows - start)
    out[start:start + n] = hidden[:n]
    done = start + n
    if done == rows.num_rows or time.perf_counter() - began >= 60 * (reported + 1):
      reported += 1
      log(f"target hidden states: {done}/{rows.num_rows} rows, "
          f"{time.perf_counter() - began:.0f}s")
  return out


def _cached_rows_hidden(out_dir: str, split: str, key: dict, compute):
  """`compute()`'s hidden states, kept in OUT so reruns over the same corpus skip them."""
  import numpy as np

  stem = os.path.join(out_dir, f"{HIDDEN}_{split}")
  if os.path.isfile(stem + ".json") and os.path.isfile(stem + ".npy"):
    if read_json(stem + ".json") == key:
      return np.load(stem + ".npy", mmap_mode="r")
  hidden = compute()
  with atomic_file(stem + ".npy", "wb") as f:
    np.save(f, hidden)
  cli.write_json_atomic(stem + ".json", key)
  return hidden


def _acceptance(metrics: dict) -> str:
  """'top1 0.664 pass2 0.623 / T=1 0.52 pass2 0.48': top-1 (what greedy decoding accepts)
  and sampled acceptance (one T=1 draft against T=1 p) of each unrolled pass (tree level)."""
  def passes(name: str) -> str:
    deeper = sorted((k for k in metrics if k.startswith(f"{name}_pass")),
                    key=lambda k: int(k.removeprefix(f"{name}_pass")))
    return "".join(f" {k.removeprefix(name + '_')} {metrics[k]:.3f}" for k in deeper)
  return (f"top1 {metrics['top1_acc']:.3f}{passes('top1_acc')} / T=1 "
          f"{metrics['sampled_accept']:.3f}{passes('sampled_accept')}")


def _batch_indices(step: int, batch_rows: int, num_rows: int, seed: int):
  """Rows of `step`: a fresh permutation per epoch, so resumed runs see the same order."""
  import numpy as np
  flat = np.arange(step * batch_rows, (step + 1) * batch_rows)
  epochs = flat // num_rows
  perms = {e: np.random.default_rng([seed, e]).permutation(num_rows) for e in set(epochs)}
  return np.array([perms[e][i % num_rows] for e, i in zip(epochs, flat)])


def _evaluate(drafter_params, target_params, rows, hidden, vocab, config, batch_rows,
              ce_weight):
  """Slot-weighted metrics over all `rows`."""
  import jax
  import numpy as np

  from tlt_jax.drafter import trainer

  totals, slots = {}, 0.0
  for start in range(0, rows.num_rows, batch_rows):
    idx = np.arange(start, start + batch_rows) % rows.num_rows  # fixed shape: wrap around
    chunk = jax.tree.map(lambda a: a[idx], rows)
    counted = (np.arange(start, start + batch_rows) < rows.num_rows).astype(np.float32)
    chunk = chunk.replace(loss_mask=chunk.loss_mask * counted[:, None])  # wrapped rows: 0
    metrics = jax.device_get(trainer.eval_step(
        drafter_params, target_params, chunk, vocab,
        None if hidden is None else hidden[idx], config=config, ce_weight=ce_weight,
        unroll=_UNROLL.value))
    n = float(metrics.pop("trained_slots"))
    slots += n
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + float(v) * n
  return {k: v / max(slots, 1.0) for k, v in totals.items()} | {"slots": int(slots)}


@dataclasses.dataclass
class _Corpus:
  """The corpus split for training: every 20th sample held out, each split packed."""
  samples: list
  train: list
  held_out: list
  train_rows: Any
  eval_rows: Any


def _split_corpus(corpus: dict, extra: list[dict]) -> _Corpus:
  from tlt_jax.data import packing

  samples = corpus["samples"] + [s for c in extra for s in c["samples"]]
  # Every 20th sample is held out to measure the drafter on responses it never saw.
  is_held_out = lambda i: len(samples) >= 20 and i % 20 == 19
  held_out = [s for i, s in enumerate(samples) if is_held_out(i)]
  train = [s for i, s in enumerate(samples) if not is_held_out(i)]
  as_pairs = lambda ss: [(s["prompt_ids"] + s["response_ids"], len(s["prompt_ids"])) for s in ss]
  return _Corpus(samples, train, held_out, packing.pack_samples(as_pairs(train), _SEQ_LEN.value),
                 packing.pack_samples(as_pairs(held_out), _SEQ_LEN.value) if held_out else None)


def _response_tokens(samples: list):
  import numpy as np
  return np.concatenate([np.zeros((0,), np.int64)]
                        + [np.asarray(s["response_ids"], np.int64) for s in samples])


def _starting_drafter(config, data: _Corpus, out_dir: str):
  """(initial drafter params or None, draft vocabulary or None): from --resume's or
  --init_from's drafter, else the vocabulary of the training responses."""
  import numpy as np

  from tlt_jax.drafter import trainer

  if _RESUME.value or _INIT_FROM.value:
    source = out_dir if _RESUME.value else _INIT_FROM.value
    initial, vocab = trainer.load_drafter(source, config)
    stored = 0 if vocab is None else len(vocab)
    if stored != _DRAFT_VOCAB.value:
      raise UserInputError(f"--draft_vocab_size={_DRAFT_VOCAB.value}: the drafter in "
                           f"{source} has {stored}")
  elif _DRAFT_VOCAB.value:
    initial = None
    vocab = trainer.select_draft_vocab([s["response_ids"] for s in data.train],
                                       _DRAFT_VOCAB.value, vocab_size=config.vocab_size)
  else:
    initial, vocab = None, None
  # Measured on held-out responses when there are any: the draft vocabulary saw the rest.
  coverage_on = _response_tokens(data.held_out if data.held_out else data.samples)
  coverage = 1.0 if vocab is None else float(np.isin(coverage_on, vocab).mean())
  log(f"corpus: {len(data.train)} train + {len(data.held_out)} held-out samples, "
      f"{_response_tokens(data.samples).size} response tokens; {data.train_rows.num_rows} rows "
      f"x {_SEQ_LEN.value}; draft vocab {'full' if vocab is None else len(vocab)} covers "
      f"{coverage:.1%} of {'held-out ' if data.held_out else ''}response tokens")
  return initial, vocab, coverage


def _precomputed_hidden(model, corpus: dict, extra: list[dict], data: _Corpus, out_dir: str):
  """(train, held-out) target hidden states for every packed row where they fit in memory
  (else None, None: each step runs the target forward)."""
  config = model.config
  row_bytes = _SEQ_LEN.value * config.hidden_size * 4
  rows = data.train_rows.num_rows + (data.eval_rows.num_rows if data.eval_rows else 0)
  if row_bytes * rows > _HIDDEN_CACHE_BYTES:
    return None, None
  began = time.perf_counter()
  key = {"corpus": corpus["settings"], "extra_corpora": [c["settings"] for c in extra],
         "samples": len(data.samples), "seq_len": _SEQ_LEN.value}
  hidden = lambda split, rows: _cached_rows_hidden(
      out_dir, split, key | {"rows": rows.num_rows},
      lambda: _rows_hidden(model.params, rows, _BATCH_ROWS.value, config))
  train_hidden = hidden("train", data.train_rows)
  eval_hidden = None if data.eval_rows is None else hidden("held_out", data.eval_rows)
  log(f"target hidden states for all rows: {time.perf_counter() - began:.0f}s")
  return train_hidden, eval_hidden


def _initial_state(config, initial, optimizer, out_dir: str, has_checkpoint: bool):
  """(train state, train history, held-out history): fresh, from --init_from, or resumed."""
  import jax

  from tlt_jax.drafter import trainer
  from tlt_jax.models import drafter

  state = trainer.init_train_state(
      drafter.init_drafter_params(config, jax.random.key(_SEED.value)) if initial is None
      else initial, optimizer)
  history, evals = [], []
  if _RESUME.value:
    state = trainer.restore_train_state(out_dir, state)
    if os.path.isfile(os.path.join(out_dir, METRICS)):
      previous = read_json(os.path.join(out_dir, METRICS))
      history, evals = previous.get("history", []), previous.get("held_out_history", [])
    log(f"resumed at step {int(state.step)}")
  elif _INIT_FROM.value:
    log(f"starting from the weights of {_INIT_FROM.value}")
  elif has_checkpoint:
    log(f"{out_dir} holds a drafter; training a new one over it (use --resume to continue)")
  return state, history, evals


def _check_flags(out_dir: str) -> tuple[bool, list[dict]]:
  """Every flag checked before the model loads: (OUT holds a checkpoint, extra corpora)."""
  from tlt_jax.drafter import trainer

  cli.check_output_dir(out_dir, "--out")
  has_checkpoint = os.path.isdir(os.path.join(out_dir, trainer.CHECKPOINT))
  if _RESUME.value and not has_checkpoint:
    raise UserInputError(f"--resume: {out_dir} has no drafter checkpoint")
  if _RESUME.value and _INIT_FROM.value:
    raise UserInputError(f"--init_from={_INIT_FROM.value}: give it or --resume, not both")
  validate_tasks(_TASKS.value)
  return has_checkpoint, [read_corpus(path, _MODEL.value, "--extra_corpora")
                          for path in _EXTRA_CORPORA.value]


class _Training:
  """The training loop's state: the train state, its histories and what each step needs."""

  def __init__(self, model, data: _Corpus, vocab, hidden, initial, out_dir: str,
               has_checkpoint: bool):
    import jax.numpy as jnp

    from tlt_jax.drafter import losses
    from tlt_jax import optim

    self.model, self.data, self.vocab, self.out_dir = model, data, vocab, out_dir
    self.vocab_device = None if vocab is None else jnp.asarray(vocab)
    self.train_hidden, self.eval_hidden = hidden
    self.ce_weight = losses.CE_WEIGHT if _CE_WEIGHT.value is None else _CE_WEIGHT.value
    warmup = _STEPS.value // 20 if _WARMUP.value is None else _WARMUP.value
    self.optimizer = optim.make_optimizer(_LR.value, _STEPS.value, warmup)
    self.state, self.history, self.evals = _initial_state(
        model.config, initial, self.optimizer, out_dir, has_checkpoint)

  def evaluate(self, step: int) -> None:
    metrics = _evaluate(self.state.params, self.model.params, self.data.eval_rows,
                        self.eval_hidden, self.vocab_device, self.model.config,
                        _BATCH_ROWS.value, self.ce_weight)
    self.evals.append(metrics | {"step": step})
    log(f"step {step} held-out: loss {metrics['loss']:.4f} {_acceptance(metrics)} "
        f"over {metrics['slots']} slots")

  def save(self) -> None:
    from tlt_jax.drafter import trainer
    trainer.save_drafter(self.out_dir, self.state, self.vocab, self.model.config,
                         target_source=_MODEL.value)

  def train_step(self, step: int) -> dict:
    import jax

    from tlt_jax.drafter import trainer

    rows = self.data.train_rows
    idx = _batch_indices(step, _BATCH_ROWS.value, rows.num_rows, _SEED.value)
    batch = jax.tree.map(lambda a: a[idx], rows)
    hidden = None if self.train_hidden is None else self.train_hidden[idx]
    self.state, metrics = trainer.train_step(
        self.state, self.model.params, batch, self.vocab_device, hidden,
        config=self.model.config, optimizer=self.optimizer, ce_weight=self.ce_weight,
        unroll=_UNROLL.value)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return metrics | {"tokens": int((batch.segment_ids > 0).sum())}

  def log_window(self, window: list[dict], done: int, elapsed: float) -> None:
    import numpy as np
    record = {k: float(np.mean([m[k] for m in window])) for k in window[0]} | {
        "step": done, "tokens_per_s": sum(m["tokens"] for m in window) / elapsed}
    self.history.append(record)
    log(f"step {done}/{_STEPS.value} loss {record['loss']:.4f} "
        f"(l1 {record['smooth_l1']:.4f} ce {record['soft_ce']:.3f}) "
        f"{_acceptance(record)} grad {record['grad_norm']:.2f} "
        f"{record['tokens_per_s']:.0f} tokens/s")

  def run(self) -> None:
    """Trains to --steps, logging, evaluating and saving on their schedules."""
    held_out = self.data.eval_rows is not None
    if _INIT_FROM.value and held_out:
      self.evaluate(0)  # the starting point a continuation is measured against
    window, began = [], time.perf_counter()
    for step in range(int(self.state.step), _STEPS.value):
      window.append(self.train_step(step))
      done = step + 1
      if done % _LOG_EVERY.value == 0 or done == _STEPS.value:
        self.log_window(window, done, time.perf_counter() - began)
        window = []
      if held_out and (done % _EVAL_EVERY.value == 0 or done == _STEPS.value):
        self.evaluate(done)
      if done % _SAVE_EVERY.value == 0 and done < _STEPS.value:
        self.save()
      if not window:
        began = time.perf_counter()  # evaluation and saving stay out of tokens/s
    self.save()
    if held_out and (not self.evals or self.evals[-1]["step"] != int(self.state.step)):
      self.evaluate(int(self.state.step))

  def write_metrics(self, corpus: dict, coverage: float) -> None:
    import numpy as np
    data, samples = self.data, self.data.samples
    lengths = [len(s["response_ids"]) for s in samples]
    cli.write_json_atomic(os.path.join(self.out_dir, METRICS), {
        "step": int(self.state.step), "model": _MODEL.value,
        "train": self.history[-1] if self.history else None,
        "held_out": self.evals[-1] if self.evals else None,
        "history": self.history, "held_out_history": self.evals,
        "corpus": {"samples": len(samples), "train_samples": len(data.train),
                   "held_out_samples": len(data.held_out),
                   "train_rows": data.train_rows.num_rows,
                   "response_tokens": int(_response_tokens(samples).size),
                   "response_len_mean": float(np.mean(lengths)),
                   "eos_frac": float(np.mean([s["finish_reason"] == "eos" for s in samples])),
                   "skipped_prompts": corpus["skipped_prompts"],
                   "generate_s": corpus["generate_s"]},
        "draft_vocab_size": None if self.vocab is None else len(self.vocab),
        "draft_vocab_coverage": coverage,
    })


def main(argv):
  del argv
  import jax.numpy as jnp

  from tlt_jax.models.loading import load_model

  out_dir = _OUT.value
  has_checkpoint, extra = _check_flags(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  log(f"loading {_MODEL.value} ...")
  model = load_model(_MODEL.value, dtype=jnp.float32)
  if _DRAFT_VOCAB.value > model.config.vocab_size:
    raise UserInputError(f"--draft_vocab_size={_DRAFT_VOCAB.value}: exceeds the model's "
                         f"vocabulary of {model.config.vocab_size}")
  corpus = load_or_generate_corpus(model, out_dir)
  if _CORPUS_ONLY.value:
    log(f"wrote {os.path.join(out_dir, CORPUS)}: {len(corpus['samples'])} samples")
    return
  data = _split_corpus(corpus, extra)
  initial, vocab, coverage = _starting_drafter(model.config, data, out_dir)
  hidden = _precomputed_hidden(model, corpus, extra, data, out_dir)
  training = _Training(model, data, vocab, hidden, initial, out_dir, has_checkpoint)
  training.run()
  training.write_metrics(corpus, coverage)
  log(f"wrote {out_dir}: drafter at step {int(training.state.step)}")


if __name__ == "__main__":
  cli.run(main)
