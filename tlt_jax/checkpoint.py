"""The model checkpoint names at their old place: the module is `tlt_jax.models.checkpoint`
(a model format beside hf.py and gguf.py, which `models.loading` reads). Kept for the
importers that still name this one; new code imports the models' module."""
from tlt_jax.models.checkpoint import (CONFIG, PARAMS, TOKENIZER_FILES, check_tree_shapes,
                                       find_tokenizer_files, is_model_checkpoint,
                                       load_model_checkpoint, read_tree_metadata,
                                       restore_tree, save_model_checkpoint, save_tree)

__all__ = ["CONFIG", "PARAMS", "TOKENIZER_FILES", "check_tree_shapes", "find_tokenizer_files",
           "is_model_checkpoint", "load_model_checkpoint", "read_tree_metadata", "restore_tree",
           "save_model_checkpoint", "save_tree"]
