"""Tiny random pooling checkpoints: a BERT cross-encoder (MiniLM's tokenizer), a bare
Qwen3Model saved as Qwen3-Embedding is (no ``model.`` prefix), and a Qwen3 classifier."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (BertConfig, BertForSequenceClassification, PreTrainedModel, Qwen3Config,
                          Qwen3ForSequenceClassification, Qwen3Model)

from tiny_tokenizer import EOS_ID, save_byte_tokenizer
from tidal_engine.models.loader import resolve_model_path

_QWEN3 = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
              tie_word_embeddings=False, pad_token_id=EOS_ID)


def _widen(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """HF's init (std 0.02) gives near-constant outputs; widen it so a bug shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "norm" in name.lower():
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


def make_bert_cross_encoder(folder: Path, seed: int = 0) -> PreTrainedModel:
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    model = _widen(BertForSequenceClassification(config), seed)
    model.save_pretrained(folder)
    minilm = resolve_model_path("all-minilm-l6-v2")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return model


def make_qwen3_embedding(folder: Path, seed: int = 0) -> PreTrainedModel:
    model = _widen(Qwen3Model(Qwen3Config(**_QWEN3)), seed)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder, _QWEN3["vocab_size"])
    return model


def make_qwen3_classifier(folder: Path, seed: int = 0) -> PreTrainedModel:
    model = _widen(Qwen3ForSequenceClassification(Qwen3Config(**_QWEN3, num_labels=1)), seed)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder, _QWEN3["vocab_size"])
    return model
