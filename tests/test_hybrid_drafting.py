"""Hybrid drafting (a per-row bandit over the learned drafter and model-free chains) is
lossless: greedy token identity with plain decoding for groups with compaction mid-run,
sampling keeps plain sampling's per-position marginals over 24 tokens while the rows'
picks adapt, and the pick itself follows each row's tokens per unit cost."""
import collections
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_model_free import REPO, _forward_logprobs
from tests.test_speculative import GREEDY, _model, _prompts, homogeneity_p_value
from tlt_jax.errors import UserInputError
from tlt_jax.models import transformer
from tlt_jax.rollout import hybrid
from tlt_jax.rollout.buckets import BucketSpec
from tlt_jax.rollout.engine import generate
from tlt_jax.rollout.ngram import NgramConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
from tlt_jax.rollout.strategy import SpecStrategy
from tlt_jax.rollout.weights import DraftWeights


def _hybrid_spec(**fields):
  fields = dict(dict(strategy=SpecStrategy(4, 1, 5), threshold=8, patience=2), **fields)
  return SpecConfig(kind="hybrid", ngram_config=NgramConfig(max_ngram=3),
                    hybrid=hybrid.HybridConfig(), **fields)


def _picks(live, learned_emits, ngram_emits, steps=40, short_emits=None,
           full_match=lambda step: True, memory=None):
  """Runs the per-row pick for `steps` verify steps where each row's learned drafter and
  model-free chain emit fixed token counts (the chain `short_emits` after a short match,
  on the steps where `full_match(step)` is false, for all rows or per row), starting from
  and then keeping `memory`'s batch counts: (picks [steps, B], steps per kind [B, 2])."""
  config = hybrid.HybridConfig(draft_cost=0.5)
  stats, live, picks = hybrid.init_stats(len(live), memory), jnp.array(live), []
  for step in range(steps):
    full = jnp.broadcast_to(jnp.array(full_match(step)), live.shape)
    chain_emits = jnp.where(full, jnp.array(ngram_emits), jnp.array(short_emits or ngram_emits))
    learned = hybrid.pick_learned(stats, config, 5, live, full)
    picks.append(np.asarray(learned))
    stats = hybrid.record(stats, config, learned,
                          jnp.where(learned, jnp.array(learned_emits), chain_emits), live, full)
  if memory is not None:
    memory.keep(stats)
  return np.array(picks), np.asarray(stats.steps)


def test_pick_follows_tokens_per_unit_cost():
  """Untried kinds start optimistic (ties go model-free, the cheaper), so each is tried at
  once; then a row mostly plays the kind with more tokens per unit cost, and now and then
  retries the other as its counts fade. The drafter's cost is the batch's: it runs when
  it raises the batch's tokens per unit cost, and then each row picks by tokens per step
  alone. Finished rows record nothing."""
  # Alone, 4 learned tokens a step cost more than 3 model-free ones (4 / 1.5 < 3).
  picks, steps = _picks([True], [4], [3])
  assert not picks[0, 0] and picks[1, 0] and steps[0, 1] >= 36
  # Beside a row whose drafter pays (5 tokens against 1), the same row drafts learned.
  picks, steps = _picks([True, True, False], [5, 4, 1], [1, 3, 1])
  assert not picks[0].any() and picks[1, :2].all()
  assert steps[0, 0] >= 36 and steps[1, 0] >= 30 and 1 <= steps[1, 1]
  assert steps[2].tolist() == [0, 0] and steps[:2].sum() == 80
  # A row whose drafter would pay alone (5 / 1.5 > 3) does not make a batch whose other
  # row drafts 5 model-free pay it: 10 tokens / 1.5 < 8.
  picks, steps = _picks([True, True], [1, 5], [5, 3])
  assert not picks.any() and steps[:, 1].tolist() == [40, 40]
  # Beside a paying row, a row whose chain emits 5 after a full-length match and 1 after a
  # shorter one, against its drafter's 3, drafts model-free exactly on full-match steps.
  picks, _ = _picks([True, True], [5, 3], [1, 5], steps=60, short_emits=[1, 1],
                    full_match=lambda step: step % 3 == 0)
  full = np.arange(60) % 3 == 0
  late = np.arange(60) >= 20                 # after the first tries
  assert not picks[full & late, 1].any()
  assert picks[~full & late, 1].mean() >= 0.9


