"""The CPU's jitted fp32 matmul rate at a model's training shapes: what a train phase's
FLOP rate is held against (benchmarks/rl_step.py, benchmarks/train_microbatch.py)."""
from __future__ import annotations

import time


def matmul_throughput(config, tokens: int, reps: int = 5) -> dict:
  """GFLOP/s of jitted fp32 matmuls at one micro-batch's shapes ([tokens, in] x [in, out]
  for qkv, o, gate+up, down; the LM head on half the tokens, as only response slots need
  it), each the median of `reps` timed calls. `gflops` weighs them as a forward does (each
  layer shape num_layers times, the head once): total FLOPs / total time."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
  hq, hk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  layers = config.num_layers
  shapes = {"qkv": ((tokens, e, hq + 2 * hk), layers), "o": ((tokens, hq, e), layers),
            "gate_up": ((tokens, e, 2 * f), layers), "down": ((tokens, f, e), layers),
            "lm_head": ((max(tokens // 2, 1), e, v), 1)}
  matmul = jax.jit(jnp.matmul)
  out, total_flops, total_s = {}, 0.0, 0.0
  for name, ((m, k, n), count) in shapes.items():
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    for _ in range(2):
      matmul(a, b).block_until_ready()
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      matmul(a, b).block_until_ready()
      times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    flops = 2.0 * m * k * n
    out[name] = {"shape": [m, k, n], "gflops": flops / seconds / 1e9}
    total_flops += count * flops
    total_s += count * seconds
  return {"gflops": total_flops / total_s / 1e9, "per_shape": out, "tokens": tokens}
