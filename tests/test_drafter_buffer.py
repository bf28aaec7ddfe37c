"""The online drafter buffer, its async checkpoint and the online train steps.

One buffer shape ([4, 32] rows of a 32-wide target) throughout, so the train and eval
programs compile once for the module."""
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import drafter_checkpoint_child as child
from tlt_jax import optim
from tlt_jax.data import packing
from tlt_jax.drafter import array_file
from tlt_jax.drafter import buffer as buffer_lib
from tlt_jax.drafter import online, trainer
from tlt_jax.drafter.checkpoints import DrafterCheckpoints
from tlt_jax.errors import UserInputError
from tlt_jax.models import drafter, transformer
from tlt_jax.models.config import ModelConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=256, tie_word_embeddings=True)
BUFFER = buffer_lib.BufferConfig(seq_len=32, batch_rows=4, context=8, previous_ratio=0.5,
                                 heldout_fraction=0.2, seed=7)
OPTIMIZER = optim.make_optimizer(3e-3, 1000, schedule="constant")
_FEED = 64   # every rollout sequence is fed to the target padded to this many tokens


@pytest.fixture(scope="module")
def target_params():
  return jax.jit(transformer.init_params, static_argnums=0)(CONFIG, jax.random.key(0))


def _hidden(target_params, tokens):
  """The target's hidden state at every token of `tokens` (a plain forward)."""
  rows = packing.pack_samples([(list(tokens), 0)], _FEED)
  return np.array(trainer.target_hidden(target_params, rows, config=CONFIG))[0, :len(tokens)]


def _rollout(target_params, seed, count, max_response=40, repetitive=False):
  """(prompt, response, hidden [n_fed, E]) of `count` responses; a repetitive response
  steps through the vocabulary with its prompt's stride."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    prompt = rng.integers(3, CONFIG.vocab_size, int(rng.integers(2, 7))).tolist()
    n = int(rng.integers(2, max_response + 1))
    if repetitive:
      response = [3 + (prompt[-1] + prompt[0] % 5 * k) % 90 for k in range(1, n + 1)]
    else:
      response = rng.integers(3, CONFIG.vocab_size, n).tolist()
    fed = prompt + response[:-1]          # the last emitted token is never fed
    out.append((prompt, response, _hidden(target_params, fed)))
  return out


def _fake(count, seed=0, width=4, prompt=3, lengths=(2, 40), first_token=3):
  """Sequences with random hidden states, each marked by its own response tokens."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    n = int(rng.integers(lengths[0], lengths[1] + 1))
    ids = [first_token + i] * (prompt + n)
    out.append((ids[:prompt], ids[prompt:],
                rng.normal(size=(prompt + n, width)).astype(np.float32)))
  return out


def _fill(buffer, step, sequences):
  for prompt, response, hidden in sequences:
    buffer.add(step, prompt, response, hidden)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_batches_equal(a, b):
  _assert_trees_equal(a.rows, b.rows)
  np.testing.assert_array_equal(a.hidden, b.hidden)
  assert (a.current_slots, a.previous_slots) == (b.current_slots, b.previous_slots)


@jax.jit
def _state_from(key):
  return trainer.init_train_state(drafter.init_drafter_params(CONFIG, key), OPTIMIZER)


def _state(seed=1):
  """A fresh drafter and optimizer (one program: eager initialization compiles dozens)."""
  return _state_from(jax.random.key(seed))


def _host(tree):
  return jax.tree.map(np.array, jax.device_get(tree))


# ---- windows and adding ----------------------------------------------------------------

@pytest.mark.parametrize("context", [0, 5, 14])
def test_windows_train_each_response_slot_once_with_context(context):
  rng = np.random.default_rng(context)
  for _ in range(200):
    length = int(rng.integers(2, 80))
    first = int(rng.integers(0, length - 1))
    trained = []
    for start, end, a in buffer_lib.window_bounds(length, first, 16, context):
      assert 0 <= start <= a < end <= length and end - start <= 16
      assert a - start >= min(context, a)
      trained += range(a, end - 1)     # slots a .. end - 2: each has its successor token
    assert trained == list(range(first, length - 1))


