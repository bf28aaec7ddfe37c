"""The CPU's jitted fp32 matmul rate at a model's training shapes: what a train phase's
FLOP rate is held against (benchmarks/rl_step.py, benchmarks/research/train_microbatch.py),
and the time of every matmul a training micro-batch must do, forward and backward: its
floor."""
from __future__ import annotations

import time


def _median_seconds(fn, args, reps: int) -> float:
  import numpy as np
  for _ in range(2):
    fn(*args).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def layer_shapes(config, tokens: int) -> dict:
  """name -> ((m, k, n), count): the [m, k] x [k, n] weight matmuls of a forward over
  `tokens` slots, the LM head on half of them (only response slots need it)."""
  e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
  hq, hk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  layers = config.num_layers
  return {"qkv": ((tokens, e, hq + 2 * hk), layers), "o": ((tokens, hq, e), layers),
          "gate_up": ((tokens, e, 2 * f), layers), "down": ((tokens, f, e), layers),
          "lm_head": ((max(tokens // 2, 1), e, v), 1)}


def training_matmul_seconds(config, tokens: int, head_tokens: int, reps: int = 5) -> dict:
  """Seconds of the weight matmuls one training micro-batch does (the layers over `tokens`
  slots, the LM head over `head_tokens`), each as a lone jitted call: forward x @ w, and
  backward dx = g @ w.T (w.T materialized, as models/dense.py's backward does) and
  dw = x.T @ g. Attention and everything elementwise left out: a floor no program meets."""
  import jax
  import jax.numpy as jnp
  shapes = layer_shapes(config, tokens)
  shapes["lm_head"] = ((head_tokens, shapes["lm_head"][0][1], shapes["lm_head"][0][2]), 1)
  forward = jax.jit(jnp.matmul)
  weight_grad = jax.jit(lambda x, g: jax.lax.dot_general(x, g, (((0,), (0,)), ((), ()))))
  out, total = {}, {"forward": 0.0, "backward": 0.0}
  for name, ((m, k, n), count) in shapes.items():
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (m, k), jnp.float32)
    w = jax.random.normal(key[1], (k, n), jnp.float32)
    g = jax.random.normal(key[2], (m, n), jnp.float32)
    seconds = {"forward": _median_seconds(forward, (x, w), reps),
               "dx": _median_seconds(forward, (g, w.T), reps),
               "dw": _median_seconds(weight_grad, (x, g), reps)}
    out[name] = {"shape": [m, k, n], "count": count,
                 **{part: 2.0 * m * k * n / s / 1e9 for part, s in seconds.items()}}
    total["forward"] += count * seconds["forward"]
    total["backward"] += count * (seconds["dx"] + seconds["dw"])
  return {"seconds": total["forward"] + total["backward"], "forward_s": total["forward"],
          "backward_s": total["backward"], "gflops_per_shape": out}


def matmul_throughput(config, tokens: int, reps: int = 5) -> dict:
  """GFLOP/s of jitted fp32 matmuls at one micro-batch's shapes ([tokens, in] x [in, out]
  for qkv, o, gate+up, down; the LM head on half the tokens, as only response slots need
  it), each the median of `reps` timed calls. `gflops` weighs them as a forward does (each
  layer shape num_layers times, the head once): total FLOPs / total time."""
  import jax
  import jax.numpy as jnp
  matmul = jax.jit(jnp.matmul)
  out, total_flops, total_s = {}, 0.0, 0.0
  for name, ((m, k, n), count) in layer_shapes(config, tokens).items():
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    seconds = _median_seconds(matmul, (a, b), reps)
    flops = 2.0 * m * k * n
    out[name] = {"shape": [m, k, n], "gflops": flops / seconds / 1e9}
    total_flops += count * flops
    total_s += count * seconds
  return {"gflops": total_flops / total_s / 1e9, "per_shape": out, "tokens": tokens}
