"""EAGLE-style drafter: fc(concat(embed(x_{t+1}), h_t)) -> one decoder layer -> target head.

The embedding and LM head are the target's, frozen and passed in at call time (never
copied into drafter params), so a policy update reaches the drafter for free. The layer
has no input norm (its input is already a learned projection) and there is no final norm:
the drafter predicts the target's post-norm hidden state h_{t+1} directly.

Slot convention: drafter slot j consumes (h_j, x_{j+1}) at rope position j and predicts
h_{j+1}, whose logits propose x_{j+2}. A drafter cache of length n holds slots 0..n-1.

An optional reduced draft vocabulary (the target's most frequent tokens) cuts the cost of
the head on small targets; tokens outside it are never drafted, and verification against
the full target distribution keeps decoding exact.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax import ops
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.sharding.rules import MeshRules, param_logical_axes

# {"fc": [2E, E], "fc_bias": [E], "layers": one stacked layer, no attn_norm}; in the rollout's
# packed layout (`tlt_jax.rollout.weights.drafter_layout`), fc packed and the layer a tuple
# of one, packed.
DrafterParams = dict


def init_drafter_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> DrafterParams:
  fc_key, layer_key = jax.random.split(key)
  e = config.hidden_size
  layers = transformer.init_params(drafter_layer_config(config), layer_key, dtype)["layers"]
  del layers["attn_norm"]
  fc = (jax.random.normal(fc_key, (2 * e, e)) * (2 * e) ** -0.5).astype(dtype)
  return {"fc": fc, "fc_bias": jnp.zeros((e,), dtype), "layers": layers}


def drafter_layer_config(config: ModelConfig) -> ModelConfig:
  """The target config seen by the drafter's single layer (no q/k norm, no qkv bias)."""
  return dataclasses.replace(config, num_layers=1, qkv_bias=False, qk_norm=False)


def drafter_logical_axes(config: ModelConfig) -> dict:
  """Logical axes of the drafter params: its layer is sharded as a target layer is."""
  layers = dict(param_logical_axes(drafter_layer_config(config))["layers"])
  del layers["attn_norm"]
  return {"fc": (None, "embed"), "fc_bias": (None,), "layers": layers}


def init_drafter_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32,
                       rules: MeshRules | None = None, per_layer: bool = False) -> KVCache:
  """per_layer: for a drafter in the rollout's packed layout (its layer split out)."""
  return init_cache(drafter_layer_config(config), batch_size, max_len, dtype, rules,
                    per_layer=per_layer)


def drafter_forward(drafter: DrafterParams, target: transformer.Params, config: ModelConfig,
                    tokens: jax.Array, hidden: jax.Array, positions: jax.Array, cache: KVCache,
                    new_mask: jax.Array | None = None, cache_mask: jax.Array | None = None,
                    attention_impl: str = "auto", rules: MeshRules | None = None
                    ) -> tuple[jax.Array, KVCache]:
  """tokens [B, T] (x_{j+1}) and hidden [B, T, E] (h_j) -> predicted h_{j+1} [B, T, E], and
  the cache with the new K/V written at `cache.lengths + arange(T)`."""
  x, new_k, new_v = drafter_forward_new_kv(drafter, target, config, tokens, hidden, positions,
                                           cache, new_mask, cache_mask, attention_impl, rules)
  return x, cache.write_after_committed(new_k, new_v)


def drafter_forward_new_kv(drafter: DrafterParams, target: transformer.Params,
                           config: ModelConfig, tokens: jax.Array, hidden: jax.Array,
                           positions: jax.Array, cache: KVCache,
                           new_mask: jax.Array | None = None,
                           cache_mask: jax.Array | None = None, attention_impl: str = "auto",
                           rules: MeshRules | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Like `drafter_forward`, but the cache is only read: returns the new K/V as
  [1, B, T, K, D] (a prefill writes them into a cache it did not attend over)."""
  embedded = transformer.embed_tokens(target, tokens).astype(drafter["fc_bias"].dtype)
  x = ops.dense(jnp.concatenate([embedded, hidden.astype(embedded.dtype)], axis=-1),
                drafter["fc"])
  x = x + drafter["fc_bias"]
  return transformer.run_layers_new_kv(drafter["layers"], drafter_layer_config(config), x,
                                       positions, cache, new_mask, rules, cache_mask,
                                       attention_impl)


def draft_head(target: transformer.Params, config: ModelConfig,
               vocab_ids: jax.Array | None) -> jax.Array:
  """[E, Vd] LM head restricted to the draft vocabulary (the full head when None)."""
  if config.tie_word_embeddings:
    return _tied_head(target["embed"], vocab_ids)
  head = target["lm_head"]
  return head if vocab_ids is None else jnp.take(head, vocab_ids, axis=1)


@jax.jit
def _tied_head(embed: jax.Array, vocab_ids: jax.Array | None) -> jax.Array:
  # The draft vocabulary's rows first, then the transpose of those alone: an eager
  # transpose of the whole [V, E] embedding took 0.2-2 s per rollout on a 2-core CPU.
  return (embed if vocab_ids is None else jnp.take(embed, vocab_ids, axis=0)).T


def draft_logits(head: ops.Weight, hidden: jax.Array) -> jax.Array:
  """Float32 logits over the draft vocabulary from hidden states [..., E]."""
  return ops.logits(hidden, head)
