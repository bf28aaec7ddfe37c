"""Decoder-only transformer (Llama, Qwen2/2.5, Qwen3) as pure functions over a param pytree.

One `forward` serves prefill, single-token decode and multi-token tree verification: new
tokens carry explicit positions and an explicit mask among themselves, are written into
the cache after each row's committed prefix, and attend to that prefix plus the new
tokens the mask allows.

Two layouts of the layers, one set of functions: stacked (every weight [L, ...]), run under
`lax.scan` so compile time does not grow with depth (training, checkpoints, import), and
per layer (a tuple of layers, each weight [1, ...]), run as an unrolled loop. Rollout uses
the second: under a scan, XLA's CPU backend copies each layer's weights and cache out of
the stacked arrays at every decode step (about as much memory traffic again as the step's
own reads), while a layer's own buffers are read in place. The rollout's layout, with the
matrices and the LM head (`ROLLOUT_HEAD`) packed where the kernel seam packs weights, is
derived from the stacked params in one place, `tlt_jax.rollout.weights.rollout_layout`.
Every matmul and the attention go through the seam (`tlt_jax.ops`), which takes either
form: no code here asks which backend it runs on.

Param layout (matrices are [in, out]):
  embed [V, E]; final_norm [E]; lm_head [E, V] (untied only); in the rollout's layout
  only, ROLLOUT_HEAD (the head in the seam's packed form);
  layers: attn_norm [L, E], wq [L, E, H*D], wk/wv [L, E, K*D], wo [L, H*D, E],
          bq/bk/bv (qkv_bias), q_norm/k_norm [L, D] (qk_norm),
          mlp_norm [L, E], w_gate/w_up [L, E, F], w_down [L, F, E].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax import ops
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, init_cache, layer_buffer
from tlt_jax.models.rope import apply_rope, inverse_frequencies, rope_tables
from tlt_jax.reference_ops import block_causal_mask
from tlt_jax.sharding.rules import MeshRules, constrain, spans_devices

Params = dict
ROLLOUT_HEAD = "packed_lm_head"   # the LM head as the rollout's layout prepared it


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


def lm_head(params: Params, config: ModelConfig) -> ops.Weight:
  """The LM head [E, V]: the one the rollout's layout prepared (ROLLOUT_HEAD) where it has
  one, else lm_head, or the embedding's transpose where they are tied."""
  if ROLLOUT_HEAD in params:
    return params[ROLLOUT_HEAD]
  return params["embed"].T if config.tie_word_embeddings else params["lm_head"]


def lm_logits(params: Params, config: ModelConfig, hidden: jax.Array,
              rules: MeshRules | None = None) -> jax.Array:
  """Float32 logits from final (post-norm) hidden states [..., E]."""
  logits = ops.logits(hidden, lm_head(params, config))
  return constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + ("act_vocab",), rules)


def prefix_mask(cache_lengths: jax.Array, num_new: int, max_len: int) -> jax.Array:
  """[B, T, S]: every new token sees its row's committed prefix of the cache."""
  visible = jnp.arange(max_len)[None, :] < cache_lengths[:, None]
  return jnp.broadcast_to(visible[:, None, :], (cache_lengths.shape[0], num_new, max_len))


def _layer(config: ModelConfig, rules: MeshRules | None, attention_impl: str, x, layer,
           layer_keys, layer_values, rope, cache_mask, new_mask):
  """One decoder layer. layer_keys/values [B, K, S, D] are this layer's cache, read-only:
  the new K/V are returned and written into the cache once, after all layers."""
  b, t, _ = x.shape
  kh, d = config.num_kv_heads, config.head_dim
  # The EAGLE drafter's layer has no input norm: its input is already a projection.
  h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps) if "attn_norm" in layer else x
  q, k, v = ops.dense_shared_input(h, (layer["wq"], layer["wk"], layer["wv"]))
  if config.qkv_bias:
    q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
  q = constrain(q.reshape(b, t, config.num_heads, d), ("batch", None, "act_heads", None), rules)
  k = constrain(k.reshape(b, t, kh, d), ("batch", None, "act_kv_heads", None), rules)
  v = constrain(v.reshape(b, t, kh, d), ("batch", None, "act_kv_heads", None), rules)
  if config.qk_norm:
    q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
  q, k = apply_rope(q, rope), apply_rope(k, rope)

  k, v = k.astype(layer_keys.dtype), v.astype(layer_values.dtype)
  attn = ops.attention(q, layer_keys, layer_values, cache_mask, k, v, new_mask,
                       impl=attention_impl, sharded=spans_devices(rules))
  x = x + ops.dense(attn.reshape(b, t, config.num_heads * d), layer["wo"])

  h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
  gate, up = (constrain(y, ("batch", None, "act_mlp"), rules)
              for y in ops.dense_shared_input(h, (layer["w_gate"], layer["w_up"])))
  x = x + ops.dense(jax.nn.silu(gate) * up, layer["w_down"])
  return constrain(x, ("batch", None, "act_embed"), rules), k, v


