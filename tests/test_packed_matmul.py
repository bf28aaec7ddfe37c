"""The CPU packed-matmul kernel: panels round-trip, products equal a float64 numpy matmul
for every row count it takes (and the XLA path above them), a row gets the same bits alone
or in a batch, weights sharing an input give in one call the bits they give alone, the
rollout layout packs and computes what the plain layout does, its AVX-512 path gives
the AVX2 path's bits, and the mode switch says what it does (a failed build is an error
in `kernel` mode, a warning in `auto`)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.cpu import kernels
from tlt_jax.cpu import packed_matmul as pm
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import (draft_logits, drafter_forward, init_drafter_cache,
                                   init_drafter_params)
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout.weights import rollout_draft_head, rollout_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_kernel = pytest.mark.skipif(
    kernels.build_problem() is not None, reason=f"CPU kernels unavailable: "
                                                f"{kernels.build_problem()}")


def _small_config(num_layers: int = 2, tied: bool = True) -> ModelConfig:
  return ModelConfig(model_type="llama", vocab_size=61, hidden_size=48, intermediate_size=72,
                     num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=12,
                     tie_word_embeddings=tied, max_position_embeddings=64)


@pytest.mark.parametrize("shape", [(7, 25), (2, 3, 48, 50), (5, 24)])
def test_pack_round_trips(shape):
  w = jnp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
  packed = pm.pack(w)
  assert packed.panels.shape == shape[:-1][:-1] + (-(-shape[-1] // pm.PANEL), shape[-2],
                                                   pm.PANEL)
  np.testing.assert_array_equal(pm.unpack(packed), w)


@needs_kernel
@pytest.mark.parametrize("k,n", [(576, 960), (64, 50), (7, 25), (33, 1)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, pm.MAX_KERNEL_ROWS, pm.MAX_KERNEL_ROWS + 1])
def test_products_match_numpy(k, n, rows):
  rng = np.random.default_rng(k * n + rows)
  w = rng.standard_normal((k, n), dtype=np.float32)
  x = rng.standard_normal((rows, k), dtype=np.float32)
  got = jax.jit(pm.packed_matmul)(jnp.asarray(x), pm.pack(jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_kernel
@pytest.mark.parametrize("k,batch", [(576, 9), (100, 35)])
def test_a_row_has_the_same_bits_alone_or_in_a_batch(k, batch):
  """A lone row takes one pass over the panel; 18 or 70 rows take it a block of k at a time
  (k = 100: a last block cut short; 70 rows: two groups of rows), their sums kept between
  blocks: the bits must not change."""
  rng = np.random.default_rng(1)
  w = pm.pack(jnp.asarray(rng.standard_normal((k, 200), dtype=np.float32)))
  x = jnp.asarray(rng.standard_normal((2, batch, k), dtype=np.float32))
  together = jax.jit(pm.packed_matmul)(x, w)
  assert together.shape == (2, batch, 200)
  for i in (0, 4, batch - 1):
    np.testing.assert_array_equal(jax.jit(pm.packed_matmul)(x[1, i:i + 1], w)[0],
                                  together[1, i])


_PRODUCTS = """
import sys
import jax, numpy as np
from tlt_jax.cpu import packed_matmul as pm
rng = np.random.default_rng(3)
out = {}
for rows in (*range(1, 10), 20, 37):
  for k, n in ((576, 200), (64, 25), (33, 1), (1536, 48)):
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = pm.pack(rng.standard_normal((k, n), dtype=np.float32))
    out[f"{rows}_{k}_{n}"] = np.asarray(jax.jit(pm.packed_matmul)(x, w))
