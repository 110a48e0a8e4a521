"""The on-disk start-up cache: Triton's compiled kernels and the one-row-linear choices.

A second engine on the same node (the operator mounts one cache volume per node) skips
Triton's compiles and the GEMV timing. Everything lives under one folder (``--cache-dir``,
default ``$TIDAL_CACHE_DIR`` or ``~/.cache/tidal``):

- ``triton/``: Triton's own cache (``TRITON_CACHE_DIR``, unless the environment sets it);
- ``gemv/<key>.json``: the one-row-linear choices, one file per GPU model and software
  versions (``gemv_cache_key``), keyed inside by weight shape, dtype and bias.
- ``tokenizers/<key>/``: GGUF files' converted tokenizers (models/tokenizer_cache.py);
- ``gguf/<key>.json``: GGUF files' indexes, their metadata and tensor offsets without a parse
  (models/gguf_index.py).

Writes are atomic (a temporary file renamed into place), so Pods sharing a volume never
read a half-written file; an unreadable file is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE_DIR") or Path.home() / ".cache" / "tidal").expanduser()


def cache_root(cache_dir: str | Path | None) -> Path:
    """The start-up cache folder: ``cache_dir`` (--cache-dir) or the default."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def file_cache_key(path: Path, versions: dict[str, Any]) -> str:
    """An entry name for what is derived from the file ``path``: its stem and a hash of its
    resolved path, size, modification time and the ``versions`` the derivation depends on, so a
    changed file or library gets a new entry."""
    stat = path.stat()
    identity = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **versions}
    return f"{path.stem}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]}"


def use_cache_dir(cache_dir: str | Path | None) -> Path:
    """Point Triton's compile cache into ``cache_dir`` (the environment's own setting wins)
    before anything compiles; returns the folder."""
    root = cache_root(cache_dir)
    triton_dir = root / "triton"
    try:  # Triton fails its compiles on a folder it cannot write (a root-owned hostPath)
        triton_dir.mkdir(parents=True, exist_ok=True)
        writable = os.access(triton_dir, os.W_OK)
    except OSError:
        writable = False
    if writable:
        os.environ.setdefault("TRITON_CACHE_DIR", str(triton_dir))
    else:
        logger.warning("the start-up cache %s is not writable: Triton keeps its default cache", root)
    return root


def triton_cache_filled() -> bool:
    """Whether Triton's cache folder (``TRITON_CACHE_DIR``, else its default) holds anything:
    an engine started on this node before, so its kernels load instead of compiling."""
    folder = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def gemv_cache_key(gpu_name: str, versions: dict[str, str]) -> str:
    """A file name for one GPU model and the versions its timings depend on."""
    text = json.dumps({"gpu": gpu_name, **versions}, sort_keys=True)
    slug = "".join(c if c.isalnum() else "-" for c in gpu_name).strip("-").lower() or "gpu"
    return f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def shape_key(n: int, k: int, dtype: Any, bias: bool) -> str:
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}:{'bias' if bias else 'nobias'}"


def encode_choice(choice: Any) -> dict[str, Any] | None:
    """A GemvConfig as JSON (None: cuBLAS); a pipelined one (FP8's) adds its ``num_stages``, a
    split-K one (INT4's tensor-core and packed-halves GEMVs) its ``split_k``, one that names its
    kernel (INT4's packed-halves GEMV, whose tiles are the by-groups kernel's) that ``kernel``."""
    if choice is None:
        return None
    data: dict[str, Any] = {"block_n": int(choice.block_n), "block_k": int(choice.block_k),
                            "num_warps": int(choice.num_warps)}
    kernel = getattr(choice, "kernel", None)
    if kernel is not None:
        data["kernel"] = str(kernel)
    stages = int(getattr(choice, "num_stages", 1))
    if stages != 1:
        data["num_stages"] = stages
    split = int(getattr(choice, "split_k", 1))
    if split != 1:
        data["split_k"] = split
    return data


def decode_choice(data: dict[str, Any] | None, candidates: tuple[Any, ...]) -> tuple[bool, Any]:
    """(known, choice): a stored choice is used only if it is still one of the candidates."""
    if data is None:
        return True, None
    for candidate in candidates:
        if encode_choice(candidate) == data:
            return True, candidate
    return False, None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full volume: the cache is an optimisation only
        logger.warning("cannot write the start-up cache %s: %s", path, exc)
