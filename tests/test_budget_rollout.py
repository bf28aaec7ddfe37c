"""A rollout under a row budget (`generate(max_rows=...)`): it never holds more rows than
the budget, refills finished rows from the queue (whole groups), and its outputs are those
of the unbounded engine: greedy tokens identical for any budget (plain, learned SD,
model-free SD), sampled tokens from the same distribution (chi-square homogeneity)."""
import collections

import jax
import numpy as np
import pytest

from tests.test_speculative import GREEDY, _model, _prompts, homogeneity_p_value
from tlt_jax.errors import UserInputError
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout.admission import AdmissionQueue, first_wave
from tlt_jax.rollout.budget import kv_bytes_per_row, rows_within
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights

BUCKETS = BucketSpec(cache_page=16, prompt_page=8)


def test_queue_admits_whole_groups_in_order():
  queue = AdmissionQueue([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], batch=4)
  assert queue.take(2) == []                     # group 0 needs 3 rows: it waits
  assert queue.take(4) == [0, 1, 2]              # group 1 (2 rows) does not fit in the 1 left
  assert queue.take(2) == [3, 4]
  assert queue.take(3) == [5, 6, 7]              # group 2 (6 rows) never fits whole: pieces
  assert queue.waiting == 3 and queue.take(4) == [8, 9, 10] and queue.waiting == 0
  wave, rest = first_wave([5, 5, 7, 7, 9], batch=8)
  assert wave == [0, 1, 2, 3, 4] and rest.waiting == 0    # no budget: everything, in order


def test_capped_buckets_and_bytes():
  assert BucketSpec(batch_buckets=(1, 2, 4, 8, 16)).capped(6).batch_buckets == (1, 2, 4, 6)
  assert BucketSpec(batch_buckets=(1, 2, 4)).capped(64).batch_buckets == (1, 2, 4)
  with pytest.raises(UserInputError, match="--rollout_max_rows=0"):
    BucketSpec().capped(0)
  config, _, _ = _model(97)
  cache = init_cache(config, 3, 48, np.float32, per_layer=True)
  held = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
  assert 3 * kv_bytes_per_row(config, 48, np.float32) == held
  assert rows_within(1000, 100, devices=4) == 40 and rows_within(99, 100) == 0


def _check_same_greedy(config, unbounded, budgeted, max_rows):
  for a, b in zip(unbounded.outputs, budgeted.outputs):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
  stats = budgeted.stats
  assert stats["rollout/max_rows"] <= max_rows
  assert max(live for _, live in stats["rollout/live_rows"]) <= max_rows
  assert stats["rollout/peak_rows"] == max_rows and stats["rollout/admission_waves"] >= 2
  assert stats["compile/unlisted"] == []
  # Queued prompts wait until rows free up; the queue empties before the last rows finish.
  queued = [n for _, n in stats["rollout/queued"]]
  assert queued[0] > 0 and queued[-1] == 0 and queued == sorted(queued, reverse=True)
  assert stats["rollout/kv_cache_bytes"] == max_rows * kv_bytes_per_row(
      config, stats["cache_length"], np.float32)


@pytest.mark.parametrize("max_rows", [1, 5])
def test_greedy_plain_is_token_identical_for_any_budget(max_rows):
  """Groups of 3 equal prompts, per-row caps and an EOS: rows finish at scattered times,
  so admissions refill scattered rows; a budget of 1 admits the groups piece by piece."""
  config, params, _ = _model(97, kind="qwen2")
  prompts = [p for p in _prompts(97, (5, 9, 3, 12, 7), seed=1) for _ in range(3)]
  kwargs = dict(max_new_tokens=[3 + 5 * (i % 7) for i in range(len(prompts))],
                sampling=GREEDY, eos_ids=(96,), buckets=BUCKETS, chunk_steps=3)
  unbounded = generate(params, config, prompts, **kwargs)
  budgeted = generate(params, config, prompts, max_rows=max_rows, **kwargs)
  _check_same_greedy(config, unbounded, budgeted, max_rows)


