"""The flags of `experiments.run` and what they build: model, data, rewards, rollout, loss,
optimizer and the learner. Every value is checked, one clear line each, before the model
loads or any long work starts."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

from absl import flags

from experiments import budget_flags, drafter_flags, sd_flags
from tlt_jax.errors import UserInputError
from tlt_jax.runtime import host

# ---- model and data
_MODEL = flags.DEFINE_string("model", "smollm2", "Policy: HF dir, converted checkpoint dir, "
                             ".gguf file, or 'smollm2' (bundled SmolLM2-135M-Instruct).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype of "
                           "the rollout and the update (bfloat16 on GPU/TPU: over float32 "
                           "master weights and AdamW state, tlt_jax/rl/precision.py; CPU: keep "
                           "float32, bfloat16 is slower there).")
_TASKS = flags.DEFINE_string("tasks", None, "reasoning-gym tasks, mixed: "
                             "'task[:key=value,...][;task...]'.")
_TRAIN_FILE = flags.DEFINE_string("train_file", None, "JSONL or parquet prompts in the RL "
                                  "schema (prompt, reward_model.ground_truth, data_source).")
_VAL_FILE = flags.DEFINE_string("val_file", None, "Held-out prompts (same schema).")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 2048, "Training prompts generated (--tasks).")
_NUM_VAL = flags.DEFINE_integer("num_val", 64, "Held-out prompts (generated, or held out of "
                                "--train_file) when there is no --val_file.")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 128, "Longer prompts are dropped "
                                       "(counted).")
_ON_BAD_ROW = flags.DEFINE_enum("on_bad_row", "fail", ["fail", "skip"], "A data file row with a "
                                "missing or malformed field: stop, or skip and count it.")
# ---- rewards
_REWARD = flags.DEFINE_string("reward", "reasoning_gym", "Registered reward name "
                              "(math_verify, reasoning_gym, ...) or module.path:function, "
                              "called as fn(response, ground_truth, data_source, extra_info) "
                              "-> float.")
_FORMAT_WEIGHT = flags.DEFINE_float("format_weight", 0.0, "Weight of the format reward.")
_REWARD_WORKERS = flags.DEFINE_integer("reward_workers", 2, "Reward processes.", lower_bound=1)
_REWARD_TIMEOUT = flags.DEFINE_float("reward_timeout_s", 10.0, "Per-item scoring limit; a "
                                     "timeout scores 0 (counted in reward/timeouts).")
# ---- rollout
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 8, "Prompts per RL step.", lower_bound=1)
_GROUP = flags.DEFINE_integer("group_size", 4, "Samples per prompt (the GRPO group).",
                              lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Response length cap.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Rollout temperature.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Rollout nucleus mass.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Rollout top-k; 0 disables.")
_PRECOMPILE = flags.DEFINE_bool("precompile", False, "Compile every program a step's rollout "
                                "and update can dispatch before step 1 (minutes on CPU), so "
                                "no step waits on the compiler.")
_ATTENTION = flags.DEFINE_enum("attention_impl", "auto",
                               ["auto", "reference", "pallas", "triton", "cpu"], "Rollout attention kernel (experiments/generate.py's flag).")
# ---- algorithm
_ADVANTAGE = flags.DEFINE_string("advantage", "grpo", "grpo | dr_grpo (no std division).")
_ADV_EPS = flags.DEFINE_float("adv_eps", 1e-6, "Added to the group std.")
_CLIP_LOW = flags.DEFINE_float("clip_ratio_low", 0.2, "PPO clip below 1.")
_CLIP_HIGH = flags.DEFINE_float("clip_ratio_high", 0.2, "PPO clip above 1 (DAPO: 0.28).")
_CLIP_C = flags.DEFINE_float("clip_ratio_c", None, "Dual-clip constant (> 1); unset: off.")
_KL_COEF = flags.DEFINE_float("kl_coef", 0.0, "KL-to-reference loss weight; 0 keeps no "
                              "reference model.")
_KL_ESTIMATOR = flags.DEFINE_string("kl_estimator", "k3", "k1 | k2 | k3.")
_ENTROPY_COEF = flags.DEFINE_float("entropy_coef", 0.0, "Entropy bonus weight.")
_LOSS_AGG = flags.DEFINE_string("loss_agg_mode", "token_mean", "token_mean | "
                                "seq_mean_token_mean | seq_mean_token_sum | "
                                "seq_mean_token_sum_norm.")
_TIS_CAP = flags.DEFINE_float("tis_cap", None, "Truncated importance sampling cap on "
                              "exp(old - rollout log-prob); unset: off.")
_OVERLONG = flags.DEFINE_string("overlong", "none", "none | soft_penalty | mask (truncated "
                                "responses out of the loss).")
_OVERLONG_BUFFER = flags.DEFINE_integer("overlong_buffer_len", 32, "Soft penalty ramp length.")
_OVERLONG_FACTOR = flags.DEFINE_float("overlong_penalty_factor", 1.0, "Soft penalty at the cap.")
_DYNAMIC = flags.DEFINE_bool("dynamic_sampling", False, "DAPO: drop groups with equal rewards "
                             "and draw more prompts to refill the batch.")
_MAX_BATCHES = flags.DEFINE_integer("max_rollout_batches", 4, "Dynamic sampling: prompt "
                                    "batches drawn per step at most.", lower_bound=1)
# ---- update
_PPO_EPOCHS = flags.DEFINE_integer("ppo_epochs", 1, "Passes over a step's responses.")
_MINI_BATCHES = flags.DEFINE_integer("num_mini_batches", 1, "Optimizer steps per pass.")
_MICRO_ROWS = flags.DEFINE_integer("micro_batch_rows", 8, "Packed rows per micro-batch "
                                   "(gradients accumulate over micro-batches); split over "
                                   "the data-parallel shards, a multiple of them.")
_TRAIN_SEQ_LEN = flags.DEFINE_integer("train_seq_len", 0, "Packed row length; 0: "
                                      "max_prompt_len + max_new_tokens rounded up to 64.")
_REMAT = flags.DEFINE_bool("remat", False, "Recompute layer activations in the backward pass.")
_SKIP_ZERO_ADV = flags.DEFINE_bool("skip_zero_advantage", True, "Leave out of the update the "
                                   "sequences whose gradient is exactly zero (zero "
                                   "advantage, no KL or entropy term): the same step, less "
                                   "compute; per-token metrics (entropy, clip fractions) then "
                                   "cover the tokens trained.")
_LR = flags.DEFINE_float("lr", 1e-6, "Peak learning rate (AdamW).")
_LR_SCHEDULE = flags.DEFINE_string("lr_schedule", "constant", "constant | cosine (after "
                                   "warm-up).")
_WARMUP = flags.DEFINE_integer("warmup_steps", 0, "Linear warm-up, in optimizer steps.")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
_GRAD_CLIP = flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clipping.")
_ADAM_B2 = flags.DEFINE_float("adam_b2", 0.999, "AdamW beta2.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of data order, rollouts and updates.")
# ---- devices
_FSDP = flags.DEFINE_integer("fsdp", 0, "Trainer mesh: devices params, optimizer state and "
                             "batch rows are sharded over (FSDP); 0: all devices / --tp.")
_TP = flags.DEFINE_integer("tp", 1, "Trainer mesh: tensor-parallel ways (heads, mlp, vocab).",
                           lower_bound=1)

# Flags that may change when a run resumes; every other must match the checkpoint's.
RESUMABLE_CHANGES = ("steps", "run_dir", "resume", "checkpoint_every", "keep_checkpoints",
                     "eval_every", "export_hf", "reward_workers", "reward_timeout_s", "flagfile",
                     "precompile", "rollout_max_rows", "kv_cache_memory_fraction",
                     "device_memory_gib")


def check_run_dir(run_dir: str) -> None:
  """The run dir exists (made if missing) and takes files, before anything long starts."""
  try:
    os.makedirs(run_dir, exist_ok=True)
    probe = os.path.join(run_dir, f".write_probe.{os.getpid()}")   # one per process
    with open(probe, "w") as f:
      f.write("ok")
    os.unlink(probe)
  except OSError as e:
    raise UserInputError(f"--run_dir={run_dir}: not writable ({e.strerror or e})") from None


def run_flags() -> dict[str, Any]:
  """Every flag of a run (this module's and the SD flags), by name: what a checkpoint
  records."""
  return {f.name: f.value for module in (__name__, sd_flags.__name__, budget_flags.__name__)
          for f in flags.FLAGS.get_flags_for_module(module)}


@dataclasses.dataclass
class Run:
  learner: Any
  val_items: list
  model: Any
  spec: Any
  data_counts: dict

  def describe(self) -> str:
    sd = (f", SD {self.spec.kinds} {sd_flags.STRATEGY.value} below "
          f"{self.spec.threshold} rows" if self.spec else "")
    return (f"{_MODEL.value} on {self.data_counts['num_train']} prompts "
            f"({_PROMPTS.value} x {_GROUP.value} per step, <= {_MAX_NEW.value} tokens{sd})")

  def precompile(self) -> None:
    """`--precompile`: every program a step can dispatch, compiled now."""
    if not _PRECOMPILE.value:
      return
    from tlt_jax.rl.rollout import precompile_rollouts
    from tlt_jax.rl.update import precompile_training
    print("precompiling the rollout's and the update's programs ...", file=sys.stderr)
    start = time.perf_counter()
    learner = self.learner
    count = precompile_rollouts(learner.rollout_params, learner.config,
                                learner.replicas.max_block(_PROMPTS.value),
                                _MAX_PROMPT_LEN.value, learner.rollout, learner.drafter)
    count += precompile_training(learner.state, learner.update)
    host.return_free_heap()
    print(f"precompiled {count} programs in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)

  def checkpoint_meta(self, history: list) -> dict[str, Any]:
    return {**self.learner.host_state(), "history": history, "flags": run_flags()}

  def save(self, checkpoints, step: int, history: list) -> None:
    """Starts the run checkpoint of `step` (`rl.checkpointing.RunCheckpoints`); the online
    drafter's own checkpoint of `step` is on disk on every replica first, so every run
    checkpoint can resume its drafter."""
    if self.learner.idle_drafter is not None:
      self.learner.idle_drafter.save(step)
    checkpoints.save(step, self.learner.state, self.checkpoint_meta(history))

  def resume(self, checkpoints, step: int) -> list:
    """Continues from the checkpoint of `step`; returns its metrics history."""
    state, meta = checkpoints.restore(step, self.learner.state)
    self.check_resumable(meta)
    self.learner.restore(state, meta)
    if self.learner.idle_drafter is not None:
      self.learner.idle_drafter.restore(step)
    return meta["history"]

  def check_resumable(self, meta: dict[str, Any]) -> None:
    saved, now = meta.get("flags", {}), run_flags()
    # A flag newer than the checkpoint ran at its default.
    defaults = {name: flags.FLAGS[name].default for name in now}
    for name in sorted(saved.keys() | now.keys()):
      if name not in RESUMABLE_CHANGES and saved.get(name, defaults.get(name)) != now.get(name):
        raise UserInputError(f"--{name}={now.get(name)!r}: the checkpoint was trained with "
                             f"{saved.get(name)!r}; resume with the same flag")

  def export_hf(self, params, out_dir: str) -> None:
    """The policy as a HF checkpoint, in the run's --dtype (the master weights cast)."""
    from tlt_jax.models.hf import save_hf_dir
    from tlt_jax.rl.precision import compute_params
    save_hf_dir(compute_params(params, _DTYPE.value), self.model.config, out_dir,
                overwrite=True, tokenizer=self.model.tokenizer)


def trainer_rules(processes: int = 1):
  """The trainer mesh over every device of the job and its sharding rules: fsdp x tp for
  one process; with several (one rollout replica each), data parallel over all of them,
  params whole on every device, so each process holds the new policy for its rollout."""
  import jax

  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import DATA_PARALLEL_RULES, MeshRules

  devices = jax.devices()
  fsdp = _FSDP.value or len(devices) // _TP.value
  if fsdp < 1 or fsdp * _TP.value > len(devices):
    raise UserInputError(f"--fsdp={_FSDP.value} x --tp={_TP.value}: more than the "
                         f"{len(devices)} devices")
  if processes == 1:
    return MeshRules(make_mesh(fsdp, _TP.value, devices[:fsdp * _TP.value]))
  if fsdp * _TP.value != len(devices):
    raise UserInputError(f"--fsdp={_FSDP.value} x --tp={_TP.value}: with {processes} "
                         f"processes the trainer spans all {len(devices)} devices")
  return MeshRules(make_mesh(fsdp, _TP.value, devices), rules=DATA_PARALLEL_RULES)


def replica_rules(processes: int, trainer):
  """A rollout replica's mesh: the trainer's for one process, else this process's own
  devices (process-local programs: replicas decode independently)."""
  import jax

  from tlt_jax.sharding.mesh import make_mesh
  from tlt_jax.sharding.rules import MeshRules

  if processes == 1:
    return trainer
  local = jax.local_devices()
  if len(local) % _TP.value:
    raise UserInputError(f"--tp={_TP.value}: does not divide this process's "
                         f"{len(local)} devices")
  return MeshRules(make_mesh(len(local) // _TP.value, _TP.value, local))


def train_seq_len() -> int:
  """--train_seq_len, or max_prompt_len + max_new_tokens rounded up to 64."""
  from tlt_jax.rollout.buckets import round_up
  seq_len = _TRAIN_SEQ_LEN.value or round_up(_MAX_PROMPT_LEN.value + _MAX_NEW.value, 64)
  if seq_len < _MAX_PROMPT_LEN.value + _MAX_NEW.value:
    raise UserInputError(f"--train_seq_len={seq_len}: shorter than --max_prompt_len + "
                         f"--max_new_tokens ({_MAX_PROMPT_LEN.value + _MAX_NEW.value})")
  return seq_len


def memory_plan(replicas: int = 1):
  """The run's per-device memory plan (`rl.memory_plan`), from the flags and the model's
  config alone (no weights read): what experiments.plan prints and experiments.run checks
  before it loads anything. replicas: the run's rollout replicas (processes), each sampling
  its block of a step's groups and of the validation set (`rl.replicas.Replicas.block`)."""
  import jax

  from tlt_jax.models.known_configs import config_without_weights
  from tlt_jax.rl.memory_plan import RunShape, plan_memory
  from tlt_jax.rl.replicas import Replicas

  budget_flags.check_budget_flags()
  config, source = config_without_weights(_MODEL.value)
  spec = sd_flags.spec_from_flags(_SEED.value)
  device_bytes, memory_source = budget_flags.device_memory()
  fsdp = _FSDP.value or max(len(jax.devices()) // _TP.value, 1)
  block = Replicas(count=replicas).max_block
  shape = RunShape(
      config=config, dtype=_DTYPE.value, fsdp=fsdp, tp=_TP.value,
      rollout_rows=max(block(_PROMPTS.value) * _GROUP.value, block(_NUM_VAL.value)),
      max_prompt_len=_MAX_PROMPT_LEN.value, max_new_tokens=_MAX_NEW.value,
      micro_batch_rows=_MICRO_ROWS.value, train_seq_len=train_seq_len(), remat=_REMAT.value,
      reference=_KL_COEF.value > 0, spec=spec,
      drafter=spec is not None and spec.learned, max_rows=budget_flags.MAX_ROWS.value,
      kv_fraction=budget_flags.KV_FRACTION.value, device_bytes=device_bytes,
      capture_hidden=drafter_flags.TRAIN.value != "off", replicas=replicas)
  return plan_memory(shape), {"model config": source, "device memory": memory_source}


def algorithm_configs():
  """The frozen configs of the step's algorithm, from flags (cheap: checked first)."""
  from tlt_jax.rl.config import AdvantageConfig, LossConfig, OverlongConfig
  from tlt_jax.rollout.sampling import SamplingParams

  return dict(
      advantage=AdvantageConfig(mode=_ADVANTAGE.value, eps=_ADV_EPS.value),
      loss=LossConfig(clip_ratio_low=_CLIP_LOW.value, clip_ratio_high=_CLIP_HIGH.value,
                      clip_ratio_c=_CLIP_C.value, kl_coef=_KL_COEF.value,
                      kl_estimator=_KL_ESTIMATOR.value, entropy_coef=_ENTROPY_COEF.value,
                      loss_agg_mode=_LOSS_AGG.value, tis_cap=_TIS_CAP.value),
      overlong=OverlongConfig(mode=_OVERLONG.value, buffer_len=_OVERLONG_BUFFER.value,
                              penalty_factor=_OVERLONG_FACTOR.value),
      sampling=SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                              top_k=_TOP_K.value))


def check_replica_split(replicas, num_val: int) -> None:
  """Every replica gets at least one prompt group of a step and of the validation set."""
  if _PROMPTS.value < replicas.count:
    raise UserInputError(f"--prompts_per_step={_PROMPTS.value}: fewer than the "
                         f"{replicas.count} rollout replicas")
  if 0 < num_val < replicas.count:
    raise UserInputError(f"--num_val={num_val}: fewer held-out prompts than the "
                         f"{replicas.count} rollout replicas")


def spot_from_flags(spec, algo: dict, replicas):
  """The online drafter's config from its flags (`drafter_flags`), or None; it trains on the
  replicas the tail leaves idle, so it needs two or more."""
  spot = drafter_flags.spot_from_flags(learned=spec is not None and spec.learned,
                                       greedy=algo["sampling"].temperature == 0,
                                       seed=_SEED.value)
  if spot is None:
    return None
  if replicas.count < 2:
    raise UserInputError(f"--drafter_train={spot.train} needs --replicas >= 2: the drafter "
                         "trains on the replicas whose rollout is done while others decode")
  from tlt_jax.drafter.buffer import is_heldout

  # The deploy gate scores on the held-out responses of every replica's latest rollout
  # (each replica holds out its own): with none it can never deploy.
  responses = replicas.max_block(_PROMPTS.value) * _GROUP.value
  fraction = spot.buffer.heldout_fraction
  if responses < 2:
    raise UserInputError(f"--drafter_train={spot.train}: a replica rolls out {responses} "
                         "response a step, none to hold out for the deploy gate beside one to "
                         "train on; raise --prompts_per_step or --group_size")
  if not any(is_heldout(i, fraction) for i in range(responses)):
    raise UserInputError(f"--drafter_heldout_fraction={fraction}: holds out none of a "
                         f"replica's {responses} responses a step, so the deploy gate could "
                         f"never deploy a trained drafter; use >= "
                         f"{math.ceil(1000 / responses) / 1000:g}")
  return spot


def idle_drafter(spot, model_config, drafter, replicas, run_dir: str | None):
  """The learner's online drafter (`rl.idle_drafter.IdleDrafter`), or None without one;
  each replica checkpoints it under RUN_DIR/drafter/replica_R."""
  if spot is None:
    return None
  from tlt_jax.distributed.control import ReplicaControl
  from tlt_jax.distributed.kv_store import KeyValueStore
  from tlt_jax.drafter.checkpoints import DrafterCheckpoints
  from tlt_jax.rl.idle_drafter import AllProcesses, IdleDrafter
  from tlt_jax.rl.spot_trainer import SpotTrainer

  trainer = SpotTrainer(spot, model_config, drafter, AllProcesses())
  control = ReplicaControl(KeyValueStore(), replicas.count, replicas.index)
  checkpoints = None if run_dir is None else DrafterCheckpoints(
      os.path.join(run_dir, "drafter", f"replica_{replicas.index}"))
  return IdleDrafter(trainer, control, extra_tail_s=straggler_seconds(replicas.index),
                     checkpoints=checkpoints)


STRAGGLER_ENV = "TLT_JAX_STRAGGLER"   # "REPLICA:SECONDS": that replica's tail runs longer


def straggler_seconds(replica: int) -> float:
  """Seconds replica `replica` stays busy after its rollout under STRAGGLER_ENV (tests and
  demos of the spot trainer on a workload too small to have a tail of its own)."""
  value = os.environ.get(STRAGGLER_ENV, "")
  if not value:
    return 0.0
  index, _, seconds = value.partition(":")
  try:
    return float(seconds) if int(index) == replica else 0.0
  except ValueError:
    raise UserInputError(f"{STRAGGLER_ENV}={value!r}: expected REPLICA:SECONDS") from None


@dataclasses.dataclass(frozen=True)
class _Checked:
  """What the flags say, checked before anything loads."""
  algo: dict
  reward_spec: Any
  spec: Any           # the SD config, or None
  spot: Any           # the online drafter's config, or None
  update: Any         # UpdateConfig
  optimizer: Any
  schedule: Any


def build_run(total_steps: int, replicas=None, run_dir: str | None = None,
              max_rows: int | None = None) -> Run:
  """Checks every flag, then loads the model, data, drafter and reward workers; `replicas`
  (`rl.replicas.Replicas`, default one): this process's rollout replica of the job's;
  `run_dir`: where checkpoints go (None: the run is not checkpointed); `max_rows`: the
  rollout's row budget (`memory_plan`)."""
  from tlt_jax.rl.replicas import Replicas

  replicas = replicas or Replicas()
  checked = _check_flags(total_steps, replicas)
  model, data = _load_model_and_data(replicas)
  learner = _learner(checked, model, data, replicas, run_dir, max_rows)
  if learner.idle_drafter is not None:
    print("compiling the online drafter's train and gate steps ...", file=sys.stderr)
    learner.idle_drafter.spot.warm_up(learner.rollout_params)
  return Run(learner=learner, val_items=data.val, model=model, spec=checked.spec,
             data_counts=data.counts)


def _check_flags(total_steps: int, replicas) -> _Checked:
  """Every flag checked (one line naming a bad one) and turned into configs; loads nothing."""
  from tlt_jax import optim
  from tlt_jax.data.rl_data import parse_task_spec
  from tlt_jax.models.loading import BUNDLED_SMOLLM2
  from tlt_jax.rl.rewards import RewardSpec
  from tlt_jax.rl.update import UpdateConfig

  if total_steps < 1:
    raise UserInputError(f"--steps={total_steps}: must be >= 1")
  algo = algorithm_configs()
  reward_spec = RewardSpec(_REWARD.value, format_weight=_FORMAT_WEIGHT.value)
  if not _REWARD_TIMEOUT.value > 0:
    raise UserInputError(f"--reward_timeout_s={_REWARD_TIMEOUT.value}: must be > 0")
  if _TASKS.value is not None:
    parse_task_spec(_TASKS.value)
  if _MODEL.value != BUNDLED_SMOLLM2 and not os.path.exists(_MODEL.value):
    raise UserInputError(f"--model={_MODEL.value}: no such file or directory")
  for flag in (_TRAIN_FILE, _VAL_FILE):
    if flag.value is not None and not os.path.isfile(flag.value):
      raise UserInputError(f"--{flag.name}={flag.value}: no such file")
  spec = sd_flags.spec_from_flags(_SEED.value)
  spot = spot_from_flags(spec, algo, replicas)
  seq_len = train_seq_len()
  update = UpdateConfig(ppo_epochs=_PPO_EPOCHS.value, num_mini_batches=_MINI_BATCHES.value,
                        micro_batch_rows=_MICRO_ROWS.value, train_seq_len=seq_len,
                        remat=_REMAT.value, skip_zero_advantage=_SKIP_ZERO_ADV.value)
  optimizer_steps = total_steps * update.updates_per_step
  schedule = optim.learning_rate_schedule(_LR.value, optimizer_steps, _WARMUP.value,
                                          schedule=_LR_SCHEDULE.value)
  optimizer = optim.make_optimizer(_LR.value, optimizer_steps, _WARMUP.value,
                                   weight_decay=_WEIGHT_DECAY.value, clip_norm=_GRAD_CLIP.value,
                                   b2=_ADAM_B2.value, schedule=_LR_SCHEDULE.value)
  return _Checked(algo=algo, reward_spec=reward_spec, spec=spec, spot=spot, update=update,
                  optimizer=optimizer, schedule=schedule)


def _load_model_and_data(replicas):
  """(the loaded model, its tokenized prompts), with the checks that need them."""
  import jax.numpy as jnp

  from tlt_jax.data.rl_data import load_rl_records, tokenize_rl_data
  from tlt_jax.models.loading import load_model

  records = load_rl_records(seed=_SEED.value, tasks=_TASKS.value, train_file=_TRAIN_FILE.value,
                            val_file=_VAL_FILE.value, num_train=_NUM_TRAIN.value,
                            num_val=_NUM_VAL.value, on_bad_row=_ON_BAD_ROW.value)
  print(f"loading {_MODEL.value} ...", file=sys.stderr)
  model = load_model(_MODEL.value, dtype=jnp.float32)     # the master weights (rl.precision)
  data = tokenize_rl_data(records, model.require_tokenizer(), _MAX_PROMPT_LEN.value)
  counts = data.counts
  print(f"data: {counts['num_train']} train / {counts['num_val']} val prompts "
        f"({counts['train_filtered'] + counts['val_filtered']} over --max_prompt_len, "
        f"{counts['train_skipped'] + counts['val_skipped']} bad rows skipped)", file=sys.stderr)
  if _PROMPTS.value > counts["num_train"]:
    raise UserInputError(f"--prompts_per_step={_PROMPTS.value}: more than the "
                         f"{counts['num_train']} training prompts")
  check_replica_split(replicas, counts["num_val"])
  return model, data


def _learner(checked: _Checked, model, data, replicas, run_dir: str | None,
             max_rows: int | None):
  """The learner: policy state placed by the trainer's rules, reference, rollout settings,
  drafter, reward workers and (with --drafter_train) the online drafter."""
  import jax
  import jax.numpy as jnp

  from tlt_jax.data.rl_data import PromptStream
  from tlt_jax.rl.learner import Learner, StepConfig
  from tlt_jax.rl.precision import compute_params
  from tlt_jax.rl.rewards import RewardPool
  from tlt_jax.rl.rollout import RolloutSettings
  from tlt_jax.rl.update import UpdateContext, init_policy_state
  from tlt_jax.sharding.rules import param_logical_axes, tree_shardings

  tokenizer, algo = model.require_tokenizer(), checked.algo
  dtype = jnp.dtype(_DTYPE.value)
  compute_dtype = None if dtype == jnp.float32 else _DTYPE.value
  drafter = sd_flags.drafter_from_flags(checked.spec, model.config, dtype)
  eos_ids = tuple(sorted(set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids)))
  rules = trainer_rules(replicas.count)
  # One process: the rollout runs on the trainer's devices, laid out by the same rules.
  rollout = RolloutSettings(group_size=_GROUP.value, max_new_tokens=_MAX_NEW.value,
                            sampling=algo["sampling"], eos_ids=eos_ids, spec=checked.spec,
                            attention_impl=_ATTENTION.value,
                            min_row_tokens=_MAX_PROMPT_LEN.value + _MAX_NEW.value,
                            rules=replica_rules(replicas.count, rules),
                            capture_hidden=checked.spot is not None, max_rows=max_rows)
  context = UpdateContext(config=model.config, sampling=algo["sampling"], loss=algo["loss"],
                          update=checked.update, optimizer=checked.optimizer,
                          learning_rate=checked.schedule, max_response_len=_MAX_NEW.value,
                          rules=rules, compute_dtype=compute_dtype)
  params = jax.device_put(model.params, tree_shardings(param_logical_axes(model.config),
                                                       model.params, rules))
  # The reference is a copy (in the compute dtype): the policy's buffers are donated to
  # each update.
  ref_params = (jax.tree.map(jnp.copy, compute_params(params, compute_dtype))
                if algo["loss"].uses_reference else None)
  step_config = StepConfig(prompts_per_step=_PROMPTS.value, advantage=algo["advantage"],
                           overlong=algo["overlong"], dynamic_sampling=_DYNAMIC.value,
                           max_rollout_batches=_MAX_BATCHES.value, seed=_SEED.value)
  return Learner(config=model.config, tokenizer=tokenizer,
                 state=init_policy_state(params, context), ref_params=ref_params,
                 stream=PromptStream(data.train, _PROMPTS.value, _SEED.value), rollout=rollout,
                 step_config=step_config, update=context,
                 rewards=RewardPool(checked.reward_spec, num_workers=_REWARD_WORKERS.value,
                                    timeout_s=_REWARD_TIMEOUT.value),
                 drafter=drafter, between_phases=host.return_free_heap, replicas=replicas,
                 idle_drafter=idle_drafter(checked.spot, model.config, drafter, replicas,
                                           run_dir))
