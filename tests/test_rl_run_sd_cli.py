"""`python -m experiments.run` with the speculative-decoding flags it shares with
experiments.generate (experiments/sd_flags.py): one RL step on the tiny model with
model-free drafts (`--drafter=ngram`), with the hybrid (`--drafter=DIR --hybrid`), and with
a bandit pool mixing drafter kinds (`learned:` and `ngram:` strategies), which reaches the
bandit the learner keeps (its checkpointed state names both strategies)."""
from __future__ import annotations

import json
import os

import jax
import pytest

from tests.test_rl_run_cli import run_cli

# SD on from the first chunk boundary for the step's 2 x 4 rows; no evaluation rollouts.
SD_FLAGS = ("--steps=1", "--eval_every=0", "--num_val=0", "--sd_threshold=8",
            "--sd_patience=0")
POOL = "learned:3_1_4,ngram:3_1_4"


@pytest.fixture(scope="module")
def drafter_dir(tiny_hf_dirs, tmp_path_factory):
  """A random drafter for the tiny Qwen2 policy (how experiments.train_drafter saves one)."""
  from tlt_jax.drafter.trainer import save_drafter
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.drafter import init_drafter_params
  config = ModelConfig.from_hf_dir(tiny_hf_dirs["qwen2"])
  out = str(tmp_path_factory.mktemp("drafter") / "drafter")
  save_drafter(out, init_drafter_params(config, jax.random.key(0)), None, config)
  return out


def _checkpoint_meta(run_dir: str, step: int) -> dict:
  """The JSON meta a run checkpoints beside the policy (tlt_jax/rl/checkpointing.py)."""
  with open(os.path.join(run_dir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)


@pytest.mark.parametrize("case", ["ngram", "hybrid", "pool"])
def test_run_speculates_with_every_drafter_kind(case, tiny_hf_dirs, drafter_dir, tmp_path):
  flags = {"ngram": ["--drafter=ngram", "--strategy=3_1_4", "--max_ngram=2"],
           "hybrid": [f"--drafter={drafter_dir}", "--hybrid", "--strategy=3_1_4"],
           "pool": [f"--drafter={drafter_dir}", f"--strategy={POOL}"]}[case]
  run_dir = str(tmp_path / "run")
  proc = run_cli(run_dir, tiny_hf_dirs["qwen2"], *SD_FLAGS, *flags)
  kinds = {"ngram": "ngram", "hybrid": "hybrid", "pool": "learned+ngram"}[case]
  assert f"SD {kinds} " in proc.stderr, proc.stderr[-3000:]     # Run.describe
  records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1]
  record = records[0]
  assert record["spec/verify_steps"] > 0 and record["spec/accept_len"] >= 1.0, record
  assert 0 < record["spec/enabled_frac"] <= 1
  assert "actor/loss" in record and "reward/mean" in record
  saved = _checkpoint_meta(run_dir, 1)["spec"]
  assert len(saved) == 1             # one replica's
  spec_memory = saved[0]
  if case == "ngram":
    assert record["spec/strategy"] == "3_1_4"
    assert spec_memory == {"bandit": None, "picks": None}
  elif case == "hybrid":
    assert record["spec/strategy"] == "3_1_4" and spec_memory["bandit"] is None
    # The hybrid's batch counts by arm, kept for the next step's pick: some steps counted.
    assert sum(spec_memory["picks"]["steps"]) > 0, spec_memory
  else:
    # Both kinds in the step's metrics and in the bandit the learner keeps across steps.
    assert record["spec/strategy"] == POOL
    assert spec_memory["bandit"]["strategies"] == POOL.split(","), spec_memory
    assert spec_memory["picks"] is not None