np.savez(sys.argv[1], **out)
"""


@needs_kernel
@pytest.mark.skipif(not {"avx512f", "avx512vl"} <= kernels.cpu_flags(),
                    reason="no AVX-512 here: the kernel runs its AVX2 path only")
def test_the_avx512_path_gives_the_avx2_paths_bits(tmp_path):
  """Where the CPU has AVX-512 the kernel takes its own path (8 rows a pass, a 16- and an
  8-wide register a panel row); each output element is still one FMA chain over k, so it
  must give the AVX2 path's bits (TLT_JAX_CPU_AVX512=0 forces that path), for every row
  remainder and a last panel cut short."""
  got = {}
  for avx512 in ("0", "1"):
    env = dict(os.environ, TLT_JAX_CPU_AVX512=avx512, TLT_JAX_CPU_KERNELS="kernel",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    path = tmp_path / f"products_{avx512}.npz"
    proc = subprocess.run([sys.executable, "-c", _PRODUCTS, str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got[avx512] = dict(np.load(path))
  assert got["0"].keys() == got["1"].keys() and len(got["0"]) == 44
  for key, want in got["0"].items():
    np.testing.assert_array_equal(got["1"][key], want, err_msg=key)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6])
def test_weights_sharing_an_input_give_the_bits_of_one_call_each(rows):
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 64), dtype=np.float32))
  weights = [pm.pack(jnp.asarray(rng.standard_normal((64, n), dtype=np.float32)))
             for n in (96, 25, 1, 200)]
  together = jax.jit(pm.packed_matmuls)(x, weights)
  assert [y.shape for y in together] == [(rows, 96), (rows, 25), (rows, 1), (rows, 200)]
  for y, w in zip(together, weights):
    np.testing.assert_array_equal(y, jax.jit(pm.packed_matmul)(x, w))
  with pytest.raises(ValueError, match="1 to 4 weights"):
    pm.packed_matmuls(x, weights + weights[:1])


@needs_kernel
def test_rollout_layout_packs_and_matches_the_plain_layout():
  config = _small_config()
  params = transformer.init_params(config, jax.random.key(0))
  packed = rollout_layout(params)          # auto: packs on this CPU
  plain = rollout_layout(params, pack_weights=False)
  assert isinstance(packed["layers"][0]["w_up"], pm.PackedWeight)
  assert isinstance(packed["packed_lm_head"], pm.PackedWeight)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 61, (3, 6)))
  positions = jnp.broadcast_to(jnp.arange(6), (3, 6))

  def logits(p):
    hidden, _ = transformer.forward(p, config, tokens, positions,
                                    init_cache(config, 3, 16, per_layer=True))
    return transformer.lm_logits(p, config, hidden)

  np.testing.assert_allclose(logits(packed), logits(plain), atol=1e-5)
  with pytest.raises(ValueError, match="packed CPU layout"):
    rollout_layout(packed, pack_weights=False)


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("draft_vocab", [None, 23])
def test_the_draft_head_is_packed_with_the_rollout_layout(tied, draft_vocab):
  """The drafter's head over the rollout's packed params is packed too and gives the plain
  head's logits, for tied and untied heads, with and without a draft vocabulary."""
  config = _small_config(num_layers=1, tied=tied)
  params = transformer.init_params(config, jax.random.key(1))
  vocab_ids = None if draft_vocab is None else jnp.asarray(
      np.random.default_rng(3).permutation(61)[:draft_vocab])
  packed = rollout_draft_head(rollout_layout(params), config, vocab_ids)
  plain = rollout_draft_head(rollout_layout(params, pack_weights=False), config, vocab_ids)
  assert isinstance(packed, pm.PackedWeight) and not isinstance(plain, pm.PackedWeight)
  hidden = jax.random.normal(jax.random.key(4), (3, 2, 48))
  np.testing.assert_allclose(draft_logits(packed, hidden), draft_logits(plain, hidden),
                             atol=1e-5)


