"""Drafter training: packing keeps samples apart, the loss trains, files round-trip, CLI."""
import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.cpu import kernels as cpu_kernels
from tlt_jax.data import packing
from tlt_jax import optim
from tlt_jax.drafter import trainer
from tlt_jax.drafter.losses import eagle_loss
from tlt_jax.errors import UserInputError
from tlt_jax.models import drafter, transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def target_params():
  return transformer.init_params(CONFIG, jax.random.key(0))


def _samples(seed, count, min_len=6, max_len=20):
  rng = np.random.default_rng(seed)
  samples = []
  for _ in range(count):
    n = int(rng.integers(min_len, max_len + 1))
    samples.append((rng.integers(3, CONFIG.vocab_size, n).tolist(), int(rng.integers(1, n))))
  return samples


def test_packing_layout():
  samples = [([5, 6, 7, 8, 9], 2), ([10, 11, 12], 1), ([13, 14], 2), (list(range(20, 40)), 3)]
  rows = packing.pack_samples(samples, seq_len=10)
  # The 20-token sample is truncated to 10 tokens; the prompt-only one is dropped.
  assert rows.num_rows == 2
  np.testing.assert_array_equal(rows.tokens[0], list(range(20, 30)))
  np.testing.assert_array_equal(rows.loss_mask[0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(rows.tokens[1], [5, 6, 7, 8, 9, 10, 11, 12, 0, 0])
  np.testing.assert_array_equal(rows.segment_ids[1], [1, 1, 1, 1, 1, 2, 2, 2, 0, 0])
  np.testing.assert_array_equal(rows.positions[1], [0, 1, 2, 3, 4, 0, 1, 2, 0, 0])
  # Slots j with x_{j+1} in the response: prompt_len - 1 .. len - 2 of each sample.
  np.testing.assert_array_equal(rows.loss_mask[1], [0, 1, 1, 1, 0, 1, 1, 0, 0, 0])
  mask = rows.new_mask[1]
  assert mask[6, 5] and not mask[5, 4] and not mask[4, 5] and not mask[2, 3]
  assert not mask[:8, 8:].any() and not mask[8:, :8].any()


def test_packed_rows_match_samples_run_alone(target_params):
  samples = _samples(1, 7)
  rows = packing.pack_samples(samples, seq_len=48)
  assert rows.num_rows < len(samples)  # really packed
  hidden = trainer.target_hidden(target_params, rows, config=CONFIG)
  drafter_params = drafter.init_drafter_params(CONFIG, jax.random.key(1))
  tokens, _ = trainer.drafter_pairs(rows, hidden)
  b, t = rows.tokens.shape
  pred, _ = drafter.drafter_forward(drafter_params, target_params, CONFIG, tokens, hidden,
                                    rows.positions, drafter.init_drafter_cache(CONFIG, b, t),
                                    rows.new_mask)
  # Each sample alone, right-padded in a batch of its own: causal, so padding after a
  # sample cannot change it.
  alone_tokens = np.zeros((len(samples), t), np.int32)
  segments = [(r, np.flatnonzero(rows.segment_ids[r] == s))
              for r in range(rows.num_rows) for s in range(1, rows.segment_ids[r].max() + 1)]
  assert len(segments) == len(samples)
  for i, (r, where) in enumerate(segments):
    alone_tokens[i, :len(where)] = rows.tokens[r, where]
  alone_positions = jnp.broadcast_to(jnp.arange(t), alone_tokens.shape)
  alone, _ = jax.jit(transformer.forward, static_argnums=1)(
      target_params, CONFIG, jnp.asarray(alone_tokens), alone_positions,
      init_cache(CONFIG, len(samples), t))
  # The drafter over each sample alone: (h_j, x_{j+1}) at slot j.
  alone_next = jnp.pad(jnp.asarray(alone_tokens[:, 1:]), ((0, 0), (0, 1)))
  alone_pred, _ = jax.jit(drafter.drafter_forward, static_argnums=2)(
      drafter_params, target_params, CONFIG, alone_next, alone, alone_positions,
      drafter.init_drafter_cache(CONFIG, len(samples), t))
  for i, (r, where) in enumerate(segments):
    n = len(where)
    np.testing.assert_allclose(hidden[r, where], alone[i, :n], atol=1e-5)
    np.testing.assert_allclose(pred[r, where[:-1]], alone_pred[i, :n - 1], atol=1e-5)


def test_unrolled_passes_compute_what_drafting_computes(target_params):
  """Pass m at index j equals the drafter run as a rollout runs it: the true context up to
  slot j in the cache, then a chain of nodes each fed its parent's predicted feature."""
  params = drafter.init_drafter_params(CONFIG, jax.random.key(4))
  rows = packing.pack_samples(_samples(3, 3), seq_len=48)
  hidden = trainer.target_hidden(target_params, rows, config=CONFIG)
  tokens, _ = trainer.drafter_pairs(rows, hidden)
  preds = trainer.unrolled_forward(params, target_params, CONFIG, tokens, hidden,
                                   jnp.asarray(rows.positions), jnp.asarray(rows.new_mask), 3)
  segments, checked = rows.segment_ids[0], 0
  for j in range(rows.tokens.shape[1] - 2):
    if not segments[j] or segments[j + 2] != segments[j]:
      continue
    start = int(np.argmax(segments == segments[j]))          # this sample's first slot
    cache = drafter.init_drafter_cache(CONFIG, 1, 64)
    span = slice(start, j + 1)
    pred, cache = drafter.drafter_forward(params, target_params, CONFIG, tokens[:1, span],
                                          hidden[:1, span], rows.positions[:1, span], cache)
    feature = pred[:, -1:]
    cache = cache.advance(jnp.array([j + 1 - start]))
    for m in (2, 3):                                          # tree levels 1 and 2
      slot = j + m - 1
      feature, cache = drafter.drafter_forward(
          params, target_params, CONFIG, tokens[:1, slot:slot + 1], feature,
          rows.positions[:1, slot:slot + 1], cache)
      cache = cache.advance(jnp.array([1]))
      np.testing.assert_allclose(feature[0, 0], preds[m - 1][0, j], atol=1e-5)
    checked += 1
  assert checked >= 10


def test_reduced_vocab_loss_is_restricted_target_distribution():
  keys = jax.random.split(jax.random.key(2), 3)
  pred, target = (jax.random.normal(k, (2, 5, 8)) for k in keys[:2])
  head = jax.random.normal(keys[2], (8, 12))
  weights = jnp.ones((2, 5))
  perm = jnp.asarray([3, 0, 7, 11, 5])
  loss, metrics = eagle_loss(pred, target, head[:, perm], weights)
  p = jax.nn.softmax(target @ head, axis=-1)[..., perm]
  p = p / p.sum(-1, keepdims=True)
  q = jax.nn.log_softmax(pred @ head[:, perm], axis=-1)
  np.testing.assert_allclose(metrics["soft_ce"], -(p * q).sum(-1).mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["sampled_accept"],
                             np.minimum(p, np.exp(q)).sum(-1).mean(), rtol=1e-5)
  assert np.isfinite(float(loss))
  _, same = eagle_loss(target, target, head, weights)   # q = p: every sampled draft passes
  np.testing.assert_allclose(same["sampled_accept"], 1.0, rtol=1e-5)
  zero_loss, zero = eagle_loss(pred, target, head, jnp.zeros((2, 5)))
  assert float(zero_loss) == 0.0 and float(zero["trained_slots"]) == 0.0


def test_training_overfits_small_corpus(target_params):
  rows = packing.pack_samples(_samples(3, 6), seq_len=64)
  vocab = jnp.asarray(trainer.select_draft_vocab([rows.tokens], 48, vocab_size=96))
  optimizer = optim.make_optimizer(3e-3, total_steps=30, warmup_steps=3)
  state = trainer.init_train_state(drafter.init_drafter_params(CONFIG, jax.random.key(4)),
                                   optimizer)
  history = []
  for _ in range(30):
    state, metrics = trainer.train_step(state, target_params, rows, vocab, config=CONFIG,
                                        optimizer=optimizer)
    history.append(jax.device_get(metrics))
  losses = [m["loss"] for m in history]
  assert all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3])
  assert history[-1]["top1_acc"] > history[0]["top1_acc"] + 0.2
  assert int(state.step) == 30
  # Hidden states handed in (as the rollout keeps them) give what the target forward gives.
  hidden = trainer.target_hidden(target_params, rows, config=CONFIG)
  final = trainer.eval_step(state.params, target_params, rows, vocab, config=CONFIG)
  given = trainer.eval_step(state.params, target_params, rows, vocab, hidden, config=CONFIG)
  np.testing.assert_allclose(final["loss"], given["loss"], rtol=1e-6)
  assert float(final["loss"]) <= losses[-1] * 1.05


