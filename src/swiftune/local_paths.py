"""Telling a local path from a Hugging Face Hub name, before anything is looked up.

A name that can only be a local path (``./data.jsonl``, ``/models/qwen``, ``~/runs/sft``,
``train.parquet``, ``runs/qwen/final``) but does not exist is a mistyped path: saying so at once
beats a Hub lookup that retries and then reports that the Hub is unreachable.
Hub ids are ``name`` or ``org/name`` (one slash, no file extension of a data or config file).

A torch-free leaf: any layer may import it.
"""

from __future__ import annotations

import os
import re

# Endings of files swiftune (or transformers) reads: a name ending in one of them is a file name,
# never a Hub repository id.
LOCAL_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".py",
                  ".safetensors", ".bin", ".gguf", ".pt")

# ``name`` or ``org/name`` as the Hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_local(name: str) -> bool:
    """Whether ``name`` can only mean a local path (see the module docstring)."""
    if name in (".", "..") or name.startswith(("./", "../", "~", "/")) or os.path.isabs(name):
        return True
    if os.sep != "/" and name.startswith(("." + os.sep, ".." + os.sep)):
        return True
    if name.lower().endswith(LOCAL_SUFFIXES):
        return True
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return any(s in name for s in separators) and not _HUB_ID.match(name)


def resolve_local_path(name: str, what: str) -> str:
    """``name`` with ``~`` expanded when it looks local; raises ``FileNotFoundError`` when it looks
    local and does not exist; returns other names (Hub ids, existing paths) unchanged.

    ``what`` names the input in the message (``"model"``, ``"--dataset"``).
    """
    if not isinstance(name, (str, os.PathLike)):
        return name
    name = os.fspath(name)
    if os.path.exists(name):
        return name
    expanded = os.path.expanduser(name)
    if expanded != name and os.path.exists(expanded):
        return expanded
    if looks_local(name):
        shown = expanded if expanded == name else f"{name} ({expanded})"
        raise FileNotFoundError(f"{what} {name!r}: file {shown} does not exist (the name is a local path, "
                                "so it is not looked up on the Hub)")
    return name
