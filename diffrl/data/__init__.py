"""The field's prompt sets: a registry pinned to public sources (registry.py), fetched and
verified at run time (store.py), by name in a config (``data.train_prompts: geneval/train``),
and the ``diffrl-data`` command (cli.py). docs/DATA.md describes them."""

from diffrl.data.registry import SETS, PromptSet, UnknownPromptSet, get, is_set_name
from diffrl.data.store import PromptSetError, data_dir, fetch, local_files

__all__ = [
    "SETS",
    "PromptSet",
    "PromptSetError",
    "UnknownPromptSet",
    "data_dir",
    "fetch",
    "get",
    "is_set_name",
    "local_files",
]
