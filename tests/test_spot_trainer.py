"""The spot trainer's step: observe a rollout, train while idle until stopped, average the
replicas' drafters by steps trained, deploy only what beats the deployed drafter."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.data import packing
from tlt_jax.drafter import trainer
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.errors import UserInputError
from tlt_jax.models import drafter, transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl import spot_trainer
from tlt_jax.rollout.weights import DraftWeights

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=128, tie_word_embeddings=True)


def _rollout(target, seed: int, count: int):
  """(prompt, response, hidden) triples as a rollout hands them over: responses repeat a
  pattern, hidden states are the target's over the whole sequence but its last token."""
  rng = np.random.default_rng(seed)
  pattern = rng.integers(3, CONFIG.vocab_size, 5).tolist()
  out = []
  for _ in range(count):
    prompt = rng.integers(3, CONFIG.vocab_size, 4).tolist()
    response = pattern * int(rng.integers(2, 5))
    sequence = prompt + response
    row = packing.pack_samples([(sequence, len(prompt))], len(sequence))
    hidden = trainer.target_hidden(target, row, config=CONFIG)
    out.append((prompt, response, np.asarray(hidden[0, :-1])))
  return out


@pytest.fixture(scope="module")
def target():
  return transformer.init_params(CONFIG, jax.random.key(0))


def _trainer(**overrides):
  config = spot_trainer.SpotConfig(
      buffer=BufferConfig(seq_len=32, batch_rows=4, context=4, heldout_fraction=0.25),
      lr=3e-3, lr_steps=200, **overrides)
  deployed = DraftWeights(drafter.init_drafter_params(CONFIG, jax.random.key(2)))
  return spot_trainer.SpotTrainer(config, CONFIG, deployed)


def _gate(spot, step, target):
  """The step end of a replica that scored while idle (one process: its scores alone)."""
  assert spot.score(step, target, lambda: False)
  return spot.gate()


def test_a_trained_candidate_is_deployed_and_a_tie_is_not(target):
  spot = _trainer(max_epochs=1e6)                          # from scratch: 40 steps, uncapped
  spot.observe(1, _rollout(target, 1, 16))
  spot.warm_up(target)                                     # compiles; changes nothing
  before = jax.tree.map(np.asarray, spot.deployed.params)
  tie = _gate(spot, 1, target)
  assert tie["drafter/deployed"] == tie["drafter/reverted"] == 0
  assert (tie["drafter/heldout_accept_candidate"] == tie["drafter/heldout_accept_deployed"]
          == tie["drafter/heldout_accept_shipped"])
  assert not spot.sync(0)                                  # nobody trained: nothing changes

  calls = []
  report = spot.train_while_idle(1, target, lambda: len(calls.append(0) or calls) > 40)
  assert report.steps == 40 and report.discarded == 0 and report.stop_seen is not None
  assert spot.sync(report.steps)                           # one process: its own average
  # The candidate is judged on the next step's held-out windows, scored before that step's
  # training, and deployed at its end (the same task: the rollout's seed is the same).
  spot.observe(2, _rollout(target, 1, 16))
  metrics = _gate(spot, 2, target)
  assert metrics["drafter/deployed"] == 1
  assert (metrics["drafter/heldout_accept_candidate"]
          > metrics["drafter/heldout_accept_deployed"] + 0.1)
  # The shipped drafter is scored on the same windows; deployed was still the shipped one.
  assert metrics["drafter/heldout_accept_shipped"] == metrics["drafter/heldout_accept_deployed"]
  jax.tree.map(np.testing.assert_array_equal, spot.deployed.params, spot.state.params)
  # The deployed drafter is a copy: training on donates the candidate, not it.
  more = iter([False] * 5 + [True])
  spot.train_while_idle(2, target, lambda: next(more))
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(spot.deployed.params)))
  # Once a trained drafter is deployed, the shipped one is scored apart and scores as it
  # did; the candidate, which no sync has changed since its deploy, is the deployed one.
  jax.tree.map(np.testing.assert_array_equal, spot.shipped, before)
  later = _gate(spot, 2, target)
  assert later["drafter/heldout_accept_shipped"] == metrics["drafter/heldout_accept_shipped"]
  assert (later["drafter/heldout_accept_deployed"] == later["drafter/heldout_accept_candidate"]
          == metrics["drafter/heldout_accept_candidate"])
  assert later["drafter/deployed"] == later["drafter/reverted"] == 0