def test_pick_starts_from_the_batch_rates():
  """A row's prior for an arm is the batch's rate for it: a row whose matches turn short
  does not try the short-match chain that another row has measured as worse than its
  drafter (with priors of its own it would try it at once, the arm being new to it)."""
  # Row 1 matches short from the start, row 0 from step 20; chains emit 1, drafters 4.
  picks, steps = _picks([True, True], [4, 4], [1, 1], steps=40,
                        full_match=lambda step: [step < 20, False])
  assert not picks[0].any()                  # the first step: every arm untried, a tie
  assert picks[1:].all() and steps[:, 1].tolist() == [1, 1]


def test_pick_memory_carries_the_batch_rates_to_the_next_rollout():
  """A rollout that shares a PickMemory with an earlier one starts from its batch counts:
  it does not try the drafter that the earlier one measured as worse (4 tokens at cost 1.5
  against the chain's 3), which a fresh rollout tries at its second step; once those
  counts have faded, the optimistic prior brings the drafter back for a try."""
  fresh, _ = _picks([True], [4], [3], steps=40)
  assert fresh[1, 0]
  memory = hybrid.PickMemory()
  _picks([True], [4], [3], steps=40, memory=memory)
  assert memory.steps.sum() > 10 and memory.tokens[0] > 0
  carried, _ = _picks([True], [4], [3], steps=400, memory=memory)
  first_try = int(np.argmax(carried[:, 0]))
  assert 40 < first_try and carried[:, 0].sum() <= 5, first_try
  # A SpecMemory keeps the hybrid's pick only where both sources draft.
  assert SpecMemory(SpecConfig(kind="ngram", strategy=SpecStrategy(3, 1, 4))).picks is None
  assert isinstance(SpecMemory(_hybrid_spec()).picks, hybrid.PickMemory)


def test_point_mass_then_drawn_sibling_emits_p():
  """A root with a point-mass child c tried first, then a child drawn from q (which may
  draw c too). 60000 walks: the first emitted token follows p (chi-square at
  p >= 0.001 catches a 2% total-variation shift), and both children are accepted often."""
  import jax
  from scipy.stats import chisquare

  from tlt_jax.rollout.acceptance import recursive_rejection
  vocab, n = 6, 60_000
  k_p, k_q, k_draw, k_walk = jax.random.split(jax.random.key(7), 4)
  p = jax.nn.softmax(1.5 * jax.random.normal(k_p, (vocab,)))
  q = jax.nn.softmax(1.5 * jax.random.normal(k_q, (vocab,)))
  c = jnp.argsort(-p)[1].astype(jnp.int32)            # the second most likely token
  drawn = jax.random.categorical(k_draw, jnp.log(q), shape=(n,)).astype(jnp.int32)
  tokens = jnp.stack([jnp.zeros(n, jnp.int32), jnp.full(n, c), drawn], axis=1)
  draft_probs = jnp.broadcast_to(jnp.stack([q, jnp.zeros(vocab), q]), (n, 3, vocab))
  point_mass = jnp.broadcast_to(jnp.array([False, True, False]), (n, 3))
  num_accepted, path, emitted, _, _ = recursive_rejection(
      k_walk, jnp.broadcast_to(jnp.log(p), (n, 3, vocab)), draft_probs, tokens,
      jnp.zeros((n, 3), jnp.int32), 1, 2, point_mass)
  path = np.asarray(path)[:, 1]
  assert 0.1 < np.mean(path == 1) < 0.9 and 0.05 < np.mean(path == 2) < 0.9
  observed = np.bincount(np.asarray(emitted)[:, 0], minlength=vocab)
  expected = np.asarray(p, np.float64)
  _, p_value = chisquare(observed, expected / expected.sum() * n)
  assert p_value >= 1e-3, p_value


