"""Tunix GRPO learner side of benchmarks/rl_step.py (runs in its own venv with google-tunix).

  python benchmarks/peers/tunix_grpo.py --model_dir=DIR --prompts=FILE --steps=N ...

One GRPO step = one optimizer step (mini-batch = all prompts of the step), gradients
accumulated over train micro-batches of --micro_batch_responses; the rollout generates all
responses in one call (vanilla rollout: Tunix's own sampler on the actor's weights) and the
reference forward runs in micro-batches of the same size. Fixes needed to run it as the
other sides do (DESIGN 6): the llama3 model ignores ModelConfig.rope_theta (apply_rope is
patched to SmolLM2's), the mesh takes explicit AxisType.Auto, prompts are left-padded to
--prompt_pad, and each generate call gets its own seed (Tunix otherwise reuses one key).

Phase times come from wrapping RLCluster.generate (rollout), RLCluster.
get_ref_per_token_logps (reference, blocked on its result), the learner's _compute_rewards
(reward) and _generate_and_compute_advantage (all of those plus advantages); a step is one
RLLearner._run_global_step (plus a weight sync, if any), ended by blocking on the actor's
params, and train = step - generate_and_compute_advantage. One JSON line per step,
prefixed `BENCH_STEP `, on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
  p.add_argument("--prompt_pad", type=int, default=64, help="Tunix max_prompt_length.")
  p.add_argument("--kl_coef", type=float, default=0.04)
  p.add_argument("--lr", type=float, default=1e-6)
  p.add_argument("--seed", type=int, default=42)
  p.add_argument("--work_dir", required=True)
  return p.parse_args()


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def llama_models(model_dir: str, count: int):
  """`count` fp32 copies of the HF checkpoint as Tunix llama3 models on a one-device mesh,
  their Tunix config, and the EOS ids. Tunix's Attention calls apply_rope without rope_theta (default 1e6), so
  apply_rope is patched to the checkpoint's."""
  import jax
  import jax.numpy as jnp
  from tunix.models.llama3 import model as llama_model
  from tunix.models.llama3 import params as llama_params
  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
  config = llama_model.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=theta, norm_eps=hf["rms_norm_eps"],
      weight_tying=hf.get("tie_word_embeddings", False))
  llama_model.apply_rope = functools.partial(llama_model.apply_rope, rope_theta=float(theta))
  auto = jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto),
                       devices=jax.devices()[:1])
  models = [llama_params.create_model_from_safe_tensors(model_dir, config, mesh,
                                                        dtype=jnp.float32)
            for _ in range(count)]
  eos = hf["eos_token_id"]
  return models, config, eos if isinstance(eos, list) else [eos]