def test_a_stopped_score_keeps_nothing_and_the_gate_decides_nothing(target):
  spot = _trainer()
  spot.observe(1, _rollout(target, 1, 16))
  assert not spot.score(1, target, lambda: True)           # the rollout ended first
  spot.observe(2, _rollout(target, 2, 16))                 # two steps' windows: two batches
  checks = []
  assert not spot.score(2, target, lambda: len(checks.append(0) or checks) > 1)
  assert len(checks) == 2                                  # stopped before the second batch
  assert not spot.score(7, target, lambda: False)          # no held-out windows that step
  assert spot.gate() == {"drafter/deployed": 0, "drafter/reverted": 0}


def test_the_gate_takes_back_a_deployed_drafter_the_shipped_one_beats(target):
  trained = _trainer(max_epochs=1e6)
  trained.observe(1, _rollout(target, 1, 16))
  trained.train_while_idle(1, target, lambda: False)      # 10k steps cap: stop on slots
  shipped = trained.state.params                          # a good drafter to ship
  spot = spot_trainer.SpotTrainer(trained.config, CONFIG, DraftWeights(shipped))
  spot.observe(1, _rollout(target, 1, 16))
  # An earlier, unlucky deploy: a worse drafter synced (round 1) and deployed.
  worse = drafter.init_drafter_params(CONFIG, jax.random.key(5))
  spot.deployed = spot.deployed.replace(params=worse)
  spot._synced = spot._synced.replace(params=jax.tree.map(np.asarray, worse))
  spot._candidate_round = spot._deployed_round = 1
  metrics = _gate(spot, 1, target)
  assert (metrics["drafter/deployed"], metrics["drafter/reverted"]) == (0, 1)
  assert metrics["drafter/heldout_accept_shipped"] > metrics["drafter/heldout_accept_deployed"]
  assert spot.deployed.params is spot.shipped
  again = _gate(spot, 1, target)                          # shipped is deployed: it stays
  assert (again["drafter/deployed"], again["drafter/reverted"]) == (0, 0)
  assert again["drafter/heldout_accept_candidate"] == metrics["drafter/heldout_accept_deployed"]


def test_training_stops_at_the_epoch_cap_before_the_rollout_ends(target):
  spot = _trainer(max_epochs=3.0)
  spot.observe(1, _rollout(target, 1, 16))
  epoch = spot.buffer.trainable_slots(1)
  report = spot.train_while_idle(1, target, lambda: False)   # the rollout never ends
  assert report.stop_seen is None and report.steps < spot.config.max_steps
  assert 3 * epoch <= report.current_slots + report.previous_slots < 4 * epoch + 4 * 32
  with pytest.raises(UserInputError, match="--drafter_max_epochs=0"):
    _trainer(max_epochs=0)


def test_weighted_average_of_replicas():
  a = {"0": np.array([1.0, 2.0], np.float32), "1": np.array(7, np.int32), "steps": np.array(3)}
  b = {"0": np.array([5.0, 6.0], np.float32), "1": np.array(9, np.int32), "steps": np.array(1)}
  avg = spot_trainer.weighted_average([a, b], 2)
  np.testing.assert_array_equal(avg[0], np.array([2.0, 3.0], np.float32))
  assert avg[0].dtype == np.float32 and int(avg[1]) == 7      # ints: the busiest replica's
  # Every process averages the same gathered copies in the same order: the same bits.
  np.testing.assert_array_equal(avg[0], spot_trainer.weighted_average([a, b], 2)[0])
  idle = {**b, "steps": np.array(0)}
  np.testing.assert_array_equal(spot_trainer.weighted_average([a, idle], 2)[0], a["0"])
  assert spot_trainer.weighted_average([{**a, "steps": np.array(0)}, idle], 2) is None


