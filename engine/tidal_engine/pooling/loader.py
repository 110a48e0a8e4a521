"""Loading a pooling model: BERT encoders or decoders, for embeddings or classification.

The task comes from ``--convert`` (vLLM's flag) or, without it, from the checkpoint: a
``*ForSequenceClassification`` architecture classifies, anything else embeds. The pooling
method and the default context length follow the sentence-transformers files shipped
beside the weights (1_Pooling/config.json, sentence_bert_config.json) when present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tidal_engine.models.bert import BertConfig, BertModel
from tidal_engine.models.config import ArchConfig
from tidal_engine.models.decoder_pooling import DecoderPoolingModel
from tidal_engine.models.loader import checked_safetensors, read_safetensors, resolve_dtype, resolve_model_path
from tidal_engine.pooling.params import PoolingMethod, PoolingModelInfo, PoolingTask

ConvertOption = Literal["auto", "embed", "classify"]
_ST_POOLING_MODES: dict[str, PoolingMethod] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


@dataclass
class LoadedPoolingModel:
    model: nn.Module  # BertModel or DecoderPoolingModel: forward(ids, positions, token_types, seq_lens)
    info: PoolingModelInfo
    tokenizer: Any
    path: Path
    dtype: torch.dtype


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def choose_task(config: dict[str, Any], convert: ConvertOption) -> PoolingTask:
    if convert != "auto":
        return convert
    architectures = config.get("architectures") or []
    return "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"


def choose_method(path: Path, task: PoolingTask, is_bert: bool) -> PoolingMethod:
    """Classifiers pool like HF's heads ([CLS] for BERT, the last token for decoders);
    embedders follow sentence-transformers' pooling config, else the same defaults."""
    default: PoolingMethod = "cls" if is_bert else "last"
    if task == "classify":
        return default
    st_pooling = _read_json(path / "1_Pooling" / "config.json") or {}
    for key, method in _ST_POOLING_MODES.items():
        if st_pooling.get(key):
            return method
    return default


def load_pooling_model(
    model: str, convert: ConvertOption = "auto", dtype: str = "auto", device: str | torch.device = "cpu",
    max_model_len: int | None = None, tokenizer: str | None = None,
) -> LoadedPoolingModel:
    path = resolve_model_path(model)
    if not path.is_dir():
        raise ValueError(f"pooling models load from an HF folder; {path} is a file")
    config = _read_json(path / "config.json")
    if config is None:
        raise ValueError(f"model folder {path} has no config.json")
    task = choose_task(config, convert)
    is_bert = config.get("model_type") == "bert"
    device = torch.device(device)
    net: BertModel | DecoderPoolingModel
    if is_bert:
        bert_config = BertConfig.from_hf_config(config, classify=task == "classify")
        run_dtype = resolve_dtype(bert_config.torch_dtype, dtype, device)
        hidden, num_labels, positions = bert_config.hidden_size, bert_config.num_labels, bert_config.max_position_embeddings
        build = lambda: BertModel(bert_config)  # noqa: E731
    else:
        arch = ArchConfig.from_hf_config(config)
        num_labels = (len(config["id2label"]) if "id2label" in config else int(config.get("num_labels", 2))) \
            if task == "classify" else 0
        run_dtype = resolve_dtype(arch.torch_dtype, dtype, device)
        hidden, positions = arch.hidden_size, arch.max_position_embeddings
        build = lambda: DecoderPoolingModel(arch, num_labels)  # noqa: E731
    st_config = _read_json(path / "sentence_bert_config.json") or {}
    limit = min(positions, int(st_config.get("max_seq_length") or positions))
    if max_model_len is not None:
        if max_model_len > positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {positions} positions")
        limit = max_model_len
    id2label = config.get("id2label") or {}
    info = PoolingModelInfo(
        task=task,
        method=choose_method(path, task, is_bert),
        max_model_len=limit,
        hidden_size=hidden,
        num_labels=num_labels,
        labels=tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)),
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(run_dtype)
    try:
        with device:
            net = build()
    finally:
        torch.set_default_dtype(previous)
    net.load_weights(read_safetensors(checked_safetensors(path)))
    net.requires_grad_(False)
    from transformers import AutoTokenizer

    return LoadedPoolingModel(net.eval(), info, AutoTokenizer.from_pretrained(tokenizer or str(path)), path, run_dtype)



def is_pooling_checkpoint(model: str) -> bool:
    """True for checkpoints that only pool: BERT encoders, sentence-transformers folders and
    ``*ForSequenceClassification`` models (vLLM's --runner auto does the same)."""
    path = resolve_model_path(model)
    if not path.is_dir():
        return False  # GGUF files are generative models here
    config = _read_json(path / "config.json") or {}
    return (
        config.get("model_type") == "bert"
        or (path / "modules.json").is_file()
        or choose_task(config, "auto") == "classify"
    )
