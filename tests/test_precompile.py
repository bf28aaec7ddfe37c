"""precompile builds the whole program pool: the rollouts that follow compile nothing, even
when a bandit tries strategies it has never played and compaction skips buckets; and every
program a rollout runs is one `Rollout.programs` lists (`compile/unlisted`), with
hidden-state capture on and off.

The rollout check runs in its own Python process: tens of extra programs compiled inside
the shared pytest process preceded an XLA CPU compiler segfault later in the suite."""
import os
import subprocess
import sys

import pytest

from tlt_jax.rollout.buckets import BucketSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small cache page: rollouts of ~60 tokens cross several attention windows.
BUCKETS = BucketSpec(cache_page=16, prompt_page=8)


def test_attention_windows_cover_every_window_the_engine_picks():
  for cache_len in (16, 40, 128, 200):
    for low in (n for n in (1, 9, 17, 100) if n <= cache_len):
      want = sorted({BUCKETS.attention_window(n, cache_len) for n in range(low, cache_len + 1)})
      assert BUCKETS.attention_windows(low, cache_len) == want


def check_rollouts_after_precompile_compile_nothing(spec_kind: str,
                                                    capture_hidden: bool = False) -> None:
  """The check itself; `test_rollouts_after_precompile_compile_nothing` runs it apart.
  capture_hidden: the rollouts hand back hidden states (programs of their own)."""
  import jax
  import numpy as np

  from tlt_jax.models import drafter as drafter_lib
  from tlt_jax.models import transformer
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.rollout.bandit import BanditConfig, StrategyBandit, parse_strategies
  from tlt_jax.rollout.engine import generate, plan_rollout
  from tlt_jax.rollout.hybrid import HybridConfig
  from tlt_jax.rollout.ngram import NgramConfig
  from tlt_jax.rollout.precompile import precompile
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.spec_config import SpecConfig, SpecMemory
  from tlt_jax.rollout.weights import DraftWeights

  config = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=512)
  params = transformer.init_params(config, jax.random.key(0))
  # Distinct prompts (the plan counts the distinct prompts each prefill group runs).
  prompts_of = lambda lengths, seed: [
      np.random.RandomState(seed * 100 + i).randint(0, config.vocab_size, n).tolist()
      for i, n in enumerate(lengths)]
  spec, drafter, use_spec, pool = None, None, spec_kind != "none", "2_1_3,3_2_5"
  model_free = {}
  if spec_kind in ("ngram", "hybrid", "mixed"):
    # Groups of 3 rows, two with an earlier response: the draft context's shapes key the
    # programs too.
    model_free = dict(group_ids=[i // 3 for i in range(9)],
                      draft_context=[[1, 2, 3]] * 2 + [[]] * 7)
  if spec_kind == "ngram":
    # One strategy: the bandit's programs are the learned case's.
    pool = "3_1_4"
    spec = SpecConfig(kind="ngram", ngram_config=NgramConfig(),
                      strategy=parse_strategies(pool)[0], threshold=4, patience=1)
  elif spec_kind == "hybrid":
    # One chain (a hybrid's two drafts share one verify shape): the bandit's programs are
    # the learned case's.
    pool = "3_1_4"
    spec = SpecConfig(kind="hybrid", ngram_config=NgramConfig(), hybrid=HybridConfig(),
                      strategy=parse_strategies(pool)[0], threshold=4, patience=1)
    drafter = DraftWeights(drafter_lib.init_drafter_params(config, jax.random.key(1)))
  elif spec_kind == "mixed":
    # A pool mixing drafter kinds, a learned tree among model-free and hybrid chains: every
    # strategy drafts with both sources in step (`HybridDrafter`), each its own kind.
    pool = "learned:3_2_5,ngram:3_1_4,hybrid:3_1_4"
    spec = SpecConfig(bandit=BanditConfig(parse_strategies(pool), epsilon=1.0, seed=3),
                      threshold=4, patience=1)
    drafter = DraftWeights(drafter_lib.init_drafter_params(config, jax.random.key(1)))
  elif use_spec:
    # epsilon=1: each chunk plays a random strategy, so every one of them comes up.
    spec = SpecConfig(bandit=BanditConfig(parse_strategies(pool), epsilon=1.0, seed=3),
                      threshold=4, patience=1)
    drafter = DraftWeights(drafter_lib.init_drafter_params(config, jax.random.key(1)))
  # "budget": the learned pool with at most 4 rows at once, the rest admitted into rows
  # that finish (the admission programs are listed and built too).
  max_rows = 4 if spec_kind == "budget" else None
  kwargs = dict(max_new_tokens=[60, 5, 40, 9, 2, 33, 12, 60, 20],
                sampling=SamplingParams(temperature=0.0), eos_ids=(7,), buckets=BUCKETS,
                chunk_steps=3, spec=spec, drafter=drafter, capture_hidden=capture_hidden,
                max_rows=max_rows, **model_free)
  # What SD learns (the bandit's rewards) carries over the rollouts below, as in a run.
  memory = None if spec is None else SpecMemory(spec)
  prompts = prompts_of((5, 9, 3, 12, 7, 4, 6, 8, 10), seed=0)
  assert precompile(params, config, prompts, **kwargs) > 0
  if memory is not None and memory.bandit is not None:
    assert memory.bandit.summary() == StrategyBandit(spec.bandit).summary()  # untouched
  assert precompile(params, config, prompts, **kwargs) == 0
  buckets = BUCKETS.capped(max_rows)
  plan = plan_rollout(prompts, kwargs["max_new_tokens"], config, buckets, spec, (7,))
  strategies_played = set()
  for seed in range(3):
    # Other prompts with the same plan: the longest (12) still pads to 16, and the longest
    # row (prompt + cap) is still 8 + 60 tokens.
    lengths = np.random.RandomState(seed).randint(1, 9, 9)
    lengths[3], lengths[7] = 12, 8
    others = prompts_of(lengths, seed=10 + seed)
    assert plan_rollout(others, kwargs["max_new_tokens"], config, buckets, spec, (7,)) == plan
    result = generate(params, config, others, seed=seed, memory=memory, **kwargs)
    assert result.stats["compile/new_programs"] == 0, (seed, result.stats)
    # Every program the rollout ran is one `Rollout.programs` lists (so precompile built it).
    assert result.stats["compile/unlisted"] == [], (seed, result.stats["compile/unlisted"])
    assert len(result.stats["rollout/batch_buckets"]) >= 2       # compaction happened
    assert all((out.hidden_states is not None) == capture_hidden for out in result.outputs)
    if max_rows:
      assert result.stats["rollout/admission_waves"] >= 2
    if use_spec:
      assert result.stats["spec/verify_steps"] > 0
      strategies_played.update(result.stats["spec/strategy_chunks"])
  if use_spec:
    assert strategies_played == set(pool.split(","))


# Hidden states are captured for the online drafter, which needs a learned one: capture is
# checked with the kinds a run can pair it with (no SD, learned, mixed pools).
@pytest.mark.parametrize("spec_kind,capture_hidden", [
    ("none", False), ("learned", False), ("ngram", False), ("hybrid", False), ("mixed", False),
    ("budget", False), ("none", True), ("learned", True), ("mixed", True), ("budget", True)])
def test_rollouts_after_precompile_compile_nothing(spec_kind, capture_hidden):
  code = ("from tests.test_precompile import check_rollouts_after_precompile_compile_nothing "
          f"as check; check({spec_kind!r}, {capture_hidden!r})")
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
