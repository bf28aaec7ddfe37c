"""Text <-> token ids and chat prompts, backed by a transformers fast tokenizer.

Going through transformers (local files only) keeps tokenization and chat templates
identical to what the HF oracle sees, including tokenizers rebuilt from GGUF metadata.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any, Sequence

from tlt_jax.errors import UserInputError
from tlt_jax.files import atomic_dir, user_cache_dir
from tlt_jax.models.gguf import CHAT_END_TOKENS, open_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Where tokenizers rebuilt from GGUF metadata are kept (empty: nowhere), like JAX's
# JAX_COMPILATION_CACHE_DIR; default: files.user_cache_dir("tokenizers").
CACHE_ENV = "TLT_JAX_TOKENIZER_CACHE"


def has_tokenizer_files(model_dir: str) -> bool:
  return any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES)


class Tokenizer:
  """One tokenizer for prompts and rewards; plain lists of ids in and out."""

  def __init__(self, hf_tokenizer: Any, source: str, extra_eos_ids: Sequence[int] = ()):
    self._hf = hf_tokenizer
    self.source = source
    vocab = hf_tokenizer.get_vocab()
    eos = [hf_tokenizer.eos_token_id, *extra_eos_ids]
    eos += [vocab[t] for t in CHAT_END_TOKENS if t in vocab]
    self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
    self.bos_token_id: int | None = hf_tokenizer.bos_token_id
    # Padding is always masked out, so any real id will do when the tokenizer names none.
    pad = hf_tokenizer.pad_token_id
    self.pad_token_id: int = pad if pad is not None else (self.eos_token_ids or (0,))[0]
    # Ids the tokenizer can emit; a model's embedding table may be padded beyond this.
    self.vocab_size: int = len(hf_tokenizer)

  # ---- constructors ----------------------------------------------------------------

  @classmethod
  def from_dir(cls, model_dir: str, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
    """From tokenizer.json + tokenizer_config.json (an HF dir or a converted checkpoint)."""
    if not has_tokenizer_files(model_dir):
      raise UserInputError(f"{model_dir}: no tokenizer.json / tokenizer_config.json")
    return cls(_hf_tokenizer(model_dir), model_dir, extra_eos_ids)

  @classmethod
  def from_gguf(cls, path: str, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
    """Rebuilt from the GGUF metadata (vocab, merges, special ids, chat template).

    transformers' rebuild takes seconds, so its result is saved once per machine (see
    CACHE_ENV), keyed by the file's metadata bytes and the transformers version, and read
    back from there next time."""
    reader = open_gguf(path)  # one-line errors for a missing file or a non-GGUF
    import transformers
    path = os.path.abspath(path)
    key = hashlib.sha256(reader.data[:reader.data_offset].tobytes())
    key.update(transformers.__version__.encode())
    cache = os.environ.get(CACHE_ENV, user_cache_dir("tokenizers"))
    entry = os.path.join(cache, key.hexdigest()[:32]) if cache else None
    if entry and has_tokenizer_files(entry):
      return cls(_hf_tokenizer(entry), path, extra_eos_ids)
    tokenizer = cls(_hf_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path)),
                    path, extra_eos_ids)
    if entry:
      _save_to_cache(tokenizer, entry)
    return tokenizer

  def save(self, out_dir: str) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inside) for `from_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    self._hf.save_pretrained(out_dir, save_jinja_files=False)

  # ---- text ------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """Ids of `text` as is: no BOS/EOS added; special-token strings in it map to their ids."""
    return self._hf.encode(text, add_special_tokens=False)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat template's text, e.g. for logging the exact prompt."""
    if not self._hf.chat_template:
      raise UserInputError(f"{self.source}: tokenizer has no chat_template")
    return self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=False)

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids; the template writes its own special tokens, so none are added."""
    return self.encode(self.render_chat(messages, add_generation_prompt))

  def chat_prompt(self, question: str) -> list[int]:
    """A single user turn ready for the assistant's answer."""
    return self.apply_chat_template([{"role": "user", "content": question}])


def _hf_tokenizer(model_dir: str, gguf_file: str | None = None):
  """transformers' fast tokenizer from a dir's tokenizer files, or from the GGUF file
  `gguf_file` in it."""
  from transformers import AutoTokenizer
  where = os.path.join(model_dir, gguf_file or "")
  try:
    return AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file, local_files_only=True)
  except (OSError, ValueError, KeyError) as e:
    what = "build a tokenizer from GGUF metadata" if gguf_file else "load tokenizer"
    raise UserInputError(f"{where.rstrip('/')}: cannot {what} ({e})") from None


def _save_to_cache(tokenizer: Tokenizer, entry: str) -> None:
  """`entry` written whole (`Tokenizer.save`) or not at all; a cache that cannot be written
  costs the next run the rebuild, and says so, but never fails this one."""
  try:
    with atomic_dir(entry, overwrite=True) as tmp:
      tokenizer.save(tmp)
  except OSError as e:
    if not has_tokenizer_files(entry):   # else another process wrote it first
      warnings.warn(f"{entry}: tokenizer not cached ({e})")
