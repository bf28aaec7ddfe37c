"""precompile enumerates attention windows exactly as the engine picks them. (The end-to-end
check, a rollout after `--precompile` compiling nothing, runs in its own process in
tests/test_generate_sd_cli.py: tens of extra programs compiled inside the shared pytest
process preceded an XLA CPU compiler segfault later in the suite.)"""
from tlt_jax.rollout.buckets import BucketSpec

BUCKETS = BucketSpec(cache_page=16, prompt_page=8)


def test_attention_windows_cover_every_window_the_engine_picks():
  for cache_len in (16, 40, 128, 200):
    for low in (n for n in (1, 9, 17, 100) if n <= cache_len):
      want = sorted({BUCKETS.attention_window(n, cache_len) for n in range(low, cache_len + 1)})
      assert BUCKETS.attention_windows(low, cache_len) == want