def test_on_decay_trains_only_after_the_accept_length_drops():
  spot = _trainer(train="on_decay", decay_tolerance=0.1)
  assert not spot.wants_training(3.0)        # first measurement: the best so far
  assert not spot.wants_training(2.8)
  assert spot.wants_training(2.6)            # 2.6 < 3.0 * 0.9
  assert _trainer().wants_training(3.0)      # always


def test_bad_train_mode_is_one_line():
  with pytest.raises(UserInputError, match="--drafter_train='sometimes'"):
    spot_trainer.SpotConfig(train="sometimes")


def test_a_drafter_step_that_raises_keeps_the_last_synced_drafter(target, monkeypatch):
  spot = _trainer()
  spot.observe(1, _rollout(target, 1, 16))
  spot.train_while_idle(1, target, iter([False] * 3 + [True]).__next__)
  assert spot.sync(3)
  synced = jax.tree.map(np.array, jax.device_get(spot.state))
  real, calls = spot_trainer.online.guarded_step, []

  def fails_on_the_third(*args, **kwargs):
    calls.append(0)
    if len(calls) == 3:
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore detail")
    return real(*args, **kwargs)

  monkeypatch.setattr(spot_trainer.online, "guarded_step", fails_on_the_third)
  report = spot.train_while_idle(1, target, lambda: False)
  assert report.error == "RuntimeError: RESOURCE_EXHAUSTED: out of memory"
  assert report.steps == 0                  # the round counts as untrained in the sync
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(spot.state), synced)
  monkeypatch.setattr(spot_trainer.online, "guarded_step", real)
  again = spot.train_while_idle(1, target, iter([False] * 2 + [True]).__next__)
  assert again.error is None and again.steps == 2     # and training goes on from it


def test_idle_drafter_checkpoint_resumes_drafter_optimizer_buffer_and_watch(target, tmp_path):
  from tlt_jax.drafter.checkpoints import DrafterCheckpoints
  from tlt_jax.rl.idle_drafter import IdleDrafter

  def idle(spot):
    return IdleDrafter(spot, control=None, checkpoints=DrafterCheckpoints(str(tmp_path)))

  saved = idle(_trainer(train="on_decay"))
  saved.spot.observe(1, _rollout(target, 1, 16))
  saved.spot.train_while_idle(1, target, iter([False] * 4 + [True]).__next__)
  saved.spot.sync(4)
  saved.spot.observe(2, _rollout(target, 2, 16))
  _gate(saved.spot, 2, target)
  saved.spot.wants_training(2.5)
  saved.accept_len = 2.5
  saved.save(1)

  resumed = idle(_trainer(train="on_decay"))
  resumed.restore(1)
  for a, b in ((saved.spot.state, resumed.spot.state),
               (saved.spot.deployed.params, resumed.spot.deployed.params)):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
  assert int(resumed.spot.state.step) == 4
  assert resumed.spot.buffer.stats() == saved.spot.buffer.stats()
  assert resumed.spot.host_state() == saved.spot.host_state() and resumed.accept_len == 2.5
  # Both go on alike: the next drafter step from each gives the same state.
  for side in (saved, resumed):
    side.spot.train_while_idle(2, target, iter([False, True]).__next__)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(saved.spot.state),
               jax.device_get(resumed.spot.state))


def test_idle_metrics_of_several_rounds_combine_into_the_jobs():
  """A step's idle figures over every replica (and draw): counts and seconds add up, the
  worst stop latency counts, spans are listed in order, the loss is the mean over kept
  drafter steps; a replica that was last to finish adds only its zero seconds."""
  from tlt_jax.rl.idle_drafter import combine_rounds

  first = {"drafter/train_steps": 3, "drafter/discarded_steps": 0, "drafter/loss": 1.0,
           "drafter/idle_device_s_available": 4.0, "drafter/idle_device_s_used": 3.5,
           "drafter/preempt_latency_s": 0.2, "drafter/train_spans": [[0.0, 1.0], [1.0, 2.0]]}
  second = {**first, "drafter/train_steps": 2, "drafter/discarded_steps": 1,
            "drafter/loss": 4.0, "drafter/preempt_latency_s": 0.5,
            "drafter/train_spans": [[0.5, 1.5]]}
  last = {"drafter/idle_device_s_available": 0.0, "drafter/idle_device_s_used": 0.0}
  job = combine_rounds([first, second, last])
  assert job["drafter/train_steps"] == 5 and job["drafter/discarded_steps"] == 1
  assert job["drafter/idle_device_s_available"] == 8.0
  assert job["drafter/idle_device_s_used"] == 7.0
  assert job["drafter/preempt_latency_s"] == 0.5
  assert job["drafter/train_spans"] == [[0.0, 1.0], [1.0, 2.0], [0.5, 1.5]]
  assert job["drafter/loss"] == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
  untrained = combine_rounds([{**first, "drafter/train_steps": 0, "drafter/loss": 9.0}, last])
  assert np.isnan(untrained["drafter/loss"])
  assert combine_rounds([last]) == last