@pytest.mark.parametrize("group_size", [4, 8], ids=["pick", "pick-G8"])
def test_hybrid_greedy_is_token_identical(group_size):
  """Groups of equal prompts of different lengths, each row with its own cap: the batch
  of 16 compacts to 8 before SD switches on and again while it runs. Per-row picks: both
  kinds draft."""
  config, params, drafter = _model(97, seed=2)
  lengths = (5, 9, 3, 12) if group_size == 4 else (7, 11)
  prompts = [p for p in _prompts(97, lengths, seed=4) for _ in range(group_size)]
  caps = [6 + 3 * i for i in range(len(prompts))]
  plain = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY,
                   eos_ids=(96,))
  # The rollout keeps its batch counts for a second rollout (checked below).
  spec = _hybrid_spec()
  memory = SpecMemory(spec)
  weights = DraftWeights(drafter)
  sd = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY, eos_ids=(96,),
                spec=spec, drafter=weights, memory=memory, chunk_steps=4)
  for a, b in zip(plain.outputs, sd.outputs):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
  scored = _forward_logprobs(params, config, prompts, [o.token_ids for o in sd.outputs])
  for output, want in zip(sd.outputs, scored):
    np.testing.assert_allclose(output.logprobs, want, atol=1e-4)
  stats = sd.stats
  buckets = stats["rollout/batch_buckets"]
  assert buckets[:2] == [16, 8] and len(buckets) >= 3   # compacted again during SD
  assert stats["spec/drafter"] == "hybrid" and stats["spec/verify_steps"] > 0
  share, accept = stats["spec/verify_share_by_drafter"], stats["spec/accept_len_by_drafter"]
  assert set(share) == set(accept) == {"learned", "ngram"}
  assert 0 < share["learned"] < 1 and abs(sum(share.values()) - 1) < 1e-9, share
  # The steps each kind won, weighted by its accept length, add up to the overall one.
  overall = share["learned"] * accept["learned"] + share["ngram"] * accept["ngram"]
  assert abs(overall - stats["spec/accept_len"]) < 1e-9
  # The group's repeated greedy text drafts well, the random drafter badly.
  assert accept["ngram"] > accept["learned"] and share["ngram"] > 0.5, (accept, share)
  assert stats["spec/context_sizes"] == {"entries": 16, "length": 128, "members": group_size}
  # Starting from the first rollout's counts, the second drafts less with the drafter the
  # first measured as worse, and is as exact.
  again = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY,
                   eos_ids=(96,), spec=spec, drafter=weights, memory=memory, chunk_steps=4)
  assert [o.token_ids for o in again.outputs] == [o.token_ids for o in plain.outputs]
  assert again.stats["spec/verify_share_by_drafter"]["learned"] < share["learned"]


def test_mixed_pool_greedy_is_token_identical():
  """One BEG-MAB pool of a hybrid chain, a model-free tree and a learned tree (each bucket
  plays its untried strategies first, so all come up): plain greedy tokens, and the steps
  split by the drafter that drafted them."""
  from tlt_jax.rollout.bandit import BanditConfig, parse_strategies
  config, params, drafter = _model(97, seed=2)
  prompts = [p for p in _prompts(97, (5, 9, 3, 12), seed=4) for _ in range(4)]
  caps = [6 + 3 * i for i in range(len(prompts))]
  plain = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY,
                   eos_ids=(96,))
  pool = parse_strategies("hybrid:3_1_4,ngram:4_2_7,learned:3_2_5")
  spec = _hybrid_spec(strategy=None, bandit=BanditConfig(pool, epsilon=0.0))
  sd = generate(params, config, prompts, max_new_tokens=caps, sampling=GREEDY, eos_ids=(96,),
                spec=spec, drafter=DraftWeights(drafter), chunk_steps=1)
  for a, b in zip(plain.outputs, sd.outputs):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
  stats = sd.stats
  assert set(stats["spec/strategy_chunks"]) == {s.name for s in pool}, stats["spec/bandit"]
  assert stats["spec/drafter"] == "learned+ngram+hybrid"
  assert 0 < stats["spec/verify_share_by_drafter"]["ngram"] < 1
  # An unnamed tree is the hybrid's, whose drafts are chains; a learned kind needs a drafter.
  with pytest.raises(UserInputError, match="3_2_5: hybrid drafting verifies chains"):
    _hybrid_spec(strategy=SpecStrategy(3, 2, 5))
  with pytest.raises(UserInputError, match="learned:3_1_4: needs a learned drafter"):
    generate(params, config, prompts[:2], max_new_tokens=2, sampling=GREEDY,
             spec=SpecConfig(kind="ngram", strategy=SpecStrategy(3, 1, 4, "learned")))
  with pytest.raises(UserInputError, match="hybrid:3_1_4: needs a learned drafter"):
    generate(params, config, prompts[:2], max_new_tokens=2, sampling=GREEDY,
             spec=SpecConfig(kind="ngram", strategy=SpecStrategy(3, 1, 4, "hybrid")))


