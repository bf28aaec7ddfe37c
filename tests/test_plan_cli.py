"""`python -m experiments.plan`: every shipped flagfile fits the hardware written in it, a
run that cannot fit is refused in one line naming the flag, before any weights load (by
experiments.run too), and the plan's sizes agree with the arrays the run would hold."""
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from tlt_jax.models import transformer
from tlt_jax.models.known_configs import config_without_weights
from tlt_jax.rl.memory_plan import RunShape, plan_memory
from tlt_jax.rollout.budget import kv_bytes_per_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "experiments", "configs")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _cli(module, *flags, cwd=REPO):
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=cwd, env=ENV,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".flags")))
def test_every_flagfile_fits_its_hardware(name):
  proc = _cli("experiments.plan", f"--flagfile={os.path.join(CONFIGS, name)}")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.rstrip().endswith("fits"), proc.stdout
  for part in ("params", "optimizer state", "reference model", "drafter", "KV cache",
               "activations", "admission waves"):
    assert part in proc.stdout


def test_a_run_that_cannot_fit_is_refused_before_loading(tmp_path):
  """Every row of the 7B flagfile at once (no budget): refused by the plan and by
  experiments.run, whose --model does not exist here (the plan reads the known config; a
  run that loaded weights would fail on the path instead)."""
  flagfile = f"--flagfile={os.path.join(CONFIGS, 'qwen2_5_7b_gpu.flags')}"
  for module, extra in (("experiments.plan", []),
                        ("experiments.run", [f"--run_dir={tmp_path / 'run'}"])):
    start = time.perf_counter()
    proc = _cli(module, flagfile, "--rollout_max_rows=0", *extra)
    seconds = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rollout_max_rows"), lines
    assert "at most 1096 rows fit" in lines[0]
    assert seconds < 10, seconds
  # The refusals name the flag that fixes each part.
  proc = _cli("experiments.plan", flagfile, "--micro_batch_rows=64")
  assert proc.returncode == 2 and "error: --micro_batch_rows=64" in proc.stderr
  proc = _cli("experiments.plan", flagfile, "--device_memory_gib=4")
  assert proc.returncode == 2 and "error: --fsdp=8" in proc.stderr
  # With replicas the update is data parallel over all 8 devices: a micro-batch's rows
  # split evenly over them.
  proc = _cli("experiments.plan", flagfile, "--replicas=2", "--micro_batch_rows=4")
  assert proc.returncode == 2, proc.stderr
  assert "error: --micro_batch_rows=4: must be a multiple of the trainer's 8" in proc.stderr


def _shape(config, **overrides):
  fields = dict(config=config, dtype="bfloat16", fsdp=1, tp=1, rollout_rows=64,
                max_prompt_len=100, max_new_tokens=400, micro_batch_rows=4,
                train_seq_len=512, remat=True, reference=False, spec=None, drafter=False,
                max_rows=0, kv_fraction=0.0, device_bytes=80 * 2**30)
  return RunShape(**{**fields, **overrides})


def test_plan_sizes_match_the_arrays():
  config, source = config_without_weights("checkpoints/Qwen2.5-1.5B-Instruct")
  assert "known architecture" in source
  plan = plan_memory(_shape(config))
  params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
  # bfloat16 compute over float32 master weights (`rl.precision`): the policy state is
  # float32, the rollout's and the update's copies bfloat16.
  assert plan.params == sum(x.size * 4 for x in jax.tree.leaves(params))
  assert plan.optimizer == plan.grads == 2 * plan.params
  assert plan.rollout_weights == plan.update_weights == plan.params // 2
  # ModelConfig.num_params counts all but the q/k/v biases.
  assert 0 < plan.params - 4 * config.num_params < 1e-4 * plan.params
  # float32: no copy for the update; the rollout copies the layers into its layout.
  fp32 = plan_memory(_shape(config, dtype="float32"))
  assert fp32.params == plan.params and fp32.update_weights == 0
  assert fp32.rollout_weights == sum(x.size * 4 for x in jax.tree.leaves(params["layers"]))
  # A cache of 512 slots (100 + 400 tokens, one page up); every row at once.
  assert plan.per_row == kv_bytes_per_row(config, 512, jnp.bfloat16) + 8 * 400
  assert plan.max_rows == 64 and plan.kv_cache == 64 * plan.per_row
  # 8-way FSDP splits params (norms aside) and the rollout's rows; tp=2 the KV heads.
  sharded = plan_memory(_shape(config, fsdp=8))
  assert plan.params / 8 <= sharded.params < plan.params / 8 * 1.01
  assert sharded.kv_cache == plan.kv_cache // 8
  assert plan_memory(_shape(config, tp=2)).per_row < plan.per_row
  # A share of the memory the rollout leaves: that many rows, a multiple of the devices.
  budget = plan_memory(_shape(config, fsdp=8, rollout_rows=10**6, kv_fraction=0.5))
  free = budget.shape.device_bytes - (budget.rollout_peak - budget.kv_cache)
  assert budget.max_rows % 8 == 0
  assert budget.kv_cache <= 0.5 * free < budget.kv_cache + budget.per_row