def run_layers_new_kv(layers: Params, config: ModelConfig, x: jax.Array, positions: jax.Array,
                      cache: KVCache, new_mask: jax.Array | None = None,
                      rules: MeshRules | None = None, cache_mask: jax.Array | None = None,
                      attention_impl: str = "auto", remat: bool = False
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Runs the decoder layers (stacked, or per layer: module doc) on embeddings x [B, T, E]
  against a read-only cache with one entry per layer; returns (x, new_k, new_v), the new
  K/V as [L, B, T, K, D]. Shared by the target model and the one-layer drafter.

  Visibility: new_mask [B, T, T] among the new tokens (default causal) and cache_mask
  [B, T, max_len] over the cache (default: the committed prefix). A drafter growing a
  tree over several calls passes a cache_mask that also shows uncommitted ancestors
  written by earlier calls, but not their siblings.
  attention_impl picks the attention kernel (`ops.attention`).
  remat recomputes each layer's activations in the backward pass instead of keeping them
  (training memory: one layer's activations instead of every layer's matmul outputs).
  """
  b, t, _ = x.shape
  new_mask = causal_mask(b, t) if new_mask is None else new_mask
  if cache_mask is None:
    cache_mask = prefix_mask(cache.lengths, t, cache.max_len)
  rope = rope_tables(positions, inverse_frequencies(config.rope, config.head_dim))

  def body(x, scanned):
    layer, layer_keys, layer_values = scanned
    x, k, v = _layer(config, rules, attention_impl, x, layer, layer_keys, layer_values, rope,
                     cache_mask, new_mask)
    return x, (k, v)

  if not isinstance(layers, tuple):
    if cache.per_layer:
      raise ValueError("stacked layers need a stacked cache (init_cache(per_layer=False))")
    # Under differentiation (training runs stacked), keep only the weight matmuls' outputs
    # for the backward pass and recompute the rest (norms, RoPE, attention, SiLU) from them:
    # a training micro-batch's attention scores are large to write, zero and read back, and
    # keeping them too took more memory and more time on a SmolLM2 micro-batch (paired A/B
    # when this was chosen). remat keeps nothing. The kernels' own residuals
    # (`ops.SAVED_RESIDUALS`, small) are kept too: their backward passes read them, and
    # rerunning their forward cost more.
    policies = jax.checkpoint_policies
    policy = None if remat else policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable,
        policies.save_only_these_names(ops.SAVED_RESIDUALS))
    x, (new_k, new_v) = jax.lax.scan(jax.checkpoint(body, policy=policy), x,
                                     (layers, cache.k, cache.v))
    return x, new_k, new_v
  new = []
  for i, layer in enumerate(layers):
    x, kv = body(x, (jax.tree.map(lambda w: w[0], layer), layer_buffer(cache.k, i),
                     layer_buffer(cache.v, i)))
    new.append(kv)
  return x, jnp.stack([k for k, _ in new]), jnp.stack([v for _, v in new])


def forward_new_kv(params: Params, config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, cache: KVCache, new_mask: jax.Array | None = None,
                   rules: MeshRules | None = None, attention_impl: str = "auto"
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Like `forward`, but the cache is only read: returns (hidden, new_k, new_v) with the
  new K/V as [L, B, T, K, D], for a caller that writes back only some of them (a
  speculative step keeps just the accepted path)."""
  x = constrain(embed_tokens(params, tokens), ("batch", None, "act_embed"), rules)
  x, new_k, new_v = run_layers_new_kv(params["layers"], config, x, positions, cache, new_mask,
                                      rules, attention_impl=attention_impl)
  return rms_norm(x, params["final_norm"], config.rms_norm_eps), new_k, new_v


def forward_packed(params: Params, config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, segment_ids: jax.Array, rules: MeshRules | None = None,
                   remat: bool = False) -> jax.Array:
  """Post-norm hidden states [R, T, E] of packed training rows: each sample (segment id)
  sees only its own earlier tokens, positions restart per sample.

  The rows attend among themselves alone: an empty cache has no slots to score or write;
  the seam picks their attention (`ops.TRAINING_AUTO`)."""
  empty = init_cache(config, tokens.shape[0], 0, params["embed"].dtype)
  x = constrain(embed_tokens(params, tokens), ("batch", None, "act_embed"), rules)
  x, _, _ = run_layers_new_kv(params["layers"], config, x, positions, empty,
                              block_causal_mask(segment_ids), rules,
                              attention_impl=ops.TRAINING_AUTO, remat=remat)
  return rms_norm(x, params["final_norm"], config.rms_norm_eps)


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, new_mask: jax.Array | None = None,
            rules: MeshRules | None = None,
            attention_impl: str = "auto") -> tuple[jax.Array, KVCache]:
  """Runs `tokens` [B, T] at `positions` [B, T] against `cache`.

  new_mask [B, T, T] (default causal) says which new tokens each new token sees. Returns
  the final post-norm hidden states [B, T, E] and the cache with the new K/V written at
  `cache.lengths + arange(T)`; lengths are NOT advanced (see `KVCache.advance`).
  """
  hidden, new_k, new_v = forward_new_kv(params, config, tokens, positions, cache, new_mask,
                                        rules, attention_impl)
  return hidden, cache.write_after_committed(new_k, new_v, after=hidden)