@needs_kernel
def test_the_drafter_rollout_layout_packs_and_matches_the_stacked_one():
  """`weights.drafter_layout`: the layer split out, every matrix and fc packed; a forward
  over a per-layer cache gives the stacked drafter's hidden states and K/V."""
  config = _small_config()
  target = transformer.init_params(config, jax.random.key(5))
  stacked = init_drafter_params(config, jax.random.key(6))
  from tlt_jax.rollout.weights import drafter_layout
  packed = drafter_layout(stacked)
  assert isinstance(packed["layers"], tuple) and isinstance(packed["fc"], pm.PackedWeight)
  assert isinstance(packed["layers"][0]["w_down"], pm.PackedWeight)
  assert drafter_layout(packed) is packed
  rng = np.random.default_rng(7)
  tokens = jnp.asarray(rng.integers(0, 61, (3, 5)))
  hidden = jnp.asarray(rng.normal(size=(3, 5, 48)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(4, 9), (3, 5))

  def run(drafter, per_layer):
    cache = init_drafter_cache(config, 3, 16, per_layer=per_layer)
    cache = cache.replace(lengths=jnp.full((3,), 4, jnp.int32))
    out, cache = drafter_forward(drafter, target, config, tokens, hidden, positions, cache)
    return out, cache.k, cache.v

  for got, want in zip(run(packed, True), run(stacked, False)):
    np.testing.assert_allclose(np.concatenate(jax.tree.leaves(got)),
                               np.concatenate(jax.tree.leaves(want)), atol=1e-5)


@needs_kernel
def test_the_rollout_packs_the_drafter_once_beside_a_packed_target():
  """`place_rollout` packs a float32 drafter beside the packed target, reuses it while its
  weights are the same arrays, packs new weights anew, and leaves a bfloat16 drafter (no
  kernel for it) stacked; the draft head is packed with the target and reused alike."""
  from tlt_jax.rollout.weights import DraftWeights, place_rollout
  config = _small_config(num_layers=1)
  params = transformer.init_params(config, jax.random.key(8))
  drafter = init_drafter_params(config, jax.random.key(9))
  place = lambda d: place_rollout(params, config, DraftWeights(d), None)
  placed, weights = place(drafter)
  assert isinstance(weights.params["layers"], tuple)
  assert place(drafter)[1].params is weights.params
  updated = jax.tree.map(lambda w: w * 2, drafter)
  assert place(updated)[1].params is not weights.params
  half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), drafter)
  assert not isinstance(place(half)[1].params["layers"], tuple)
  head = rollout_draft_head(placed, config, None)
  assert isinstance(head, pm.PackedWeight) and rollout_draft_head(placed, config, None) is head
  plain = rollout_layout(params, pack_weights=False)
  assert not isinstance(rollout_draft_head(plain, config, None), pm.PackedWeight)


def _use_kernel_in_subprocess(tmp_path, **env):
  code = ("import jax.numpy as jnp; from tlt_jax.cpu import kernels; "
          "print('use_kernel', kernels.enabled(jnp.float32), kernels.enabled(jnp.bfloat16))")
  return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu",
                             "TLT_JAX_CACHE": str(tmp_path), **env}, timeout=300)


def test_modes(tmp_path):
  assert "use_kernel False False" in _use_kernel_in_subprocess(
      tmp_path, TLT_JAX_CPU_KERNELS="xla").stdout
  bad = _use_kernel_in_subprocess(tmp_path, TLT_JAX_CPU_KERNELS="fast")
  assert bad.returncode != 0 and "TLT_JAX_CPU_KERNELS='fast'" in bad.stderr


def test_a_failed_build_warns_in_auto_mode_and_fails_in_kernel_mode(tmp_path):
  auto = _use_kernel_in_subprocess(tmp_path, CXX="false")
  assert "use_kernel False False" in auto.stdout, auto.stderr[-2000:]
  assert "XLA's own ops run, not the CPU kernels" in auto.stderr
  strict = _use_kernel_in_subprocess(tmp_path, CXX="false", TLT_JAX_CPU_KERNELS="kernel")
  assert strict.returncode != 0
  assert "TLT_JAX_CPU_KERNELS=kernel: " in strict.stderr
  assert not list(tmp_path.rglob("*.so")), "a failed build left a library behind"


@needs_kernel
def test_kernel_mode_builds_into_the_cache_dir(tmp_path):
  built = _use_kernel_in_subprocess(tmp_path, TLT_JAX_CPU_KERNELS="kernel")
  assert "use_kernel True False" in built.stdout, built.stderr[-2000:]
  assert len(list(tmp_path.rglob("tlt_cpu_kernels_*.so"))) == 1
