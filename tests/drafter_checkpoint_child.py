"""A process that is killed while saving a drafter checkpoint (tests/test_drafter_buffer.py).

  python -m tests.drafter_checkpoint_child DIR

Saves step 1 and waits for it, then starts saving step 2 with a writer that stalls once
step 2's buffer files are written (before its meta and its commit), prints "stalled" and
sleeps: the test SIGKILLs it there, in the middle of a save.
"""
from __future__ import annotations

import sys
import time

import jax
import numpy as np

from tlt_jax import optim
from tlt_jax.drafter import buffer as buffer_lib
from tlt_jax.drafter import trainer
from tlt_jax.drafter.checkpoints import DrafterCheckpoints
from tlt_jax.models import drafter
from tlt_jax.models.config import ModelConfig

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                     max_position_embeddings=128, tie_word_embeddings=True)
BUFFER = buffer_lib.BufferConfig(seq_len=16, batch_rows=2, context=4, seed=3)
OPTIMIZER = optim.make_optimizer(1e-3, 10)


def build_state(seed: int) -> trainer.TrainState:
  """Random drafter params with a fresh optimizer, built by one small program (eager
  initialization compiles dozens, slow on a busy machine)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: drafter.init_drafter_params(CONFIG, jax.random.key(0)))
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), shapes)
  return _init(params)


@jax.jit
def _init(params):
  return trainer.init_train_state(params, OPTIMIZER)


def build_buffer(sequences: int) -> buffer_lib.OnlineBuffer:
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  rng = np.random.default_rng(sequences)
  for i in range(sequences):
    prompt, response = rng.integers(1, 64, 3), rng.integers(1, 64, 5 + i % 20)
    buffer.add(i % 2, prompt, response,
               rng.normal(size=(len(prompt) + len(response), 16)).astype(np.float32))
  return buffer


def main(directory: str) -> None:
  checkpoints = DrafterCheckpoints(directory, keep=2)
  checkpoints.save(1, build_state(1), build_buffer(12), {"step": 1})
  checkpoints.wait()
  write = buffer_lib.save_state

  def stalled(path, state):
    write(path, state)
    print("stalled", flush=True)
    time.sleep(600)

  buffer_lib.save_state = stalled
  checkpoints.save(2, build_state(2), build_buffer(30), {"step": 2})
  checkpoints.wait()


if __name__ == "__main__":
  main(sys.argv[1])
