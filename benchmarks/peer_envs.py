"""The peers' environments for side-by-side benchmarks: one venv per peer framework (never a
project dependency), installed on first use, and SmolLM2 as an HF directory they all load."""
from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import subprocess
import sys

from tlt_jax.errors import UserInputError

# What each peer venv gets. trl is pinned because its driver wraps trainer methods by name;
# torch 2.13.0 is this machine's local CPU wheel; reasoning-gym is pinned to the project's
# version (ensure_venv adds it), so every side scores with the same code.
PEER_PACKAGES = {"trl": ["trl==1.16.0", "torch==2.13.0"], "tunix": ["google-tunix==0.1.7"]}


def log(message: str) -> None:
  print(f"[peer_envs] {message}", file=sys.stderr, flush=True)


def ensure_venv(bench_dir: str, peer: str) -> str:
  """The peer's venv under bench_dir (made and installed on first use, or when its package
  list changes); returns its python."""
  venv = os.path.join(bench_dir, peer)
  python = os.path.join(venv, "bin", "python")
  packages = PEER_PACKAGES[peer] + [f"reasoning-gym=={importlib.metadata.version('reasoning_gym')}"]
  marker = os.path.join(venv, ".bench_packages.json")
  if os.path.isfile(python) and os.path.isfile(marker):
    with open(marker) as f:
      if json.load(f) == packages:
        return python
  log(f"installing {peer} venv in {venv}: pip install {' '.join(packages)} (minutes)")
  if not os.path.isfile(python):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  result = subprocess.run([python, "-m", "pip", "install", "-q", *packages],
                          capture_output=True, text=True)
  if result.returncode != 0:
    raise UserInputError(f"{peer}: pip install failed:\n{result.stderr[-3000:]}")
  with open(marker, "w") as f:
    json.dump(packages, f)
  return python


def ensure_hf_model(bench_dir: str) -> str:
  """SmolLM2 as an HF dir (config.json + safetensors + tokenizer) for the peers, written once
  from the project's fp32 load of the bundled GGUF, so every side starts from the same
  weights."""
  out = os.path.join(bench_dir, "smollm2_hf")
  if os.path.isfile(os.path.join(out, "model.safetensors")):
    return out
  import jax.numpy as jnp
  from tlt_jax.models.hf import save_hf_dir
  from tlt_jax.models.loading import load_model
  log(f"writing {out} from the bundled GGUF")
  model = load_model("smollm2", dtype=jnp.float32)
  save_hf_dir(model.params, model.config, out, tokenizer=model.tokenizer)
  del model
  gc.collect()
  return out
