"""An index of a GGUF file, kept in the start-up cache so that later engines skip the parse.

gguf's ``GGUFReader`` builds every metadata field eagerly through numpy views, the tokenizer's
vocabulary and merges included: SmolLM2's ~147k field parts take ~4 s of CPU per process, and
the engine core and every tensor-parallel worker each parse the file. What the engine needs of
it is small: the scalar and string metadata, the lengths of the array fields, and where each
tensor's data lies. That is written once per node to ``<cache>/gguf/<key>.json`` (the start-up
cache the operator mounts per node), keyed by the file's path, size and modification time and
the gguf package's version, so a changed file or library parses again.

Writes go to a temporary file renamed into place, so engines starting together never read a
half-written index; an unreadable or inconsistent index is ignored and rewritten; an
unwritable cache only costs time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from tidal_engine.kernels.compile_cache import cache_root, file_cache_key, read_json, write_json_atomic

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1  # bump when the file's layout changes: old entries then get a new key


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: what ``GGUFReader`` derives from its header."""

    name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    fields: dict[str, Any]  # scalar and string metadata: what ReaderField.contents() gives
    array_lengths: dict[str, int]  # array metadata (vocabulary, merges...): only the length
    tensors: list[GGUFTensorInfo]
    byte_order: str  # GGUFReader's: "I" (the host's), "S" (swapped)

    @classmethod
    def from_reader(cls, reader: Any) -> GGUFIndex:
        from gguf import GGUFValueType

        fields: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        for key, field in reader.fields.items():
            if not field.types:
                continue
            if field.types[0] == GGUFValueType.ARRAY:
                array_lengths[key] = len(field.data)
                continue
            try:
                fields[key] = field.contents()
            except UnicodeDecodeError:  # a string that is not UTF-8: as absent as the engine can read it
                logger.warning("GGUF metadata %s is not UTF-8: ignored", key)
        tensors = [
            GGUFTensorInfo(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape.tolist()),
                           int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors
        ]
        return cls(fields, array_lengths, tensors, str(reader.byte_order))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "byte_order": self.byte_order,
            "fields": self.fields,
            "array_lengths": self.array_lengths,
            "tensors": [[t.name, t.ggml_type, list(t.shape), t.data_offset, t.n_bytes] for t in self.tensors],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], file_size: int) -> GGUFIndex:
        """The index ``data`` holds, checked against ``file_size`` and gguf's own block sizes;
        ValueError, KeyError or TypeError when it does not hold together."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if data["format"] != INDEX_FORMAT or data["byte_order"] not in ("I", "S"):
            raise ValueError("unknown format")
        fields, array_lengths = data["fields"], data["array_lengths"]
        if not isinstance(fields, dict) or not isinstance(array_lengths, dict):
            raise TypeError("fields are not a mapping")
        if not all(isinstance(v, (str, int, float, bool)) for v in fields.values()):
            raise TypeError("a field is not a scalar or a string")
        if not all(isinstance(n, int) and n >= 0 for n in array_lengths.values()):
            raise TypeError("an array length is not a count")
        tensors = []
        for name, ggml_type, shape, data_offset, n_bytes in data["tensors"]:
            if not isinstance(name, str) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise TypeError(f"tensor entry {name!r} is malformed")
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            if n_bytes != int(np.prod(shape)) * type_size // block_size:
                raise ValueError(f"tensor {name}: {n_bytes} bytes do not match its shape")
            if not isinstance(data_offset, int) or data_offset < 0 or data_offset + n_bytes > file_size:
                raise ValueError(f"tensor {name} lies outside the file")
            tensors.append(GGUFTensorInfo(name, int(ggml_type), tuple(shape), data_offset, n_bytes))
        return cls(fields, array_lengths, tensors, data["byte_order"])


def gguf_index_key(gguf_path: Path) -> str:
    return file_cache_key(gguf_path, {"gguf": version("gguf"), "format": INDEX_FORMAT})


def gguf_index_file(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / "gguf" / f"{gguf_index_key(gguf_path)}.json"


def read_gguf_index(gguf_path: Path, cache_dir: str | Path | None = None) -> GGUFIndex | None:
    """The cached index of ``gguf_path``, or None (none yet, or a damaged one: parse again)."""
    entry = gguf_index_file(gguf_path, cache_dir)
    try:
        if not entry.is_file():
            return None
        return GGUFIndex.from_json(read_json(entry), gguf_path.stat().st_size)
    except Exception as exc:  # a damaged entry of any shape: the caller parses and rewrites it
        logger.warning("ignoring the GGUF index %s (%s: %s)", entry, type(exc).__name__, exc)
        return None


def write_gguf_index(index: GGUFIndex, gguf_path: Path, cache_dir: str | Path | None = None) -> None:
    """Save ``index`` atomically; a cache that cannot be written is logged, not raised."""
    write_json_atomic(gguf_index_file(gguf_path, cache_dir), index.to_json())


def tensor_arrays(gguf_path: Path, index: GGUFIndex) -> Iterator[tuple[GGUFTensorInfo, np.ndarray]]:
    """Each tensor's data as a view of one memory map of the file, as ``GGUFReader`` gives it:
    plain types as their numpy dtype in numpy's (slowest-first) order, quantized ones as the
    raw bytes of each row (``quant_shape_to_byte_shape``), for ``gguf.quants.dequantize``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    plain = {
        GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
        GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
        GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
        GGMLQuantizationType.I64: np.int64,
    }
    mapped = np.memmap(gguf_path, mode="r")
    for info in index.tensors:
        ggml_type = GGMLQuantizationType(info.ggml_type)
        np_shape = tuple(reversed(info.shape))
        dtype = plain.get(ggml_type)
        if dtype is None:
            dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_shape, ggml_type)
        array = mapped[info.data_offset:info.data_offset + info.n_bytes].view(dtype)
        array = array.view(array.dtype.newbyteorder(index.byte_order))
        yield info, array.reshape(np_shape)