@pytest.mark.parametrize("kind", ["learned", "ngram"])
def test_greedy_sd_is_token_identical_under_a_budget(kind):
  """SD switches on in the tail, once the queue is empty; the model-free drafter reads the
  siblings' text (all of it harvested, whichever rows it ran in)."""
  config, params, drafter = _model(97)
  prompts = [p for p in _prompts(97, (5, 9, 3, 12), seed=3) for _ in range(4)]
  caps = [4 + 3 * i for i in range(len(prompts))]
  kwargs = dict(max_new_tokens=caps, sampling=GREEDY, eos_ids=(96,), buckets=BUCKETS,
                chunk_steps=4)
  unbounded = generate(params, config, prompts, **kwargs)
  if kind == "learned":
    spec, weights = SpecConfig(strategy=SpecStrategy.parse("3_2_5"), threshold=4,
                               patience=2), DraftWeights(drafter)
  else:
    spec, weights = SpecConfig(kind="ngram", ngram_config=NgramConfig(max_ngram=3),
                               strategy=SpecStrategy(4, 1, 5), threshold=4,
                               patience=2), None
  budgeted = generate(params, config, prompts, max_rows=6, spec=spec, drafter=weights,
                      **kwargs)
  _check_same_greedy(config, unbounded, budgeted, 6)
  stats = budgeted.stats
  assert stats["spec/verify_steps"] > 0
  # SD came on after the last admission, when the queue was empty.
  last_admission = max(t for t, queued in stats["rollout/queued"] if queued > 0)
  assert stats["spec/on_at_s"] >= last_admission
  if kind == "ngram":
    assert stats["spec/context_sizes"]["entries"] == 16     # every prompt's text


def _token_counts(params, config, max_rows, seeds):
  counts = collections.Counter()
  for seed in seeds:
    result = generate(params, config, [[1, 2, 3]] * 256, max_new_tokens=3,
                      sampling=SamplingParams(temperature=1.0), seed=seed, eos_ids=(0,),
                      group_ids=[i // 4 for i in range(256)], max_rows=max_rows,
                      buckets=BUCKETS, chunk_steps=2)
    counts.update(tuple(o.token_ids) for o in result.outputs)
  return counts, result.stats


def test_sampling_under_a_budget_has_the_unbounded_distribution():
  """Chi-square homogeneity of the joint distribution of up to 3 tokens (an EOS ends some
  rows early, so admissions come mid-run), 2048 samples each side over a vocabulary of 6
  (~80 populated cells); a row that reused another's random draws would skew it."""
  config, params, _ = _model(6, seed=5)
  params = dict(params, lm_head=params["lm_head"] * 3.0)     # a peaked distribution
  unbounded, _ = _token_counts(params, config, None, range(8))
  budgeted, stats = _token_counts(params, config, 16, range(100, 108))
  assert stats["rollout/admission_waves"] >= 8
  p_value = homogeneity_p_value(unbounded, budgeted)
  assert p_value >= 1e-3, p_value
  # Not a constant: samples differ between rows admitted in one wave.
  assert len(budgeted) > 20


def test_generate_cli_budget(tiny_hf_dirs, tmp_path):
  """`experiments.generate --rollout_max_rows=1`: the unbounded greedy outputs; the two
  budget flags together are refused in one line."""
  from tests.test_generate_cli import PROMPTS, _run
  flags = ("--temperature=0", "--max_new_tokens=12")
  hf_dir = tiny_hf_dirs["llama"]
  rc, err, unbounded = _run(tmp_path, hf_dir, PROMPTS, *flags, name="unbounded")
  assert rc == 0, err
  rc, err, budgeted = _run(tmp_path, hf_dir, PROMPTS, *flags, "--rollout_max_rows=1",
                           name="budget")
  assert rc == 0, err
  assert [o["token_ids"] for o in budgeted["outputs"]] == [
      o["token_ids"] for o in unbounded["outputs"]]
  assert budgeted["stats"]["rollout/max_rows"] == 1
  assert budgeted["stats"]["rollout/admission_waves"] == 1
  rc, err, _ = _run(tmp_path, hf_dir, PROMPTS, *flags, "--rollout_max_rows=1",
                    "--kv_cache_memory_fraction=0.5", name="both")
  assert rc == 2 and err.strip().splitlines() == [
      "error: --rollout_max_rows=1 and --kv_cache_memory_fraction=0.5: set one of them"]
