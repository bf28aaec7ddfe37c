"""The rollout hands back the target's hidden state of every position it ran (plain decode
and SD verify steps, through compaction), equal to a plain forward over the final sequence,
and capturing changes no token and no log-prob."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rl.rollout import RolloutSettings, concat_rollouts, sample_groups
from tlt_jax.rollout.bandit import BanditConfig, parse_strategies
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.hybrid import HybridConfig
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
from tlt_jax.rollout.weights import DraftWeights

# A vocabulary of 4: even a random drafter is often right, so verify steps accept drafts
# (the rows they record are the accepted path's, not only its root).
CONFIG = ModelConfig(model_type="llama", vocab_size=4, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=256)
PARAMS = transformer.init_params(CONFIG, jax.random.key(0))
DRAFTER = DraftWeights(drafter_lib.init_drafter_params(CONFIG, jax.random.key(4)))
PROMPTS = [np.random.RandomState(i).randint(0, 4, n).tolist()
           for i, n in enumerate((5, 9, 3, 12, 7))]
# Rows finish at their caps at different times: the batch of five (bucket 8) is compacted
# to 4 rows, then 1; SD switches on at 4 live rows, and a row can reach its cap inside an
# accepted path (its cache then runs past its last recorded position).
CAPS = [30, 6, 21, 13, 3]
BUCKETS = BucketSpec(batch_buckets=(1, 4, 8), cache_page=16, prompt_page=8)
SEQUENCE_LEN = 48   # the reference forward's padded length (the rollout's cache length)
NGRAM = NgramConfig(max_ngram=3)


# Each drafter as strategies; with several, a bandit that plays a random one per chunk
# (epsilon 1). "learned": a chain and a tree of the learned drafter alone; "ngram": the
# model-free drafter alone; "mixed": every kind in one pool (the learned tree, the
# model-free chain, the hybrid's per-row pick), each drafting through `HybridDrafter`.
# The drafter and bandit seeds are ones under which every strategy plays and drafts are
# accepted, greedy and sampled.
POOLS = {"learned": "3_1_4,3_2_5", "ngram": "ngram:3_1_4",
         "mixed": "learned:3_2_5,ngram:3_1_4,hybrid:3_1_4"}


def _spec(kind: str) -> SpecConfig | None:
  if kind == "plain":
    return None
  strategies = parse_strategies(POOLS[kind])
  schedule = dict(threshold=4, patience=1, ngram_config=NGRAM, hybrid=HybridConfig())
  if len(strategies) == 1:
    return SpecConfig(strategy=strategies[0], **schedule)
  return SpecConfig(bandit=BanditConfig(strategies, epsilon=1.0, seed=2), **schedule)


def _memory(spec: SpecConfig | None) -> SpecMemory | None:
  """SD memory whose bandit has scored every strategy at every live batch SD runs at: with
  epsilon 1 its picks then follow its seed alone, not which chunks compiled (a chunk that
  compiles scores nothing), so the rollouts with and without capture play alike."""
  if spec is None:
    return None
  memory = SpecMemory(spec)
  if memory.bandit is not None:
    for live_rows in range(1, spec.threshold + 1):
      for strategy in spec.strategies:
        memory.bandit.record(live_rows, strategy, 1.0)
  return memory


@jax.jit
def _plain_forward_hidden(sequences: jax.Array) -> jax.Array:
  """The target's post-norm hidden states [B, T, E] of right-padded sequences [B, T] (the
  padding comes after every real token, so it changes none of theirs), in one pass."""
  b, t = sequences.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, _ = transformer.forward(PARAMS, CONFIG, sequences, positions,
                                  init_cache(CONFIG, b, t), attention_impl="reference")
  return hidden


def _padded(sequences: list[list[int]]) -> jax.Array:
  out = np.zeros((len(sequences), SEQUENCE_LEN), np.int32)
  for row, sequence in zip(out, sequences):
    row[:len(sequence)] = sequence
  return jnp.asarray(out)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["plain", "learned", "ngram", "mixed"])
def test_captured_hidden_states_match_a_plain_forward(kind, temperature):
  spec = _spec(kind)
  kwargs = dict(max_new_tokens=CAPS, sampling=SamplingParams(temperature=temperature),
                seed=5, buckets=BUCKETS, chunk_steps=2, spec=spec,
                drafter=DRAFTER if spec is not None and spec.learned else None)
  captured = generate(PARAMS, CONFIG, PROMPTS, capture_hidden=True, memory=_memory(spec),
                      **kwargs)
  without = generate(PARAMS, CONFIG, PROMPTS, memory=_memory(spec), **kwargs)
  stats = captured.stats
  assert stats["rollout/batch_buckets"] == [8, 4, 1]
  if spec is not None:
    # Every strategy played, and drafts were accepted: recorded paths are longer than
    # their root.
    assert set(stats["spec/strategy_chunks"]) == set(POOLS[kind].split(",")), stats
    assert min(stats["spec/accept_len_by_drafter"].values()) > 1.2, stats
  sequences = [prompt + out.token_ids for prompt, out in zip(PROMPTS, captured.outputs)]
  assert max(map(len, sequences)) <= SEQUENCE_LEN
  reference = np.asarray(_plain_forward_hidden(_padded(sequences)))
  for sequence, reference_row, got, want in zip(sequences, reference, captured.outputs,
                                                without.outputs):
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert want.hidden_states is None
    assert got.hidden_states.shape == (len(sequence) - 1, CONFIG.hidden_size)
    assert got.hidden_states.dtype == np.float32
    np.testing.assert_allclose(got.hidden_states, reference_row[:len(sequence) - 1],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["plain", "learned"])
def test_budgeted_capture_equals_unbounded_capture(kind):
  """Under a budget of 2 rows the prompts wait and are admitted into rows that finished
  (whose record held another prompt's states): every row's hidden states are still the
  unbounded rollout's (float32, greedy), admission prefills recording them as prefill
  does."""
  spec = _spec(kind)
  kwargs = dict(max_new_tokens=CAPS, sampling=SamplingParams(temperature=0.0),
                buckets=BUCKETS, chunk_steps=2, spec=spec, capture_hidden=True,
                drafter=DRAFTER if spec is not None else None)
  unbounded = generate(PARAMS, CONFIG, PROMPTS, memory=_memory(spec), **kwargs)
  budgeted = generate(PARAMS, CONFIG, PROMPTS, max_rows=2, memory=_memory(spec), **kwargs)
  assert budgeted.stats["rollout/peak_rows"] == 2
  assert budgeted.stats["rollout/admission_waves"] >= 2
  assert budgeted.stats["compile/unlisted"] == []
  if spec is not None:
    assert budgeted.stats["spec/verify_steps"] > 0
  for prompt, got, want in zip(PROMPTS, budgeted.outputs, unbounded.outputs):
    assert got.token_ids == want.token_ids
    assert got.hidden_states.shape == (len(prompt) + len(got.token_ids) - 1,
                                       CONFIG.hidden_size)
    np.testing.assert_allclose(got.hidden_states, want.hidden_states, atol=1e-4, rtol=0)


def test_group_rollouts_carry_each_rows_hidden_states():
  """The RL rollout stage hands the states on per row, and its group selections keep them
  with their rows."""
  settings = RolloutSettings(group_size=2, max_new_tokens=4,
                             sampling=SamplingParams(temperature=1.0), eos_ids=(),
                             buckets=BUCKETS, capture_hidden=True)
  groups = sample_groups(PARAMS, CONFIG, PROMPTS[:2], settings, seed=0)
  assert [h.shape for h in groups.hidden_states] == [
      (len(p) + len(r) - 1, CONFIG.hidden_size) for p, r in zip(groups.prompts,
                                                                  groups.responses)]
  swapped = concat_rollouts([groups.select_groups([1], 2), groups.select_groups([0], 2)])
  assert swapped.prompts == groups.prompts[2:] + groups.prompts[:2]
  moved = groups.hidden_states[2:] + groups.hidden_states[:2]
  for got, want in zip(swapped.hidden_states, moved):
    np.testing.assert_array_equal(got, want)