def test_add_rejects_misaligned_hidden_states():
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  buffer.add(0, [5, 6], [7, 8, 9], np.zeros((4, 8), np.float32))    # all but the last fed
  buffer.add(0, [5, 6], [7, 8, 9], np.zeros((5, 8), np.float32))    # all fed
  for rows in (3, 6):
    with pytest.raises(ValueError, match="n_fed"):
      buffer.add(0, [5, 6], [7, 8, 9], np.zeros((rows, 8), np.float32))
  with pytest.raises(ValueError, match="holds 8"):
    buffer.add(0, [5, 6], [7, 8, 9], np.zeros((5, 4), np.float32))
  with pytest.raises(UserInputError, match="context=31"):
    buffer_lib.BufferConfig(seq_len=32, context=31)


def test_byte_bound_evicts_oldest_steps_first_and_expires_old_steps():
  one = _fake(1, lengths=(20, 20))[0]
  seq_bytes = (len(one[0]) + len(one[1])) * 4 + one[2].nbytes
  buffer = buffer_lib.OnlineBuffer(buffer_lib.BufferConfig(max_bytes=5 * seq_bytes,
                                                           seq_len=32, context=8))
  _fill(buffer, 0, _fake(4, seed=1, lengths=(20, 20), first_token=10))
  _fill(buffer, 1, _fake(3, seed=2, lengths=(20, 20), first_token=40))
  stats = buffer.stats()
  assert stats["bytes"] == 5 * seq_bytes <= stats["max_bytes"]
  assert (stats["sequences"], stats["evicted_sequences"]) == (5, 2)
  assert stats["evicted_bytes"] == 2 * seq_bytes
  # What was evicted is step 0's two oldest: step 0 keeps its last two, step 1 all three.
  state, _ = buffer.state_dict()[1], None
  assert state["step"].tolist() == [0, 0, 1, 1, 1]
  assert state["index"].tolist() == [2, 3, 0, 1, 2]
  # Step 3 expires steps 0 and 1 (before its previous step, 2): they can never be drawn.
  _fill(buffer, 3, _fake(1, seed=3, lengths=(20, 20)))
  stats = buffer.stats()
  assert (stats["sequences"], stats["expired_sequences"]) == (1, 5)
  assert stats["bytes"] == seq_bytes
  _fill(buffer, 1, _fake(1, seed=4))      # a late add for an expired step is dropped
  assert buffer.stats()["expired_sequences"] == 6


# ---- drawing ---------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_batches_mix_the_previous_steps_long_windows_at_the_ratio(ratio):
  config = buffer_lib.BufferConfig(seq_len=32, batch_rows=4, context=8, previous_ratio=ratio,
                                   long_quantile=0.5, heldout_fraction=0.0)
  buffer = buffer_lib.OnlineBuffer(config)
  short, long = _fake(10, seed=1, lengths=(3, 8)), _fake(10, seed=2, lengths=(60, 90))
  previous = [(p, r, h) for pair in zip(short, long) for p, r, h in pair]
  for i, (p, r, h) in enumerate(previous):   # distinct marker tokens: 3..22 short/long
    buffer.add(4, [3 + i] * len(p), [3 + i] * len(r), h)
  _fill(buffer, 5, _fake(30, seed=3, lengths=(3, 12), first_token=50))
  long_markers = {3 + i for i in range(1, 20, 2)}
  previous_share, totals = [], np.zeros(2)
  for _ in range(20):
    batch = buffer.batch(5)
    tokens = batch.rows.tokens[batch.rows.loss_mask > 0]
    # Loss slots j are labelled by x_{j+1}; every sample here is one repeated token.
    from_previous = set(tokens[tokens < 50].tolist())
    assert from_previous <= long_markers        # never a short answer of the previous step
    assert batch.rows.loss_mask.sum() == batch.current_slots + batch.previous_slots
    totals += (batch.previous_slots, batch.current_slots)
    previous_share.append(batch.previous_slots / (batch.previous_slots + batch.current_slots))
  share = totals[0] / totals.sum()
  assert abs(share - ratio) <= 0.12, (share, ratio)
  if ratio in (0.0, 1.0):
    assert share == ratio


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_trainable_slots_count_one_pass_over_what_batches_draw(ratio):
  config = buffer_lib.BufferConfig(seq_len=64, batch_rows=64, context=8, previous_ratio=ratio,
                                   long_quantile=0.5, heldout_fraction=0.25)
  buffer = buffer_lib.OnlineBuffer(config)
  _fill(buffer, 4, _fake(8, seed=1, lengths=(3, 90)))
  _fill(buffer, 5, _fake(8, seed=2, lengths=(3, 30), first_token=50))
  batch = buffer.batch(5)             # 64 rows: every drawable window fits in one batch
  assert buffer.trainable_slots(5) == batch.current_slots + batch.previous_slots > 0
  assert buffer.trainable_slots(7) == 0