def main():
  args = parse_args()
  import jax
  import numpy as np
  import optax
  import transformers
  from flax import nnx
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  from tlt_jax.rl.rewards import reasoning_gym_reward

  total = args.steps * args.prompts_per_step
  with open(args.prompts) as f:
    records = [json.loads(line) for line in f][:total]
  if len(records) < total:
    sys.exit(f"{args.prompts}: {len(records)} prompts, need {total}")
  # Batches of prompt text (the chat template already applied) plus the task fields, one
  # JSON string per prompt; Tunix repeats every column group times.
  batches = [{"prompts": np.array([r["text"] for r in chunk]),
              "task": np.array([json.dumps({k: r[k] for k in
                                            ("ground_truth", "data_source", "extra_info")})
                                for r in chunk])}
             for chunk in (records[i:i + args.prompts_per_step]
                           for i in range(0, total, args.prompts_per_step))]

  def gym_reward(prompts, completions, task, **kwargs):
    """The project's reasoning-gym reward on the completion text."""
    out = []
    for text, fields in zip(completions, task):
      fields = json.loads(str(fields))
      out.append(reasoning_gym_reward(text, fields["ground_truth"], fields["data_source"],
                                      fields["extra_info"]))
    return out

  (actor, reference), _, eos_ids = llama_models(args.model_dir, 2)
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)

  micro_prompts = args.micro_batch_responses // args.group
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(args.lr, b1=0.9, b2=0.999, weight_decay=0.01))
  training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer, eval_every_n_steps=10 ** 9, max_steps=args.steps,
      mini_batch_size=args.prompts_per_step, train_micro_batch_size=micro_prompts,
      rollout_micro_batch_size=args.prompts_per_step,
      compute_logps_micro_batch_size=micro_prompts, pbar_description=None)
  rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=args.max_new_tokens, max_prompt_length=args.prompt_pad,
      kv_cache_size=args.prompt_pad + args.max_new_tokens + 256, temperature=1.0, top_p=1.0,
      top_k=None, eos_tokens=eos_ids)
  roles = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=tokenizer,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
          rollout_config=rollout))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[gym_reward],
      algo_config=grpo_learner.GRPOConfig(num_generations=args.group, num_iterations=1,
                                          beta=args.kl_coef, epsilon=0.2))

  seconds = {"rollout": 0.0, "reward": 0.0, "reference": 0.0, "gen_adv": 0.0, "sync": 0.0}
  tokens = {"train": 0, "padded_train": 0, "response": 0}
  rewards: list[float] = []

  def timed(phase, fn, block=False):
    def wrapper(*a, **kw):
      start = time.perf_counter()
      out = fn(*a, **kw)
      if block:
        jax.block_until_ready(out)
      seconds[phase] += time.perf_counter() - start
      return out
    return wrapper

  engine = cluster.rollout
  engine_generate = engine.generate
  calls = [0]

  def seeded_generate(prompts, rollout_config, **kw):
    """A fresh seed per generate call (Tunix's default reuses PRNGKey(0) every call)."""
    calls[0] += 1
    return engine_generate(prompts, dataclasses.replace(
        rollout_config, seed=args.seed * 100003 + calls[0]), **kw)

  engine.generate = seeded_generate
  cluster.generate = timed("rollout", cluster.generate)
  cluster.get_ref_per_token_logps = timed("reference", cluster.get_ref_per_token_logps,
                                          block=True)
  compute_rewards = learner._compute_rewards

  def rewards_timed(*a, **kw):
    start = time.perf_counter()
    out = compute_rewards(*a, **kw)
    seconds["reward"] += time.perf_counter() - start
    rewards.append(float(np.mean(out)))
    return out

  learner._compute_rewards = rewards_timed
  gen_adv = learner._generate_and_compute_advantage

  def gen_adv_counted(*a, **kw):
    """Times it and counts the batch's tokens: real (masks) and as padded into training."""
    start = time.perf_counter()
    example = jax.block_until_ready(gen_adv(*a, **kw))
    seconds["gen_adv"] += time.perf_counter() - start
    prompt_mask, completion_mask = np.asarray(example.prompt_mask), np.asarray(
        example.completion_mask)
    tokens["train"] += int(prompt_mask.sum() + completion_mask.sum())
    tokens["padded_train"] += prompt_mask.size + completion_mask.size
    tokens["response"] += int(completion_mask.sum())
    return example

  learner._generate_and_compute_advantage = gen_adv_counted
  cluster.sync_weights = timed("sync", cluster.sync_weights, block=False)
  pending: list[dict] = []

  def flush():
    """Emits the finished step (its weight sync, which runs after it, included)."""
    if pending:
      record = pending.pop()
      record["step_s"] += seconds["sync"]
      record["sync_s"] = seconds["sync"]
      print(STEP_PREFIX + json.dumps(record), flush=True)

  global_step = learner._run_global_step

  def global_step_timed(*a, **kw):
    flush()
    for key in seconds:
      seconds[key] = 0.0
    for key in tokens:
      tokens[key] = 0
    rewards.clear()
    start = time.perf_counter()
    out = global_step(*a, **kw)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    step_s = time.perf_counter() - start
    pending.append({
        "step": cluster.actor_trainer.train_steps,
        "rollout_s": seconds["rollout"], "reference_s": seconds["reference"],
        "reward_s": seconds["reward"], "train_s": step_s - seconds["gen_adv"],
        "step_s": step_s,
        "other_s": seconds["gen_adv"] - seconds["rollout"] - seconds["reference"]
                   - seconds["reward"],
        "peak_rss_gib": peak_rss_gib(), "train_tokens": tokens["train"],
        "padded_train_tokens": tokens["padded_train"], "response_tokens": tokens["response"],
        "reward_mean": float(np.mean(rewards)) if rewards else None})
    seconds["sync"] = 0.0
    return out

  learner._run_global_step = global_step_timed
  learner.train(batches)
  flush()


if __name__ == "__main__":
  main()
