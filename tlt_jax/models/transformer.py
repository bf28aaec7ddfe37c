"""Decoder-only transformer (Llama, Qwen2/2.5, Qwen3) as pure functions over a param pytree.

One `forward` serves prefill, single-token decode and multi-token tree verification: new
tokens carry explicit positions and an explicit mask among themselves, are written into
the cache after each row's committed prefix, and attend to that prefix plus the new
tokens the mask allows. Layers are stacked and run under `lax.scan` so compile time does
not grow with depth.

Param layout (matrices are [in, out]):
  embed [V, E]; final_norm [E]; lm_head [E, V] (untied only);
  layers: attn_norm [L, E], wq [L, E, H*D], wk/wv [L, E, K*D], wo [L, H*D, E],
          bq/bk/bv (qkv_bias), q_norm/k_norm [L, D] (qk_norm),
          mlp_norm [L, E], w_gate/w_up [L, E, F], w_down [L, F, E].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.rope import apply_rope, inverse_frequencies
from tlt_jax.pallas.tree_attention import tree_attention
from tlt_jax.sharding.rules import MeshRules, constrain

Params = dict


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
  """Random params (for tests and drafter-free experiments); norms start near 1."""
  e, f, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
  hq, hk, n = config.num_heads * d, config.num_kv_heads * d, config.num_layers
  shapes = {"wq": (n, e, hq), "wk": (n, e, hk), "wv": (n, e, hk), "wo": (n, hq, e),
            "w_gate": (n, e, f), "w_up": (n, e, f), "w_down": (n, f, e)}
  if config.qkv_bias:
    shapes.update(bq=(n, hq), bk=(n, hk), bv=(n, hk))
  keys = iter(jax.random.split(key, len(shapes) + 8))
  normal = lambda shape, scale: (scale * jax.random.normal(next(keys), shape)).astype(dtype)
  layers = {name: normal(shape, shape[-2] ** -0.5 if len(shape) == 3 else 0.02)
            for name, shape in shapes.items()}
  norm = lambda shape: (1.0 + 0.1 * jax.random.normal(next(keys), shape)).astype(dtype)
  layers.update(attn_norm=norm((n, e)), mlp_norm=norm((n, e)))
  if config.qk_norm:
    layers.update(q_norm=norm((n, d)), k_norm=norm((n, d)))
  params = {"embed": normal((v, e), 1.0), "layers": layers, "final_norm": norm((e,))}
  if not config.tie_word_embeddings:
    params["lm_head"] = normal((e, v), e ** -0.5)
  return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * normed.astype(x.dtype)


def causal_mask(batch: int, length: int) -> jax.Array:
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def embed_tokens(params: Params, tokens: jax.Array) -> jax.Array:
  return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params: Params, config: ModelConfig, hidden: jax.Array,
              rules: MeshRules | None = None) -> jax.Array:
  """Float32 logits from final (post-norm) hidden states [..., E]."""
  head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
  logits = jnp.einsum("...e,ev->...v", hidden, head, preferred_element_type=jnp.float32)
  return constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + ("act_vocab",), rules)


def _attention_mask(cache_lengths: jax.Array, new_mask: jax.Array, max_len: int) -> jax.Array:
  """[B, T, S] visibility: the committed prefix, plus new tokens as `new_mask` allows."""
  num_new = new_mask.shape[-1]
  rel = jnp.arange(max_len)[None, :] - cache_lengths[:, None]           # [B, S]
  in_prefix = rel < 0
  in_new = (rel >= 0) & (rel < num_new)
  from_new = jnp.take_along_axis(new_mask, jnp.clip(rel, 0, num_new - 1)[:, None, :], axis=-1)
  return in_prefix[:, None, :] | (in_new[:, None, :] & from_new)


def _layer(config: ModelConfig, inv_freq: np.ndarray, rules: MeshRules | None,
           attention_impl: str, x, layer, k_cache, v_cache, layer_idx, positions, write_idx,
           mask):
  b, t, _ = x.shape
  kh, d = config.num_kv_heads, config.head_dim
  # The EAGLE drafter's layer has no input norm: its input is already a projection.
  h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps) if "attn_norm" in layer else x
  q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
  if config.qkv_bias:
    q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
  q = constrain(q.reshape(b, t, config.num_heads, d), ("batch", None, "act_heads", None), rules)
  k = constrain(k.reshape(b, t, kh, d), ("batch", None, "act_kv_heads", None), rules)
  v = constrain(v.reshape(b, t, kh, d), ("batch", None, "act_kv_heads", None), rules)
  if config.qk_norm:
    q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

  # Write new K/V after each row's prefix; positions past the cache end are dropped.
  rows = jnp.arange(b)[:, None]
  k_cache = k_cache.at[layer_idx, rows, write_idx].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[layer_idx, rows, write_idx].set(v.astype(v_cache.dtype), mode="drop")
  keys, values = k_cache[layer_idx], v_cache[layer_idx]                 # [B, S, K, D]

  attn = tree_attention(q, keys, values, mask, impl=attention_impl)
  x = x + attn.reshape(b, t, config.num_heads * d) @ layer["wo"]

  h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
  gate = constrain(h @ layer["w_gate"], ("batch", None, "act_mlp"), rules)
  up = constrain(h @ layer["w_up"], ("batch", None, "act_mlp"), rules)
  x = x + (jax.nn.silu(gate) * up) @ layer["w_down"]
  return constrain(x, ("batch", None, "act_embed"), rules), k_cache, v_cache


def run_layers(layers: Params, config: ModelConfig, x: jax.Array, positions: jax.Array,
               cache: KVCache, new_mask: jax.Array | None = None,
               rules: MeshRules | None = None, cache_mask: jax.Array | None = None,
               attention_impl: str = "auto") -> tuple[jax.Array, KVCache]:
  """Runs a stack of decoder layers on embeddings x [B, T, E]; the cache has one entry per
  layer. Shared by the target model and the one-layer drafter.

  cache_mask [B, T, max_len], when given, replaces the prefix + new_mask visibility: a
  drafter growing a tree over several calls must see uncommitted ancestors from earlier
  calls but not their siblings. attention_impl picks the attention kernel
  (see `tlt_jax.pallas.tree_attention`; "auto" is Pallas on GPU, jnp elsewhere).
  """
  b, t, _ = x.shape
  if cache_mask is not None:
    mask = cache_mask
  else:
    new_mask = causal_mask(b, t) if new_mask is None else new_mask
    mask = _attention_mask(cache.lengths, new_mask, cache.max_len)
  inv_freq = inverse_frequencies(config.rope, config.head_dim)
  write_idx = cache.lengths[:, None] + jnp.arange(t)[None, :]
  num_layers = jax.tree.leaves(layers)[0].shape[0]

  def body(carry, scanned):
    x, k_cache, v_cache = carry
    layer, layer_idx = scanned
    x, k_cache, v_cache = _layer(config, inv_freq, rules, attention_impl, x, layer, k_cache,
                                 v_cache, layer_idx, positions, write_idx, mask)
    return (x, k_cache, v_cache), None

  (x, k_cache, v_cache), _ = jax.lax.scan(
      body, (x, cache.k, cache.v), (layers, jnp.arange(num_layers)))
  return x, cache.replace(k=k_cache, v=v_cache)


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, new_mask: jax.Array | None = None,
            rules: MeshRules | None = None,
            attention_impl: str = "auto") -> tuple[jax.Array, KVCache]:
  """Runs `tokens` [B, T] at `positions` [B, T] against `cache`.

  new_mask [B, T, T] (default causal) says which new tokens each new token sees. Returns
  the final post-norm hidden states [B, T, E] and the cache with the new K/V written at
  `cache.lengths + arange(T)`; lengths are NOT advanced (see `KVCache.advance`).
  """
  x = constrain(embed_tokens(params, tokens), ("batch", None, "act_embed"), rules)
  x, cache = run_layers(params["layers"], config, x, positions, cache, new_mask, rules,
                        attention_impl=attention_impl)
  return rms_norm(x, params["final_norm"], config.rms_norm_eps), cache
