"""GGUF tokenizers, converted once per node and then read back in a fraction of a second.

transformers rebuilds a GGUF file's fast tokenizer and chat template from its metadata, which
takes seconds of pure Python per process (SmolLM2: ~9 s of CPU, where reading the saved
tokenizer takes ~0.25 s), and both the API server and the engine core need it. The converted
tokenizer is saved under the start-up cache (``<cache>/tokenizers/<key>/``, the folder the
operator mounts per node), keyed by the file's path, size and modification time and the
tokenizer libraries' versions, so a changed file or library converts again.

Writes go to a temporary folder renamed into place, so engines starting together never read a
half-written entry; an unreadable entry is converted again; an unwritable cache only costs time.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal_engine.kernels.compile_cache import cache_root, file_cache_key

logger = logging.getLogger(__name__)

SAVED_MARKER = "tokenizer_config.json"  # save_pretrained writes it last of the files we read


def tokenizer_cache_key(gguf_path: Path) -> str:
    import tokenizers
    import transformers

    return file_cache_key(gguf_path, {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__})


def cached_gguf_tokenizer(gguf_path: Path, convert: Callable[[], Any], cache_dir: str | Path | None = None) -> Any:
    """The tokenizer of ``gguf_path``: read from the cache, or made by ``convert()`` and saved."""
    from transformers import AutoTokenizer

    root = cache_root(cache_dir) / "tokenizers"
    entry = root / tokenizer_cache_key(gguf_path)
    if (entry / SAVED_MARKER).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception as exc:  # a damaged entry: convert again below and replace it
            logger.warning("ignoring the cached tokenizer %s (%s: %s)", entry, type(exc).__name__, exc)
    tokenizer = convert()
    try:
        save_entry(tokenizer, entry)
    except OSError as exc:
        logger.info("the tokenizer of %s is not cached: %s", gguf_path, exc)
    return tokenizer


def save_entry(tokenizer: Any, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        if entry.exists():  # a damaged entry, or another engine's: the newest complete one wins
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(staging, entry)
    except OSError:
        if entry.is_dir() and (entry / SAVED_MARKER).is_file():
            return  # another engine renamed its copy into place first
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