@pytest.mark.parametrize("impl", ["auto", "reference", "pallas", "triton", "cpu"])
def test_train_step_with_every_attention_impl(impl, target_params):
  """A kernel in the drafter's loss differentiates (through the jnp reference's VJP) and
  gives the reference's update; Pallas runs interpreted on CPU."""
  if impl == "triton" and jax.default_backend() != "gpu":
    pytest.skip("the Triton kernel needs a GPU")
  if impl == "cpu" and (jax.default_backend() != "cpu" or cpu_kernels.build_problem()):
    pytest.skip(f"the CPU kernel needs the CPU backend and its build: "
                f"{cpu_kernels.build_problem()}")
  rows = packing.pack_samples(_samples(6, 3), seq_len=32)
  optimizer = optim.make_optimizer(1e-3, total_steps=4)
  params = drafter.init_drafter_params(CONFIG, jax.random.key(6))
  step = lambda attention_impl: trainer.train_step(
      trainer.init_train_state(jax.tree.map(jnp.copy, params), optimizer),   # donated
      target_params, rows, config=CONFIG,
      optimizer=optimizer, unroll=2, attention_impl=attention_impl)
  reference, reference_metrics = step("reference")
  state, metrics = step(impl)
  np.testing.assert_allclose(metrics["loss"], reference_metrics["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], reference_metrics["grad_norm"], rtol=1e-4)
  # Adam moves a weight by ~lr * gradient / (|gradient| + eps): float rounding in a gradient
  # of a few eps (kernel vs jnp, recomputed activations) reaches a few 1e-3 of lr (2.5e-3
  # on one w_gate weight, its gradient ~5e-8, with the kernel's cache and new-key blocks).
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
    np.testing.assert_allclose(got, want, atol=5e-6)


def test_select_draft_vocab():
  ids = trainer.select_draft_vocab([[5, 5, 9, 9, 9], [7, 5]], 4, vocab_size=12)
  np.testing.assert_array_equal(ids, [0, 5, 7, 9])  # 0 fills the unseen slot, lowest id
  with pytest.raises(UserInputError, match="--draft_vocab_size"):
    trainer.select_draft_vocab([[1]], 13, vocab_size=12)
  # Shrinking a draft vocabulary: 9 is the most frequent but not in it; 3 is in it, unseen.
  among = np.array([3, 5, 7, 11])
  shrunk = trainer.select_draft_vocab([[5, 5, 9, 9, 9], [7, 5, 11, 7]], 3, vocab_size=12,
                                      among=among)
  np.testing.assert_array_equal(shrunk, [5, 7, 11])
  np.testing.assert_array_equal(
      trainer.select_draft_vocab([[9, 9]], 2, vocab_size=12, among=among), [3, 5])
  with pytest.raises(UserInputError, match=r"must be in \[1, 4\]"):
    trainer.select_draft_vocab([[5]], 5, vocab_size=12, among=among)


def test_save_load_round_trip(tmp_path, target_params):
  optimizer = optim.make_optimizer(1e-3, total_steps=4)
  state = trainer.init_train_state(drafter.init_drafter_params(CONFIG, jax.random.key(5)),
                                   optimizer)
  rows = packing.pack_samples(_samples(6, 3), seq_len=32)
  state, _ = trainer.train_step(state, target_params, rows, config=CONFIG, optimizer=optimizer)
  vocab = np.arange(0, 96, 2, dtype=np.int32)
  out = str(tmp_path / "drafter")
  os.makedirs(out)
  with open(os.path.join(out, "corpus.json"), "w") as f:
    f.write("{}")
  trainer.save_drafter(out, state, vocab, CONFIG, target_source="tiny")
  trainer.save_drafter(out, state, vocab, CONFIG)  # overwrites in place
  assert os.path.isfile(os.path.join(out, "corpus.json"))
  assert not [p for p in os.listdir(out) if ".tmp-" in p]

  params, loaded_vocab = trainer.load_drafter(out, CONFIG)
  np.testing.assert_array_equal(loaded_vocab, vocab)
  assert jax.tree.structure(params) == jax.tree.structure(state.params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  fresh = trainer.init_train_state(drafter.init_drafter_params(CONFIG, jax.random.key(9)),
                                   optimizer)
  restored = trainer.restore_train_state(out, fresh)
  assert int(restored.step) == 1
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with open(os.path.join(out, trainer.CONFIG)) as f:
    exported = json.load(f)
  assert exported["draft_vocab_size"] == 48 and exported["target"]["hidden_size"] == 32


def test_export_as_float16(tmp_path):
  """The shippable export: float16 weights load back within float16 rounding; a weight
  float16 cannot hold is an error, not an inf."""
  params = drafter.init_drafter_params(CONFIG, jax.random.key(3))
  vocab = np.arange(0, 90, 3, dtype=np.int32)
  out = str(tmp_path / "shipped")
  trainer.export_drafter(out, params, vocab, CONFIG, step=7, target_source="tiny",
                         dtype="float16")
  assert set(os.listdir(out)) == {trainer.CONFIG, trainer.WEIGHTS}
  loaded, loaded_vocab = trainer.load_drafter(out, CONFIG)
  np.testing.assert_array_equal(loaded_vocab, vocab)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)
  with open(os.path.join(out, trainer.CONFIG)) as f:
    exported = json.load(f)
  assert exported["torch_dtype"] == "float16" and exported["step"] == 7
  huge = dict(params, fc_bias=params["fc_bias"].at[0].set(1e5))
  with pytest.raises(UserInputError, match=r"fc.bias: holds values beyond float16"):
    trainer.export_drafter(str(tmp_path / "huge"), huge, None, CONFIG, step=None,
                           target_source=None, dtype="float16")


def test_load_drafter_rejects_other_model(tmp_path):
  out = str(tmp_path / "drafter")
  params = drafter.init_drafter_params(CONFIG, jax.random.key(7))
  trainer.save_drafter(out, params, np.arange(90, dtype=np.int32), CONFIG)
  wider = dataclasses.replace(CONFIG, hidden_size=48)
  with pytest.raises(UserInputError, match=r"drafter.safetensors: tensor fc.weight"):
    trainer.load_drafter(out, wider)
  smaller_vocab = dataclasses.replace(CONFIG, vocab_size=64)
  with pytest.raises(UserInputError, match=r"tensor draft_vocab"):
    trainer.load_drafter(out, smaller_vocab)
  trainer.save_drafter(out, params, None, CONFIG)
  with pytest.raises(UserInputError, match=r"target.vocab_size"):
    trainer.load_drafter(out, smaller_vocab)
  with pytest.raises(UserInputError, match="no optimizer state"):
    trainer.restore_train_state(
        out, trainer.init_train_state(params, optim.make_optimizer(1e-3, total_steps=2)))
  with pytest.raises(UserInputError, match="missing"):
    trainer.load_drafter(str(tmp_path), CONFIG)


def _cli(*args, timeout=240, cache=""):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache)
  return subprocess.run([sys.executable, "-m", "experiments.train_drafter", *args],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_trains_and_resumes(tiny_hf_dirs, tmp_path, compile_cache):
  run = functools.partial(_cli, cache=compile_cache)   # the later runs load the first's programs
  out = str(tmp_path / "run")
  tiny_config = ModelConfig.from_hf_dir(tiny_hf_dirs["llama"])
  # 20 prompts: the fewest for which one sample is held out and evaluated.
  flags = [f"--model={tiny_hf_dirs['llama']}", f"--out={out}", "--num_prompts=20",
           "--tasks=basic_arithmetic,chat", "--max_new_tokens=8", "--batch_rows=2",
           "--seq_len=128", "--draft_vocab_size=64", "--log_every=1", "--eval_every=2"]
  corpus_only = run(*flags, "--corpus_only")
  assert corpus_only.returncode == 0, corpus_only.stderr[-2000:]
  assert sorted(os.listdir(out)) == ["corpus.json"]
  first = run(*flags, "--steps=2")
  assert first.returncode == 0, first.stderr[-2000:]
  assert "cached corpus" in first.stderr
  for name in ("corpus.json", "metrics.json", trainer.WEIGHTS, trainer.CONFIG):
    assert os.path.isfile(os.path.join(out, name)), name
  relative_out = f"--out={os.path.relpath(out, REPO_ROOT)}"   # orbax wants absolute paths
  resumed = run(*[relative_out if f.startswith("--out=") else f for f in flags], "--steps=4",
                 "--resume", "--ce_weight=1.0")
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "cached corpus" in resumed.stderr and "resumed at step 2" in resumed.stderr
  assert "step 4 held-out: loss" in resumed.stderr and " / T=1 " in resumed.stderr
  with open(os.path.join(out, "metrics.json")) as f:
    metrics = json.load(f)
  assert metrics["step"] == 4 and [e["step"] for e in metrics["held_out_history"]] == [2, 4]
  assert np.isfinite(metrics["held_out"]["loss"]) and metrics["corpus"]["held_out_samples"] == 1
  _, vocab = trainer.load_drafter(out, tiny_config)
  assert len(vocab) == 64
  assert os.path.isfile(os.path.join(out, "hidden_states_train.npy"))

  # Export for shipping: float16 files that load for the same model.
  shipped = str(tmp_path / "shipped")
  export = lambda *a: subprocess.run([sys.executable, "-m", "experiments.export_drafter",
                                      f"--model={tiny_hf_dirs['llama']}", *a], cwd=REPO_ROOT,
                                     capture_output=True, text=True, timeout=120,
                                     env=dict(os.environ, JAX_PLATFORMS="cpu",
                                              JAX_COMPILATION_CACHE_DIR=compile_cache))
  exported = export(f"--drafter={out}", f"--out={shipped}")
  assert exported.returncode == 0, exported.stderr[-2000:]
  assert "(step 4)" in exported.stderr and "float16" in exported.stderr
  _, shipped_vocab = trainer.load_drafter(shipped, tiny_config)
  np.testing.assert_array_equal(shipped_vocab, vocab)
  # Shrunk to the 16 of its 64 draft ids most frequent in its corpus's responses.
  small = str(tmp_path / "small")
  shrunk = export(f"--drafter={out}", f"--out={small}", "--draft_vocab_size=16",
                  f"--vocab_corpora={out}/corpus.json")
  assert shrunk.returncode == 0, shrunk.stderr[-2000:]
  assert "16 draft ids" in shrunk.stderr
  _, small_vocab = trainer.load_drafter(small, tiny_config)
  with open(os.path.join(out, "corpus.json")) as f:
    counts = np.bincount(np.concatenate([s["response_ids"] for s in json.load(f)["samples"]]),
                         minlength=tiny_config.vocab_size)
  dropped = np.setdiff1d(vocab, small_vocab)
  assert len(small_vocab) == 16 and np.isin(small_vocab, vocab).all()
  assert counts[small_vocab].min() >= counts[dropped].max() and counts[small_vocab].min() > 0
  too_big = export(f"--drafter={out}", f"--out={small}", "--draft_vocab_size=65",
                   f"--vocab_corpora={out}/corpus.json")
  assert too_big.returncode == 2 and too_big.stderr.strip().count("\n") == 0
  assert "--draft_vocab_size=65: the drafter in" in too_big.stderr
  onto_itself = export(f"--drafter={out}", f"--out={out}")
  assert onto_itself.returncode == 2 and onto_itself.stderr.strip().count("\n") == 0
  assert "is --drafter itself" in onto_itself.stderr
  # The export keeps training (fresh optimizer), with its own draft vocabulary.
  again = str(tmp_path / "again")
  continued = run(*[f"--out={again}" if f.startswith("--out=") else f for f in flags],
                   "--steps=1", f"--init_from={shipped}")
  assert continued.returncode == 0, continued.stderr[-2000:]
  assert f"starting from the weights of {shipped}" in continued.stderr
  with open(os.path.join(again, "metrics.json")) as f:
    assert [e["step"] for e in json.load(f)["held_out_history"]] == [0, 1]
  np.testing.assert_array_equal(
      trainer.load_drafter(again, tiny_config)[1], vocab)
  both_ways = run(*flags, "--steps=5", "--resume", f"--init_from={shipped}")
  assert both_ways.returncode == 2 and "not both" in both_ways.stderr

  # A second run adds the first run's corpus to its own (40 samples: 2 held out).
  mixed = str(tmp_path / "mixed")
  flags[1] = f"--out={mixed}"
  both = run(*flags, "--steps=1", "--seed=1", f"--extra_corpora={out}/corpus.json")
  assert both.returncode == 0, both.stderr[-2000:]
  with open(os.path.join(mixed, "metrics.json")) as f:
    assert json.load(f)["corpus"]["held_out_samples"] == 2
  bad = run(*flags, "--steps=1", f"--extra_corpora={out}/metrics.json")
  assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
  assert "metrics.json is not a train_drafter corpus.json" in bad.stderr


def test_cli_bad_flag_exits_2(tmp_path):
  result = _cli("--model=smollm2", f"--out={tmp_path}", "--lr=-1")
  assert result.returncode == 2
  assert result.stderr.strip().count("\n") == 0 and "--lr" in result.stderr
