"""A rollout row's device memory, and how many rows a budget of bytes holds.

The engine holds at most `max_rows` rows at once (`generate(max_rows=...)`); these are the
bytes each of them pins for the whole rollout, so a budget in bytes (a share of a device's
memory) becomes a row count, and a run can be planned before anything is loaded
(`experiments.plan`).
"""
from __future__ import annotations

import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig


def kv_bytes_per_row(config: ModelConfig, cache_len: int, dtype) -> int:
  """The target's KV cache for one row of `cache_len` slots: K and V of every layer."""
  return (2 * config.num_layers * config.num_kv_heads * config.head_dim * cache_len
          * jnp.dtype(dtype).itemsize)


def row_bytes(config: ModelConfig, cache_len: int, max_new_tokens: int, dtype,
              keep_hidden: bool) -> int:
  """Everything one row holds on the device: its KV cache, its outputs (token ids and
  float32 log-probs) and, when the rollout keeps them (the learned drafter's prefill at the
  SD switch), its committed tokens and hidden states."""
  record = cache_len * (4 + config.hidden_size * jnp.dtype(dtype).itemsize)
  return (kv_bytes_per_row(config, cache_len, dtype) + 8 * max_new_tokens
          + (record if keep_hidden else 0))


def rows_within(budget_bytes: float, per_row: int, devices: int = 1) -> int:
  """The most rows whose bytes fit in a device's budget_bytes when a batch is split over
  `devices` devices (each holds its share of the rows): a multiple of `devices`."""
  return int(budget_bytes // per_row) * devices