def test_replay_draws_the_long_windows_of_several_earlier_steps():
  config = buffer_lib.BufferConfig(seq_len=32, batch_rows=64, context=8, previous_ratio=0.5,
                                   long_quantile=0.5, heldout_fraction=0.0, replay_steps=2)
  buffer = buffer_lib.OnlineBuffer(config)
  for step in range(4):                  # step s's samples repeat token 10 * (s + 1) + i
    sequences = _fake(4, seed=step, lengths=(3, 40))
    for i, (p, r, h) in enumerate(sequences):
      buffer.add(step, [10 * (step + 1) + i] * len(p), [10 * (step + 1) + i] * len(r), h)
  assert buffer.stats()["expired_sequences"] == 4      # step 0: more than 2 steps before 3
  tokens = set()
  for _ in range(10):
    batch = buffer.batch(3)
    tokens |= set(batch.rows.tokens[batch.rows.loss_mask > 0].tolist())
  assert {t // 10 for t in tokens} == {2, 3, 4}        # steps 1 and 2 replayed, and 3


def test_long_responses_received_from_another_replica_are_replayed_not_reshared():
  config = buffer_lib.BufferConfig(seq_len=32, batch_rows=64, context=8, previous_ratio=0.5,
                                   long_quantile=0.5, heldout_fraction=0.25, replay_steps=2)
  mine, theirs = buffer_lib.OnlineBuffer(config), buffer_lib.OnlineBuffer(config)
  _fill(mine, 1, _fake(4, seed=1, first_token=3, lengths=(2, 6)))       # short answers
  _fill(theirs, 1, _fake(8, seed=2, first_token=30, lengths=(20, 60)))  # the tail's
  sent = theirs.own_long(1, max_bytes=1 << 30)
  long_markers = {int(t) for t in sent["tokens"]}
  held = {30 + i for i in range(8) if buffer_lib.is_heldout(i, config.heldout_fraction)}
  assert len(sent["length"]) == 3 and not long_markers & held    # 3 of 6 training ones
  assert list(sent["response_len"]) == sorted(sent["response_len"], reverse=True)
  first = theirs.own_long(1, max_bytes=int(sent["length"][0]) * (4 + 4 * 4))
  assert len(first["length"]) == 1                     # the longest alone fits the bound
  before = (mine.trainable_slots(2), mine.trainable_slots(1), mine.own_long(1, 1 << 30),
            mine.heldout(1))
  mine.add_received(sent)
  assert mine.trainable_slots(2) > before[0]
  assert mine.trainable_slots(1) == before[1]           # never the current step's,
  _assert_trees_equal(mine.own_long(1, 1 << 30), before[2])   # nor shared again,
  for a, b in zip(mine.heldout(1), before[3], strict=True):   # nor held out
    _assert_batches_equal(a, b)
  drawn = set()
  for _ in range(10):
    batch = mine.batch(2)
    drawn |= set(batch.rows.tokens[batch.rows.loss_mask > 0].tolist())
  assert long_markers <= drawn                          # every received one replayed
  again = buffer_lib.OnlineBuffer(config)               # and kept by a checkpoint
  again.load_state_dict(*mine.state_dict())
  _assert_batches_equal(again.batch(2), mine.batch(2))
  meta, arrays = theirs.state_dict()                    # saved before `received` was
  older = buffer_lib.OnlineBuffer(config)
  older.load_state_dict(meta, {k: v for k, v in arrays.items() if k != "received"})
  assert older.stats() == theirs.stats()
  _assert_batches_equal(older.batch(2), theirs.batch(2))


def test_heldout_windows_are_never_drawn_for_training():
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  _fill(buffer, 0, _fake(20, seed=1, first_token=3))
  _fill(buffer, 1, _fake(20, seed=2, first_token=30))
  heldout_markers = {first + i for first in (3, 30) for i in range(20)
                     if buffer_lib.is_heldout(i, BUFFER.heldout_fraction)}
  assert len(heldout_markers) == 8                       # exactly 20% of each step
  for _ in range(30):
    batch = buffer.batch(1)
    drawn = set(batch.rows.tokens[batch.rows.segment_ids > 0].tolist())
    assert not drawn & heldout_markers
  held = buffer.heldout()                                # the latest step's
  drawn = set(np.concatenate([b.rows.tokens[b.rows.segment_ids > 0] for b in held]).tolist())
  assert drawn == {m for m in heldout_markers if m >= 30}
  windows = sum(len(buffer_lib.window_bounds(3 + len(r) - 1 + 1, 2, 32, BUFFER.context))
                for i, (_, r, _) in enumerate(_fake(20, seed=2))
                if buffer_lib.is_heldout(i, BUFFER.heldout_fraction))
  assert sum(int((b.rows.segment_ids.max(axis=1)).sum()) for b in held) == windows


def test_a_samples_loss_is_the_same_packed_or_alone(target_params):
  sequences = _rollout(target_params, 5, 12, max_response=12)
  config = buffer_lib.BufferConfig(seq_len=32, batch_rows=4, context=8, heldout_fraction=0.0)
  packed = buffer_lib.OnlineBuffer(config)
  _fill(packed, 0, sequences)
  batch = packed.batch(0)
  assert (batch.rows.segment_ids.max(axis=1) >= 2).all()     # really packed
  params = drafter.init_drafter_params(CONFIG, jax.random.key(3))
  evaluate = lambda rows, hidden: float(trainer.eval_step(params, target_params, rows, None,
                                                          hidden, config=CONFIG)["loss"])
  checked = 0
  for r in range(batch.rows.num_rows):
    for segment in range(1, batch.rows.segment_ids[r].max() + 1):
      mine = np.zeros_like(batch.rows.loss_mask)
      mine[r] = batch.rows.loss_mask[r] * (batch.rows.segment_ids[r] == segment)
      in_pack = evaluate(batch.rows.replace(loss_mask=mine), batch.hidden)
      token = batch.rows.tokens[r][batch.rows.segment_ids[r] == segment]
      index = next(i for i, (p, s, _) in enumerate(sequences) if p + s[:len(token) - len(p)]
                   == token.tolist())
      alone = buffer_lib.OnlineBuffer(config)
      _fill(alone, 0, [sequences[index]])
      single = alone.batch(0)
      assert single.rows.segment_ids.max() == 1
      np.testing.assert_allclose(in_pack, evaluate(single.rows, single.hidden), atol=1e-5)
      checked += 1
  assert checked >= 10


# ---- state and checkpoints -------------------------------------------------------------

def test_array_file_keeps_every_dtype_bit_for_bit(tmp_path):
  path = str(tmp_path / "a.npz")
  arrays = {"bf16": (np.arange(12, dtype=np.float32) / 7).astype(jnp.bfloat16).reshape(3, 4),
            "nan": np.array([np.nan, -0.0, np.inf], np.float32),
            "empty": np.zeros((0, 5), np.float16), "flag": np.array([True, False]),
            "scalar": np.array(7, np.int32)}
  array_file.write_arrays(path, arrays)
  back = array_file.read_arrays(path)
  assert back.keys() == arrays.keys()
  for name, value in arrays.items():
    assert (back[name].dtype, back[name].shape) == (value.dtype, value.shape)
    assert back[name].tobytes() == value.tobytes()
  (tmp_path / "bad.npz").write_bytes(b"not a zip")
  with pytest.raises(UserInputError, match="bad.npz: not a readable array file"):
    array_file.read_arrays(str(tmp_path / "bad.npz"))


def test_buffer_state_round_trip_gives_the_same_next_batch(tmp_path):
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  as_bf16 = lambda seqs: [(p, r, h.astype(jnp.bfloat16)) for p, r, h in seqs]
  _fill(buffer, 2, as_bf16(_fake(15, seed=1)))
  _fill(buffer, 3, as_bf16(_fake(9, seed=2, first_token=40)))
  assert buffer.batch(3).hidden.dtype == jnp.bfloat16
  buffer_lib.save_state(str(tmp_path), buffer.state_dict())
  again = buffer_lib.OnlineBuffer(BUFFER)
  buffer_lib.load_state(str(tmp_path), again)
  assert again.stats() == buffer.stats()
  for _ in range(3):
    _assert_batches_equal(again.batch(3), buffer.batch(3))
  for a, b in zip(again.heldout(), buffer.heldout()):
    _assert_batches_equal(a, b)
  other = buffer_lib.OnlineBuffer(buffer_lib.BufferConfig(**{**BUFFER.__dict__, "seed": 8}))
  with pytest.raises(UserInputError, match="seed=8"):
    buffer_lib.load_state(str(tmp_path), other)


def test_drafter_checkpoint_restores_state_and_buffer_exactly(tmp_path, target_params):
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  _fill(buffer, 0, _rollout(target_params, 1, 12))
  state, _ = online.train_steps(_state(), target_params, buffer, 0, threading.Event(), 2,
                                config=CONFIG, optimizer=OPTIMIZER)
  with DrafterCheckpoints(str(tmp_path), keep=2) as checkpoints:
    for step in (1, 2, 3):
      checkpoints.save(step, state, buffer, {"bandit": [step]})
    checkpoints.wait()
    assert checkpoints.steps() == [2, 3]
  expected, expected_batch = _host(state), buffer.batch(0)
  restored_buffer = buffer_lib.OnlineBuffer(BUFFER)
  restored, meta = DrafterCheckpoints(str(tmp_path)).restore(_state(5), restored_buffer)
  assert meta == {"bandit": [3]}
  _assert_trees_equal(restored, expected)
  _assert_batches_equal(restored_buffer.batch(0), expected_batch)
  with pytest.raises(UserInputError, match="no drafter checkpoint of step 1"):
    DrafterCheckpoints(str(tmp_path)).restore(_state(), step=1)


def test_a_save_killed_midway_leaves_the_last_good_checkpoint(tmp_path):
  proc = subprocess.Popen([sys.executable, "-m", "tests.drafter_checkpoint_child",
                           str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "stalled"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  left = sorted(os.listdir(tmp_path))
  assert left[0].startswith(".step_00000002.tmp-") and left[1:] == ["step_00000001"]
  checkpoints = DrafterCheckpoints(str(tmp_path))      # removes the killed save's temporary
  assert os.listdir(tmp_path) == ["step_00000001"] and checkpoints.latest_step() == 1
  buffer = buffer_lib.OnlineBuffer(child.BUFFER)
  state, meta = checkpoints.restore(child.build_state(9), buffer)
  assert meta == {"step": 1}
  _assert_trees_equal(state, child.build_state(1))
  expected = child.build_buffer(12)
  assert buffer.stats() == expected.stats()
  _assert_batches_equal(buffer.batch(1), expected.batch(1))


# ---- online steps ----------------------------------------------------------------------

def test_a_nan_step_is_discarded_and_the_last_good_state_kept(target_params):
  good = buffer_lib.OnlineBuffer(BUFFER)
  _fill(good, 0, _rollout(target_params, 2, 8))
  state, report = online.train_steps(_state(), target_params, good, 0, threading.Event(), 2,
                                     config=CONFIG, optimizer=OPTIMIZER)
  assert (report.steps, report.discarded) == (2, 0) and np.isfinite(report.mean_loss)
  before = _host(state)
  # Finite hidden states far too large: the step's logits overflow and its loss is NaN.
  blown = buffer_lib.OnlineBuffer(BUFFER)
  _fill(blown, 0, [(p, r, h * 1e37) for p, r, h in _rollout(target_params, 3, 4)])
  state, report = online.train_steps(state, target_params, blown, 0, threading.Event(), 3,
                                     config=CONFIG, optimizer=OPTIMIZER)
  assert (report.steps, report.discarded) == (3, 3) and np.isnan(report.mean_loss)
  _assert_trees_equal(_host(state), before)             # params, moments and step count
  state, report = online.train_steps(state, target_params, good, 0, lambda: False, 1,
                                     config=CONFIG, optimizer=OPTIMIZER)
  assert (report.steps, report.discarded, int(state.step)) == (1, 0, 3)


def test_responses_with_nonfinite_hidden_states_are_not_stored():
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  sequences = _fake(3)
  sequences[0][2][-1, 0] = np.nan
  sequences[1][2][0, 1] = np.inf
  _fill(buffer, 0, sequences)
  stats = buffer.stats()
  assert (stats["sequences"], stats["nonfinite_sequences"]) == (1, 2)


def test_stop_is_checked_between_steps_and_ends_within_one_step(target_params):
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  _fill(buffer, 0, _rollout(target_params, 4, 10))
  checks = []
  stop_after_three = lambda: checks.append(1) or len(checks) > 3
  state, report = online.train_steps(_state(), target_params, buffer, 0, stop_after_three,
                                     100, config=CONFIG, optimizer=OPTIMIZER)
  assert report.steps == 3 and report.stop_seen is not None

  stop, set_at = threading.Event(), []
  timer = threading.Timer(0.5, lambda: (set_at.append(time.perf_counter()), stop.set()))
  timer.start()
  state, report = online.train_steps(state, target_params, buffer, 0, stop, 100_000,
                                     config=CONFIG, optimizer=OPTIMIZER)
  timer.join()
  assert 0 < report.steps < 100_000 and report.stop_seen >= set_at[0]
  # At most the step in flight when the stop came ends after it.
  assert sum(end > set_at[0] for _, end in report.spans) <= 1


def test_steps_stop_once_they_drew_the_slot_cap(target_params):
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  _fill(buffer, 0, _rollout(target_params, 4, 10))
  epoch = buffer.trainable_slots(0)
  state, report = online.train_steps(_state(), target_params, buffer, 0, threading.Event(),
                                     100, max_slots=2 * epoch, config=CONFIG,
                                     optimizer=OPTIMIZER)
  drawn = report.previous_slots + report.current_slots
  # The step that crossed the cap is the last one: fewer slots would have let one more run.
  assert 2 * epoch <= drawn < 2 * epoch + BUFFER.batch_rows * BUFFER.seq_len
  assert 1 < report.steps < 100 and report.stop_seen is None


def test_online_steps_on_repetitive_data_lower_the_heldout_loss(target_params):
  buffer = buffer_lib.OnlineBuffer(BUFFER)
  _fill(buffer, 0, _rollout(target_params, 6, 30, repetitive=True))
  _fill(buffer, 1, _rollout(target_params, 7, 30, repetitive=True))
  heldout = buffer.heldout()
  assert heldout

  def heldout_loss(params):
    totals = np.zeros(2)
    for batch in heldout:
      metrics = trainer.eval_step(params, target_params, batch.rows, None, batch.hidden,
                                  config=CONFIG)
      totals += float(metrics["loss"]) * float(metrics["trained_slots"]), \
          float(metrics["trained_slots"])
    return totals[0] / totals[1]

  state = _state(11)
  initial = heldout_loss(state.params)
  state, report = online.train_steps(state, target_params, buffer, 1, threading.Event(), 300,
                                     config=CONFIG, optimizer=OPTIMIZER)
  assert report.steps == 300 and report.discarded == 0
  assert report.previous_slots > 0 and report.current_slots > 0
  final = heldout_loss(state.params)
  print(f"held-out loss {initial:.4f} -> {final:.4f}")
  assert final < 0.7 * initial, (initial, final)
