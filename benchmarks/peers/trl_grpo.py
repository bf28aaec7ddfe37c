"""TRL GRPOTrainer side of benchmarks/rl_step.py (runs in its own venv with trl + torch).

  python benchmarks/peers/trl_grpo.py --model_dir=DIR --prompts=FILE --steps=N ...

One GRPO step = one optimizer step over prompts_per_step x group completions, generated
in one `generate` call and trained in micro-batches of --micro_batch_responses (gradient
accumulation), KL to a frozen reference copy. TRL reports no phase times of its own, so the
trainer's methods are wrapped (names from trl 1.16's grpo_trainer.py): `_generate_single_turn`
(rollout), `_calculate_rewards` (reward), `_get_per_token_logps_and_entropies` called on the
reference model (reference), `_generate_and_score_completions` (all of the above plus
tokenizing and advantages); a step runs from the trainer's on_step_begin to on_step_end
and train = step - generate_and_score (forward, backward and the optimizer step). One JSON
line per step, prefixed `BENCH_STEP `, on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)   # for the project's reward (numpy + reasoning-gym only)

STEP_PREFIX = "BENCH_STEP "


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model_dir", required=True)
  p.add_argument("--prompts", required=True, help="JSONL written by rl_step.py, in step order.")
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--prompts_per_step", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--max_new_tokens", type=int, default=128)
  p.add_argument("--micro_batch_responses", type=int, default=8)
  p.add_argument("--kl_coef", type=float, default=0.04)
  p.add_argument("--lr", type=float, default=1e-6)
  p.add_argument("--seed", type=int, default=42)
  p.add_argument("--gradient_checkpointing", action="store_true",
                 help="TRL's default; off here, as the project's --remat is.")
  p.add_argument("--work_dir", required=True)
  return p.parse_args()


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class Phases:
  """Seconds per phase and token counts within the current step."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.seconds = {"rollout": 0.0, "reward": 0.0, "reference": 0.0, "gen_and_score": 0.0}
    self.tokens = {"train": 0, "padded_train": 0, "response": 0}

  def timed(self, phase, fn):
    def wrapper(*args, **kwargs):
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[phase] += time.perf_counter() - start
    return wrapper


def main():
  args = parse_args()
  import datasets
  import torch
  import transformers
  import trl

  from tlt_jax.rl.rewards import reasoning_gym_reward

  torch.manual_seed(args.seed)
  with open(args.prompts) as f:
    records = [json.loads(line) for line in f][:args.steps * args.prompts_per_step]
  if len(records) < args.steps * args.prompts_per_step:
    sys.exit(f"{args.prompts}: {len(records)} prompts, need {args.steps * args.prompts_per_step}")
  # Task fields ride as one JSON string column: their nested schema varies per row.
  dataset = datasets.Dataset.from_list([
      {"prompt": r["messages"],
       "task": json.dumps({k: r[k] for k in ("ground_truth", "data_source", "extra_info")})}
      for r in records])

  def gym_reward(completions, task, **kwargs):
    """The project's reasoning-gym reward on the completion text."""
    out = []
    for completion, fields in zip(completions, task):
      text = completion[0]["content"] if isinstance(completion, list) else completion
      fields = json.loads(fields)
      out.append(reasoning_gym_reward(text, fields["ground_truth"], fields["data_source"],
                                      fields["extra_info"]))
    return out

  responses = args.prompts_per_step * args.group
  config = trl.GRPOConfig(
      output_dir=args.work_dir, use_cpu=True, bf16=False, fp16=False,
      model_init_kwargs={"dtype": torch.float32},
      per_device_train_batch_size=args.micro_batch_responses,
      gradient_accumulation_steps=responses // args.micro_batch_responses,
      num_generations=args.group, max_completion_length=args.max_new_tokens,
      temperature=1.0, top_p=1.0, top_k=0, beta=args.kl_coef, epsilon=0.2, num_iterations=1,
      loss_type="dapo",   # token mean over the whole batch: the project's token_mean
      learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
      adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, max_steps=args.steps,
      shuffle_dataset=False,   # the file is already in the project's stream order
      seed=args.seed, logging_steps=1, save_strategy="no", report_to="none",
      gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
      log_completions=False, dataloader_num_workers=0)
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  trainer = trl.GRPOTrainer(model=args.model_dir, reward_funcs=gym_reward, args=config,
                            train_dataset=dataset, processing_class=tokenizer)
  if trainer.ref_model is None:
    sys.exit("trl: no reference model was built (beta == 0?)")

  phases = Phases()
  trainer._generate_single_turn = phases.timed("rollout", trainer._generate_single_turn)
  trainer._calculate_rewards = phases.timed("reward", trainer._calculate_rewards)
  trainer._generate_and_score_completions = phases.timed(
      "gen_and_score", trainer._generate_and_score_completions)
  logps = trainer._get_per_token_logps_and_entropies

  def logps_timed(model, *a, **kw):
    if model is trainer.ref_model:
      return phases.timed("reference", logps)(model, *a, **kw)
    return logps(model, *a, **kw)

  trainer._get_per_token_logps_and_entropies = logps_timed
  compute_loss = trainer.compute_loss

  def compute_loss_counted(model, inputs, *a, **kw):
    """Counts the micro-batch's tokens: real (masks) and as padded into the forward."""
    phases.tokens["train"] += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    phases.tokens["padded_train"] += int(inputs["prompt_ids"].numel()
                                         + inputs["completion_ids"].numel())
    phases.tokens["response"] += int(inputs["completion_mask"].sum())
    return compute_loss(model, inputs, *a, **kw)

  trainer.compute_loss = compute_loss_counted

  class StepTimer(transformers.TrainerCallback):
    def on_step_begin(self, *a, **kw):
      phases.reset()
      self.start = time.perf_counter()

    def on_step_end(self, args_, state, control, **kw):
      step_s = time.perf_counter() - self.start
      s = phases.seconds
      rewards = trainer._metrics["train"].get("reward") or [None]
      record = {"step": state.global_step, "rollout_s": s["rollout"],
                "reference_s": s["reference"], "reward_s": s["reward"],
                "train_s": step_s - s["gen_and_score"], "step_s": step_s,
                "other_s": s["gen_and_score"] - s["rollout"] - s["reference"] - s["reward"],
                "peak_rss_gib": peak_rss_gib(), "train_tokens": phases.tokens["train"],
                "padded_train_tokens": phases.tokens["padded_train"],
                "response_tokens": phases.tokens["response"], "reward_mean": rewards[-1]}
      print(STEP_PREFIX + json.dumps(record), flush=True)

  trainer.add_callback(StepTimer())
  trainer.train()


if __name__ == "__main__":
  main()
