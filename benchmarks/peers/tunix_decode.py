"""Tunix's sampler side of benchmarks/decode.py (runs in its own venv with google-tunix).

  python benchmarks/peers/tunix_decode.py --model_dir=DIR --prompts=FILE --new_tokens=N

Loads the HF checkpoint as Tunix's llama3 model (tunix_grpo.llama_models) and its vanilla
`Sampler`, then serves decode.py over stdin/stdout so the two alternate run by run: it
prints `READY`, and for every line `NAME` it reads, greedily decodes the prompt batch NAME
of the --prompts JSON ({name: [[token ids]]}) for --new_tokens tokens, EOS never stopping
it, and prints one JSON line (wall_s, tokens_per_s, tokens). The prompts go in as token
ids (a `tokenize` that parses them), so both sides decode the same ids; every row's
prompt has the same length, so Tunix pads nothing. The first call per batch compiles.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.peers.tunix_grpo import llama_models  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model_dir", required=True)
  p.add_argument("--prompts", required=True)
  p.add_argument("--new_tokens", type=int, required=True)
  args = p.parse_args()
  import jax
  import numpy as np
  import transformers
  from tunix.generate import sampler as sampler_lib

  with open(args.prompts) as f:
    batches = json.load(f)
  (model,), config, _ = llama_models(args.model_dir, 1)
  longest = max(len(row) for rows in batches.values() for row in rows)
  cache = sampler_lib.CacheConfig(cache_size=longest + args.new_tokens + 1,
                                  num_layers=config.num_layers,
                                  num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)

  class TokenIdSampler(sampler_lib.Sampler):
    def tokenize(self, input_string):
      return np.array(json.loads(input_string), np.int32)

  sampler = TokenIdSampler(model, transformers.AutoTokenizer.from_pretrained(args.model_dir),
                           cache)
  print("READY", flush=True)
  for line in sys.stdin:
    rows = batches[line.strip()]
    start = time.perf_counter()
    out = sampler([json.dumps(row) for row in rows], max_generation_steps=args.new_tokens,
                  max_prompt_length=len(rows[0]), eos_tokens=[-1])  # greedy: no top_p
    tokens = [np.asarray(jax.device_get(t)).tolist() for t in out.tokens]
    wall = time.perf_counter() - start
    print(json.dumps({"wall_s": wall, "tokens_per_s": len(rows) * args.new_tokens / wall,
                      "lengths": [len(t) for t in tokens], "tokens": tokens}), flush=True)


if __name__ == "__main__":
  main()
