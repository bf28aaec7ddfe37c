"""The deploy gate and the decay watch: a trained drafter beats an untrained one on held-out
windows, a tie deploys nothing, and training waits until the accept length decays."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import optim
from tlt_jax.data import packing
from tlt_jax.drafter import gate, trainer
from tlt_jax.models import drafter, transformer
from tlt_jax.models.config import ModelConfig

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=128, tie_word_embeddings=True)


def test_expected_accept_length_is_the_chains_survival():
  assert gate.expected_accept_length([0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
  assert gate.expected_accept_length([1.0, 0.0, 1.0]) == pytest.approx(1.0)
  metrics = {"top1_acc": 0.9, "top1_acc_pass2": 0.6, "sampled_accept": 0.7,
             "sampled_accept_pass2": 0.4}
  assert gate.level_rates(metrics, greedy=True, depth=2) == [0.9, 0.6]
  assert gate.level_rates(metrics, greedy=False, depth=2) == [0.7, 0.4]


def _windows(seed: int, count: int) -> packing.PackedRows:
  """Samples repeating one short pattern: a drafter can learn them from a few steps."""
  rng = np.random.default_rng(seed)
  pattern = rng.integers(3, CONFIG.vocab_size, 5).tolist()
  samples = []
  for _ in range(count):
    prompt = rng.integers(3, CONFIG.vocab_size, 4).tolist()
    samples.append((prompt + pattern * 4, len(prompt)))
  return packing.pack_samples(samples, seq_len=48)


def test_the_gate_deploys_a_trained_drafter_and_not_a_tie():
  target = transformer.init_params(CONFIG, jax.random.key(0))
  train_rows, heldout_rows = _windows(1, 8), _windows(1, 10)
  heldout = [(heldout_rows, trainer.target_hidden(target, heldout_rows, config=CONFIG))]
  optimizer = optim.make_optimizer(3e-3, total_steps=40, warmup_steps=2)
  deployed = drafter.init_drafter_params(CONFIG, jax.random.key(2))
  # train_step donates its state: the deployed drafter keeps arrays of its own.
  state = trainer.init_train_state(jax.tree.map(jnp.copy, deployed), optimizer)
  for _ in range(40):
    state, _ = trainer.train_step(state, target, train_rows, config=CONFIG,
                                  optimizer=optimizer, unroll=2)
  score = lambda params, greedy: gate.heldout_accept(params, target, heldout, None,
                                                     config=CONFIG, greedy=greedy, depth=2)
  for greedy in (True, False):
    before, after = score(deployed, greedy), score(state.params, greedy)
    assert 0.0 <= before < after <= 2.0
    assert gate.DeployGate().deploys(before, after)
    assert not gate.DeployGate().deploys(after, after)          # a tie keeps the deployed
    assert not gate.DeployGate(margin=after / before).deploys(before, after)


def test_the_gate_deploys_the_best_of_candidate_deployed_and_shipped():
  choose = gate.DeployGate().choose
  assert choose(deployed=0.8, candidate=0.9, shipped=0.85) == "candidate"
  assert choose(deployed=0.8, candidate=0.84, shipped=0.85) == "shipped"
  assert choose(deployed=0.8, candidate=0.85, shipped=0.85) == "shipped"   # ties stay put
  assert choose(deployed=0.85, candidate=0.85, shipped=0.8) is None
  assert gate.DeployGate(margin=0.1).choose(0.8, 0.87, 0.85) is None


def test_heldout_without_response_slots_is_an_error():
  target = transformer.init_params(CONFIG, jax.random.key(0))
  rows = _windows(3, 2)
  rows = rows.replace(loss_mask=np.zeros_like(rows.loss_mask))
  with pytest.raises(ValueError, match="no response slot"):
    gate.heldout_accept(drafter.init_drafter_params(CONFIG, jax.random.key(1)), target,
                        [(rows, None)], None, config=CONFIG, greedy=True, depth=1)


def test_decay_watch_waits_for_a_drop_from_the_best():
  watch = gate.DecayWatch(tolerance=0.1)
  assert not watch.decayed(1.0)                  # nothing measured yet: no evidence of decay
  for accept in (2.0, 2.5, 2.4):
    watch.observe(accept)
  assert not watch.decayed(2.3) and watch.decayed(2.2)
  restored = gate.DecayWatch(tolerance=0.1)
  restored.load_state_dict(watch.state_dict())
  assert restored.best == 2.5 and restored.decayed(2.2)
  watch.deployed_new()
  assert not watch.decayed(0.5)
