"""The on-disk start-up cache (kernels/compile_cache.py): the one-row-linear choices and Triton's folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tidal_engine.kernels.compile_cache import gemv_cache_key, use_cache_dir
from tidal_engine.kernels.gemv_choice import load_choices, save_choices


@dataclass(frozen=True)
class Tile:  # the fields of a GemvConfig
    block_n: int
    block_k: int
    num_warps: int


CANDIDATES = (Tile(1, 1024, 4), Tile(2, 512, 4))


def test_choices_round_trip_and_skip_what_is_no_longer_a_candidate(tmp_path: Path) -> None:
    path = tmp_path / "gemv" / "h200.json"
    choices = {(4096, 4096, torch.bfloat16, False): Tile(1, 1024, 4), (6144, 4096, torch.float16, True): None,
               (151936, 4096, torch.bfloat16, False): Tile(8, 128, 2)}
    save_choices(path, choices)
    assert not list(path.parent.glob("*.tmp"))  # written atomically
    loaded = load_choices(path, CANDIDATES)
    # cuBLAS and a known tile come back; a tile the kernel no longer offers is timed again.
    assert loaded == {(4096, 4096, torch.bfloat16, False): Tile(1, 1024, 4), (6144, 4096, torch.float16, True): None}


def test_a_broken_or_missing_file_is_an_empty_cache(tmp_path: Path) -> None:
    assert load_choices(tmp_path / "absent.json", CANDIDATES) == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert load_choices(tmp_path / "bad.json", CANDIDATES) == {}


def test_the_key_changes_with_the_gpu_and_the_versions() -> None:
    base = gemv_cache_key("NVIDIA H200", {"torch": "2.11", "triton": "3.6"})
    assert base.startswith("nvidia-h200-")
    assert gemv_cache_key("NVIDIA H200", {"torch": "2.11", "triton": "3.6"}) == base
    assert gemv_cache_key("NVIDIA H100 80GB HBM3", {"torch": "2.11", "triton": "3.6"}) != base
    assert gemv_cache_key("NVIDIA H200", {"torch": "2.12", "triton": "3.6"}) != base


def test_triton_compiles_into_the_cache_dir_unless_the_environment_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_cache_dir(tmp_path) == tmp_path
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    use_cache_dir(tmp_path / "other")
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "from-env"))
    assert use_cache_dir(None) == tmp_path / "from-env"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "from-env" / "triton")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    (tmp_path / "a-file").write_text("")
    use_cache_dir(tmp_path / "a-file")  # not a folder: Triton keeps its own default
    assert "TRITON_CACHE_DIR" not in os.environ
