"""The loop learns: a tiny random model on a synthetic verifiable task raises its mean
reward by a stated margin in a fixed number of steps (fixed seed)."""
from __future__ import annotations

import json

from tests.test_rl_run_cli import run_cli

STEPS = 12
MARGIN = 0.15   # mean reward of the last 3 steps minus that of the first 3


def test_reward_rises_on_a_synthetic_task(tiny_hf_dirs, tmp_path):
  # One letter for every prompt: a random model starts near 1/vocab of it.
  rows = [{"prompt": [{"role": "user", "content": f"Write the letter a {k} times, {c}."}],
           "reward_model": {"ground_truth": "a"}, "data_source": "letters"}
          for k in range(2, 6) for c in "bcdefghi"]
  data = tmp_path / "letters.jsonl"
  data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  run_dir = tmp_path / "run"
  run_cli(str(run_dir), tiny_hf_dirs["llama"], f"--steps={STEPS}", f"--train_file={data}",
          "--num_val=0", "--reward=tests.rl_task_helpers:letter_share_reward",
          "--prompts_per_step=4", "--group_size=8", "--max_new_tokens=16", "--lr=1e-2",
          "--kl_coef=0", "--eval_every=0", "--checkpoint_every=100", "--seed=3",
          tasks=None)
  rewards = [json.loads(line)["reward/mean"] for line in open(run_dir / "metrics.jsonl")]
  assert len(rewards) == STEPS
  first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
  assert last - first >= MARGIN, rewards
