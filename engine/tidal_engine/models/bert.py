"""BERT encoders (all-MiniLM-L6-v2 and friends) and their sequence-classification head.

Linear layers and the MLP run on the packed tokens of the batch (no padding work); only
attention pads (``packed_attention``). Checkpoint names are HF's, with or without the
``bert.`` prefix that ``BertForSequenceClassification`` checkpoints carry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal_engine.layers.dense_attention import packed_qkv_attention
from tidal_engine.layers.linear import Linear, QKVLinear, copy_checked

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int  # classification outputs (0 for a plain encoder)
    torch_dtype: torch.dtype | None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], classify: bool) -> BertConfig:
        from tidal_engine.models.config import parse_dtype

        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported BERT position_embedding_type {config['position_embedding_type']!r}")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported BERT hidden_act {act!r}; supported: {sorted(_ACTIVATIONS)}")
        labels = len(config["id2label"]) if "id2label" in config else int(config.get("num_labels", 2))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 512)),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            num_labels=labels if classify else 0,
            torch_dtype=parse_dtype(config.get("dtype") or config.get("torch_dtype")),
        )


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        self.qkv = QKVLinear(hidden, heads, heads, self.head_dim, bias=True)
        self.attn_out = Linear(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = Linear(hidden, config.intermediate_size, bias=True)
        self.output = Linear(config.intermediate_size, hidden, bias=True)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        attn = packed_qkv_attention(self.qkv(hidden), self.num_heads, seq_lens, self.head_dim**-0.5)
        hidden = self.attn_norm(self.attn_out(attn) + hidden)
        return self.out_norm(self.output(self.act(self.intermediate(hidden))) + hidden)


# HF name (after "encoder.layer.N.") → (our module, QKV shard or None).
_LAYER_NAMES: dict[str, tuple[str, str | None]] = {
    "attention.self.query": ("qkv", "q"),
    "attention.self.key": ("qkv", "k"),
    "attention.self.value": ("qkv", "v"),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("intermediate", None),
    "output.dense": ("output", None),
    "output.LayerNorm": ("out_norm", None),
}
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_NAMES: dict[str, str] = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
    "pooler.dense.weight": "pooler.weight",
    "pooler.dense.bias": "pooler.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
}


class BertModel(nn.Module):
    """Encoder → hidden states of every token; ``classify`` adds BERT's pooler and classifier."""

    is_causal = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler: Linear | None = None
        self.classifier: Linear | None = None
        if config.num_labels:
            self.pooler = Linear(hidden, hidden, bias=True)
            self.classifier = Linear(hidden, config.num_labels, bias=True)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None, seq_lens: list[int]
    ) -> torch.Tensor:
        """Packed ``[T]`` ids → ``[T, hidden]``."""
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        hidden = self.embed_norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, seq_lens)
        return hidden

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of each request's [CLS] token → ``[N, num_labels]`` float32 logits."""
        if self.pooler is None or self.classifier is None:
            raise ValueError("this model has no classification head (load it with --convert classify)")
        return self.classifier(torch.tanh(self.pooler(first_tokens))).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = self._expected_names()
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("bert.")
            if name == "embeddings.position_ids" or (not self.config.num_labels and name.startswith(("pooler.", "classifier."))):
                continue  # a buffer, or a head the embedding task does not use
            if name not in expected:
                raise ValueError(f"unexpected tensor in checkpoint: {raw_name} {tuple(tensor.shape)}")
            try:
                self._load_one(name, tensor)
            except ValueError as exc:
                raise ValueError(f"cannot load {raw_name}: {exc}") from None
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}")

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in _GLOBAL_NAMES:
            copy_checked(self.get_parameter(_GLOBAL_NAMES[name]), tensor, name)
            return
        match = _LAYER_NAME.match(name)
        assert match is not None  # name is one of _expected_names
        layer = self.layers[int(match.group(1))]
        module_name, shard = _LAYER_NAMES[match.group(2)]
        module = layer.get_submodule(module_name)
        if shard is not None:
            module.load_shard(shard, match.group(3), tensor)
        else:
            copy_checked(getattr(module, match.group(3)), tensor, name)

    def _expected_names(self) -> set[str]:
        names = {n for n in _GLOBAL_NAMES if not n.startswith(("pooler.", "classifier."))}
        if self.config.num_labels:
            names |= {n for n in _GLOBAL_NAMES if n.startswith(("pooler.", "classifier."))}
        for i in range(self.config.num_hidden_layers):
            names |= {f"encoder.layer.{i}.{hf}.{p}" for hf in _LAYER_NAMES for p in ("weight", "bias")}
        return names