class _Threads:
  """`spot_trainer.Collective` between replicas that are threads of one process."""
  processes = 2

  def __init__(self, shared: list, barrier, index: int):
    self.shared, self.barrier, self.index = shared, barrier, index

  def allgather(self, arrays):
    self.shared[self.index] = arrays
    self.barrier.wait()
    copies = list(self.shared)
    self.barrier.wait()          # every replica has read before the next call writes
    return copies


def _replicas(target, counts, **overrides):
  """Two spot trainers joined by `_Threads`, replica i holding `counts[i]` responses of
  step 3 (hidden states in bfloat16: they travel as bytes)."""
  shared, barrier = [None, None], threading.Barrier(2, timeout=60)
  spots = [_trainer(**overrides) for _ in counts]
  for i, (spot, count) in enumerate(zip(spots, counts)):
    spot.collective = _Threads(shared, barrier, i)
    rollout = _rollout(target, 10 + i, count)
    spot.observe(3, [(p, r, h.astype(jnp.bfloat16)) for p, r, h in rollout])
  return spots


def _share(spots, step):
  """Each replica's `share_long(step)` on its own thread; their metrics."""
  metrics = [None] * len(spots)
  threads = [threading.Thread(target=lambda i=i: metrics.__setitem__(i, spots[i].share_long(step)))
             for i in range(len(spots))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return metrics


def _received(spot):
  return [s for seqs in spot.buffer._steps.values() for s in seqs if s.received]


def test_every_replica_receives_the_others_long_responses_bit_for_bit(target):
  spots = _replicas(target, (6, 12))
  sent = [spot.buffer.own_long(3, 1 << 30) for spot in spots]
  before = [spot.buffer.trainable_slots(4) for spot in spots]
  metrics = _share(spots, 3)
  assert metrics[0]["drafter/shared_sequences"] == sum(len(s["length"]) for s in sent) > 2
  assert metrics[0]["drafter/shared_sequences"] == metrics[1]["drafter/shared_sequences"]
  for i, spot in enumerate(spots):
    received = _received(spot)
    other = sent[1 - i]
    assert len(received) == len(other["length"])
    np.testing.assert_array_equal(np.concatenate([s.tokens for s in received]),
                                  other["tokens"])
    got = np.concatenate([s.hidden for s in received])
    assert got.dtype == other["hidden"].dtype
    np.testing.assert_array_equal(got.view(np.uint8), other["hidden"].view(np.uint8))
    assert spot.buffer.trainable_slots(4) > before[i]


def test_a_replica_with_nothing_long_only_receives(target):
  spots = _replicas(target, (0, 8))
  metrics = _share(spots, 3)
  assert len(_received(spots[0])) == metrics[0]["drafter/shared_sequences"] > 0
  assert not _received(spots[1])
  assert _share(_replicas(target, (0, 0)), 3) == [{"drafter/shared_sequences": 0,
                                                   "drafter/shared_bytes": 0}] * 2


def test_sharing_off_moves_nothing(target):
  spots = _replicas(target, (6, 6), share_bytes=0)
  assert _share(spots, 3) == [{}, {}]
  assert not _received(spots[0]) and not _received(spots[1])
  with pytest.raises(UserInputError, match="drafter_share_mib"):
    _trainer(share_bytes=-1)