def _tokens(params, config, spec, seed, sampling, rows, length, drafter=None):
  result = generate(params, config, [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]] * rows,
                    max_new_tokens=length, sampling=sampling, seed=seed, spec=spec,
                    drafter=drafter,
                    buckets=BucketSpec(batch_buckets=(rows,), cache_page=32),
                    group_ids=[i // 8 for i in range(rows)])
  return [o.token_ids for o in result.outputs], result.stats


def test_hybrid_sampling_matches_plain_marginals(monkeypatch):
  """Per-position marginals of 24 sampled tokens, hybrid SD vs plain, 16384 samples a side
  (chi-square homogeneity per position; 24 tests, so each at p >= 1e-4: 0.0024 family-wise).
  Power: plain sampling at T=0.75 against T=0.7 (~2% total variation per position) gives
  p < 1e-4 at 17 of 24 positions, min 5e-9. Per-row picks (from each row's own outcomes):
  the learned drafter drafts ~0.56 of the steps (1.66 tokens each), model-free ~0.44
  (1.58), from the repetitive prompt and the group's text; 1.62 overall."""
  from tlt_jax.rollout import spec_config
  monkeypatch.setattr(spec_config, "MAX_SD_THRESHOLD", 4096)   # SD on for the whole batch
  config, params, drafter = _model(6, seed=11)
  sampling = SamplingParams(temperature=0.7)
  spec = _hybrid_spec(strategy=SpecStrategy(3, 1, 4), threshold=4096, patience=0)
  weights = DraftWeights(drafter)
  length, rows = 24, 4096
  plain = [collections.Counter() for _ in range(length)]
  sd = [collections.Counter() for _ in range(length)]
  shares = []
  for seed in range(4):
    for counters, s, w, offset in ((plain, None, None, 0), (sd, spec, weights, 1000)):
      tokens, stats = _tokens(params, config, s, offset + seed, sampling, rows, length, w)
      for position, counter in enumerate(counters):
        counter.update(t[position] for t in tokens)
    shares.append(stats["spec/verify_share_by_drafter"]["learned"])
  p_values = [homogeneity_p_value(a, b) for a, b in zip(plain, sd)]
  assert min(p_values) >= 1e-4, p_values
  assert 0.1 < np.mean(shares) < 0.9, shares


def test_hybrid_bad_input_is_one_line(tmp_path):
  """SpecConfig: a hybrid needs a learned drafter's weights and chains. CLI: `--hybrid`
  without a learned drafter, and benchmarks/model_free.py's batches that split no group
  evenly or unknown variants, are one line, exit 2, before the model loads."""
  config, params, _ = _model(8)
  with pytest.raises(UserInputError, match="3_1_4: needs a learned drafter"):
    generate(params, config, [[1, 2]], max_new_tokens=2, sampling=GREEDY,
             spec=_hybrid_spec(strategy=SpecStrategy(3, 1, 4)))
  with pytest.raises(UserInputError, match="hybrid drafting verifies chains"):
    _hybrid_spec(strategy=SpecStrategy(3, 2, 5))
  with pytest.raises(UserInputError, match="memory=1"):
    hybrid.HybridConfig(memory=1.0)
  (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3]]))
  for flags, message in ((["--drafter=ngram", "--hybrid"], "--drafter=ngram is model-free"),
                         (["--hybrid"], "--hybrid needs --drafter=DIR")):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.generate", "--model=/nonexistent",
         f"--prompts_json={tmp_path / 'prompts.json'}", f"--output_json={tmp_path / 'o.json'}",
         *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr
  # The benchmark's batches must split groups evenly, its variants exist (checked before
  # the model loads).
  for flags, message in ((["--batches=3", "--group_size=8"], "--batches=3"),
                         (["--variants=hybrid,fast"], "--variants: unknown fast")):
    proc = subprocess.run([sys.executable, "benchmarks/model_free.py", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr


def test_benchmark_times_full_batch_chunks_and_pairs_goals_by_round():
  """benchmarks/model_free.py: a verify step's time comes from SD chunks that began with
  every row live and already speculating and ended with a row live (the first chunk
  starts SD; one begun after a row finished runs below the full batch; one that ends with
  none live stopped early); the goals compare variants by medians of paired ratios
  (hybrid/learned 1.25, 0.5, 1.25 -> 1.25, where a ratio of medians would say 1.0). In a
  process of its own: the benchmark's flags share names with model_free_ceiling.py's."""
  check = """
from benchmarks.model_free import full_chunk_seconds, goals
trace = lambda seconds, live: {
    "rollout/context": [(t, 0, 0, i > 0) for i, t in enumerate(seconds)],
    "rollout/live_rows": list(zip(seconds, live))}
assert full_chunk_seconds(trace([0.0, 1.0, 3.0, 5.5, 7.0, 7.5], [4, 4, 4, 3, 3, 0]),
                          4) == [2.0, 2.5]
assert full_chunk_seconds(trace([0.0, 1.0, 3.0, 3.5], [4, 4, 4, 0]), 4) == [2.0]
rounds = [{"hybrid": {"tokens_per_s": h}, "learned": {"tokens_per_s": l},
           "ngram_epoch": {"tokens_per_s": 1.0}}
          for h, l in ((1.0, 0.8), (0.5, 1.0), (1.5, 1.2))]
entry = {v: {} for v in rounds[0]}
got = goals(entry, rounds, 1.0, 4)
assert abs(got["hybrid_over_learned"] - 1.25) < 1e-9, got
assert got["hybrid_ge_best_of_learned_and_model_free"] is True
assert got["hybrid_ge_1.2x_learned"] is True
rounds[2]["ngram_epoch"]["tokens_per_s"] = rounds[0]["ngram_epoch"]["tokens_per_s"] = 2.0
assert goals(entry, rounds, 1.0, 4)["hybrid_ge_best_of_learned_and_model_free"] is False
"""
  proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr


def test_hybrid_bound_dynamic_programming():
  """research/model_free_ceiling.py's hybrid bound on rows whose acceptance is certain:
  each kind alone takes its steps; the oracle drafts with the drafter where it gains and
  with the chain where that emits as much for less (the last token has nothing to draft);
  with both uncertain, the oracle beats either alone."""
  from benchmarks.research.model_free_ceiling import rates
  n, depth = 21, 4          # steps at t = 0, 5, 10, 15 accept 4; the last (t = 20) none
  # Level j of a step at t accepted w.p. mass[t + j] (0 past the end).
  levels = lambda mass: np.stack([np.concatenate([mass, np.zeros(depth)])[j:j + n]
                                  for j in range(depth)], axis=1)
  bound = rates([(np.ones((n, depth)), levels(np.zeros(n)))], 0.2)
  assert bound["learned_tokens_per_unit"] == pytest.approx(n / (5 * 1.2))
  assert bound["ngram_tokens_per_unit"] == pytest.approx(1.0)
  assert bound["oracle_tokens_per_unit"] == pytest.approx(n / (4 * 1.2 + 1))
  bound = rates([(np.zeros((n, depth)), levels(np.ones(n)))], 0.2)
  assert bound["oracle_tokens_per_unit"] == pytest.approx(n / 5)
  assert bound["learned_tokens_per_unit"] == pytest.approx(1 / 1.2)
  halves = np.arange(n) < n // 2                      # the drafter good early, the chain late
  mixed = [(np.where(halves[:, None], 0.9, 0.1) * np.ones((n, depth)),
            levels(np.where(halves, 0.1, 0.9)))]
  bound = rates(mixed, 0.2)
  assert bound["oracle_tokens_per_unit"] > 1.2 * max(bound["learned_tokens_per_unit"],
                                                     bound["ngram_tokens_per_unit"])
  # A pick that sees the match length: where it tells the halves apart, the best rule
  # drafts model-free after the late half's long matches and nears the oracle; where it
  # tells nothing, the best rule is the better kind alone.
  told = rates(mixed, 0.2, [np.where(halves, 1, 4)])
  assert told["match_rule_ngram_at"] == [4]
  assert (1.15 * bound["learned_tokens_per_unit"] < told["match_rule_tokens_per_unit"]
          <= bound["oracle_tokens_per_unit"])
  blind = rates(mixed, 0.2, [np.full(n, 2)])
  assert blind["match_rule_tokens_per_unit"] == pytest.approx(max(
      bound["learned_tokens_per_unit"], bound["ngram_tokens_per_unit"]))
  # The drafter's q at the chain's first draft tells the halves apart where the match
  # length does not: the q rule finds the share that does, as good as the told match rule.
  q_told = rates(mixed, 0.2, [np.full(n, 2)], [np.where(halves, 0.1, 0.6)])
  assert q_told["q_rule"]["min_match"] == 2
  assert 0.1 < q_told["q_rule"]["min_q_share"] <= 0.6
  assert q_told["q_rule_over_learned"] * bound["learned_tokens_per_unit"] == pytest.approx(
      told["match_rule_tokens_per_unit"])


def test_ceiling_replays_the_ngram_chain():
  """research/model_free_ceiling.py's acceptance of ngram.py's chain along a text: the
  longest match (then the latest), its continuation cycling, accepted level by level
  while it equals the text; no match drafts nothing."""
  from benchmarks.research.model_free_ceiling import chain_accepts
  prompt = [1, 2, 3]
  sibling = [1, 2, 3, 4, 5, 6, 9]
  text = prompt + [4, 5, 7, 8, 8, 8]
  accepts, matched, drafts = chain_accepts(text, len(prompt), [sibling], max_ngram=2,
                                           depth=3)
  # t=3: "2 3" matches the sibling: drafts 4 5 6, the text has 4 5 7. t=4: "3 4" -> 5 6 9.
  # t=5: "4 5" -> 6. t=6: "5 7" and "7" occur nowhere before. t=7: "7 8" no, "8" no.
  # t=8: "8 8" no, "8" ends at 7 of its own text: 8, cycling (period 1): the text's 8.
  assert accepts.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                              [1, 0, 0]]
  assert matched.tolist() == [2, 2, 2, 0, 0, 1]
  assert drafts.tolist() == [[4, 5, 6], [5, 6, 9], [6, 9, 6], [-1] * 3, [-1] * 3, [8, 8, 8]]


def test_ceiling_chain_reads_in_step_siblings_only_up_to_the_position():
  """chain_accepts with a sibling generated beside the text: at position t the chain reads
  the sibling's first t tokens only, so its continuation past t is not drafted yet."""
  from benchmarks.research.model_free_ceiling import chain_accepts
  prompt = [1, 2]
  sibling = prompt + [3, 4, 5, 6]
  text = prompt + [7, 3, 4, 5]
  accepts, matched, drafts = chain_accepts(text, len(prompt), [], max_ngram=2, depth=2,
                                           in_step=[sibling])
  # t=2: "1 2" ends the sibling's prompt, but its 3 (position 2) is not written yet; the
  # text's own "1 2" has no continuation either: nothing. t=3: "2 7", "7": none. t=4: "7 3"
  # no, "3" -> the sibling's 4 (position 3 < 4), then 5 (position 4, not written: the chain
  # cycles). t=5: "3 4" -> 5 (position 4 < 5), then 6 (position 5, not yet): 5 cycles back
  # over the match, "4 5"'s continuation being unwritten.
  assert matched.tolist() == [0, 0, 1, 2]
  assert drafts[:2].tolist() == [[-1, -1]] * 2
  assert drafts[2, 0] == 4 and drafts[3, 0] == 5
  assert accepts[2:, 0].tolist() == [1, 1]
  finished, _, _ = chain_accepts(text, len(prompt), [sibling], max_ngram=2, depth=2)
  assert finished[0, 0] == 0 and finished[2].tolist() == [1, 1]   # 3 4 5 all read at once


def test_ceiling_arranges_samples_by_live_batch():
  """What sample i reads: one at a time, samples 0..i-1 finished; B at a time, the batches
  before its own finished and its batch's others in step; B >= G, all in step."""
  from benchmarks.research.model_free_ceiling import arrangement
  texts = [[k] for k in range(6)]
  assert arrangement(texts, 3, 1) == ([[0], [1], [2]], [])
  assert arrangement(texts, 5, 4) == ([[0], [1], [2], [3]], [[4]])
  assert arrangement(texts, 1, 4) == ([], [[0], [2], [3]])
  assert arrangement(texts, 2, 8) == ([], [[0], [1], [3], [4], [5]])


def test_ceiling_chain_levels_are_p_of_each_draft_after_the_ones_before():
  """research/model_free_ceiling.py's expected acceptance of a point-mass chain: level j
  of a step at t is accepted with the target's p of its draft after text[:t] and the
  drafts before it (a full forward pass over that sequence, here the oracle); no draft, 0.
  Two blocks, the last one short."""
  import jax

  from benchmarks.research.model_free_ceiling import chain_level_probs
  vocab, depth, temperature = 11, 3, 0.7
  config, params, _ = _model(vocab)
  text = _prompts(vocab, [14], seed=3)[0]
  starts = np.array([4, 5, 9, 13, 14])
  drafts = np.random.RandomState(1).randint(0, vocab, (len(starts), depth))
  drafts[2] = -1
  got = chain_level_probs(params, config, temperature, jnp.asarray([text]), starts, drafts,
                          block=3)
  for i, t in enumerate(starts):
    if drafts[i, 0] < 0:
      np.testing.assert_array_equal(got[i], 0.0)
      continue
    sequence = text[:t] + drafts[i, :depth - 1].tolist()
    positions = np.arange(len(sequence))[None]
    hidden = transformer.forward_packed(params, config, jnp.asarray([sequence]), positions,
                                        jnp.zeros((1, len(sequence)), jnp.int32))
    p = jax.nn.softmax(transformer.lm_logits(params, config, hidden)[0] / temperature)
    want = [float(p[t - 1 + j, drafts[i, j]]) for j in range(depth)]
    np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-6)


