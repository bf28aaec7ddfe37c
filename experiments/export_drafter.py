"""Re-exports a trained drafter's deployable files, e.g. as float16 to ship it.

  python -m experiments.export_drafter --drafter=runs/drafter --out=assets/drafter_smollm2 \
      --dtype=float16

Reads DIR's drafter.safetensors + drafter_config.json (checked against --model), writes
the same two files into --out with weights stored as --dtype (loading casts them back to
the compute dtype). No optimizer state travels: the result deploys, it does not resume.

--draft_vocab_size=N --vocab_corpora=A/corpus.json,... shrinks the draft vocabulary to the
N ids of the drafter's own that are most frequent in those corpora's responses. The
drafter's weights do not depend on it (the head is the target's), and every drafting level
pays head time for each id: the shipped SmolLM2 drafter keeps 8192 of its 16384 (which
cover 99.0% of its corpora's response tokens, as all 16384 do) and accepts as much at T=0
(benchmarks/results/rollout_cpu.json as of commit 1313427, `draft_vocab_8k`).
Exit code 2 with one `error: ...` line on stderr for any bad flag or input.
"""
from __future__ import annotations

import json
import os
import sys

from absl import flags

from experiments import cli
from tlt_jax.drafter.corpus import read_corpus
from tlt_jax.errors import UserInputError

_MODEL = flags.DEFINE_string("model", "smollm2", "Target the drafter was trained for: "
                             "`smollm2`, a .gguf file or a checkpoint dir.")
_DRAFTER = flags.DEFINE_string("drafter", None, "Drafter dir (a train_drafter --out).")
_OUT = flags.DEFINE_string("out", None, "Output dir (created; its two drafter files are "
                           "replaced, anything else in it is left alone).")
_DTYPE = flags.DEFINE_enum("dtype", "float16", ["float16", "float32"], "Stored weight dtype.")
_VOCAB_SIZE = flags.DEFINE_integer(
    "draft_vocab_size", None, "Keep only this many draft-vocabulary ids: the ones most "
    "frequent in --vocab_corpora.", lower_bound=1)
_VOCAB_CORPORA = flags.DEFINE_list(
    "vocab_corpora", [], "train_drafter corpus.json files (same --model) whose responses "
    "rank the ids for --draft_vocab_size.")
flags.mark_flags_as_required(["drafter", "out"])


def main(argv: list[str]) -> None:
  del argv
  import jax.numpy as jnp

  from tlt_jax.drafter import trainer
  from tlt_jax.models.loading import load_model

  if os.path.abspath(_OUT.value) == os.path.abspath(_DRAFTER.value):
    raise UserInputError(f"--out={_OUT.value}: is --drafter itself; export to another dir")
  cli.check_output_dir(_OUT.value, "--out")
  if (_VOCAB_SIZE.value is None) != (not _VOCAB_CORPORA.value):
    raise UserInputError("--draft_vocab_size and --vocab_corpora: give both or neither")
  corpora = [read_corpus(path, _MODEL.value, "--vocab_corpora") for path in _VOCAB_CORPORA.value]
  config = load_model(_MODEL.value, dtype=jnp.float32).config
  params, vocab_ids = trainer.load_drafter(_DRAFTER.value, config)
  if _VOCAB_SIZE.value is not None:
    has = config.vocab_size if vocab_ids is None else len(vocab_ids)
    if _VOCAB_SIZE.value > has:
      raise UserInputError(f"--draft_vocab_size={_VOCAB_SIZE.value}: the drafter in "
                           f"{_DRAFTER.value} drafts from {has} ids")
    responses = [s["response_ids"] for c in corpora for s in c["samples"]]
    vocab_ids = trainer.select_draft_vocab(responses, _VOCAB_SIZE.value,
                                           vocab_size=config.vocab_size, among=vocab_ids)
  with open(os.path.join(_DRAFTER.value, trainer.CONFIG)) as f:
    stored = json.load(f)
  trainer.export_drafter(_OUT.value, params, vocab_ids, config, step=stored.get("step"),
                         target_source=stored.get("target_source"), dtype=_DTYPE.value)
  size = os.path.getsize(os.path.join(_OUT.value, trainer.WEIGHTS))
  kept = "full vocabulary" if vocab_ids is None else f"{len(vocab_ids)} draft ids"
  print(f"exported {_DRAFTER.value} (step {stored.get('step')}) -> {_OUT.value}: "
        f"{_DTYPE.value}, {size / 2**20:.1f} MiB, {kept}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