def test_ceiling_reads_in_step_siblings_only_up_to_the_position():
  """research/model_free_ceiling.py's bound with siblings generated beside the text: at
  position t a sibling's pairs count only once both tokens precede t; finished siblings'
  count from the start."""
  import numpy as np

  from benchmarks.research.model_free_ceiling import successor_mass
  prompt, sibling = [0, 1], [0, 1, 4, 1, 2]
  text = prompt + [2, 1, 3]
  probs = np.full((3, 5), 0.1)
  probs[:, 4] = 0.4                                   # the sibling's token is the likeliest
  in_step, seen = successor_mass(probs, text, len(prompt), [], 1, 3, [sibling])
  # t=2: "1 4" is written at position 2, with the text's own token: not yet seen. t=3:
  # nothing followed "2" before. t=4: "1" was followed by 2 (the text) and 4 (the sibling).
  # Deeper levels read the siblings as they stood at the step's start: the step at t=2
  # reaches position 4 by its own path (1 -> 2 counts), but the sibling's "1 4", written
  # at position 2, only from the step at t=3 on.
  assert seen.tolist() == [False, False, True]
  np.testing.assert_allclose(in_step, [[0.0, 0.0, 0.1], [0.0, 0.4, 0.0], [0.4, 0.0, 0.0]])
  finished, _ = successor_mass(probs, text, len(prompt), [sibling], 1, 3)
  np.testing.assert_allclose(finished[:, 0], [0.4, 0.0, 0.4])   # its "1 4" counts at t=2
  np.testing.assert_allclose(finished[0], [0.4, 0.0, 0.4])


def test_count_rules_choose_by_how_often_a_continuation_followed():
  """research/model_free_ceiling.py's counting rules, where they disagree: after "1 2",
  "3" followed twice and "5" once (latest), and after "2" alone "6" followed three times."""
  from benchmarks.research.model_free_ceiling import count_rule_drafts
  earlier = [[1, 2, 3], [1, 2, 3], [2, 6, 2, 6, 2, 6], [1, 2, 5]]
  text = [1, 2, 7, 9]
  drafts = count_rule_drafts(text, 2, earlier, max_ngram=2)
  # t=2: the longest suffix seen is "1 2": 3 (twice) over 5; the bigram "2": 6 (three
  # times); votes: 3 gets 2 x 100 + 2 x 10, 6 gets 3 x 10. t=3: "7" was never seen.
  assert drafts == {"longest_mode": [3, -1], "bigram_mode": [6, -1], "backoff_votes": [3, -1]}
