"""Decoder models (Llama, Qwen2, Qwen3) run as encoders: Qwen3-Embedding and the
``*ForSequenceClassification`` rerankers.

The layers are the generation model's own (same modules, same checkpoint names); only the
attention differs: the whole prompt attends causally within the step, with no KV cache.
The LM head is never used, so it is tied to the embedding (no memory) and its checkpoint
tensor skipped; a classifier keeps HF's ``score`` linear (no bias).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tidal_engine.layers.dense_attention import packed_attention
from tidal_engine.layers.linear import Linear, copy_checked
from tidal_engine.models.config import ArchConfig
from tidal_engine.models.llama import DecoderLayer, LlamaForCausalLM


class DecoderPoolingModel(nn.Module):
    is_causal = True

    def __init__(self, config: ArchConfig, num_labels: int = 0) -> None:
        super().__init__()
        self.config = config
        self.decoder = LlamaForCausalLM(dataclasses.replace(config, tie_word_embeddings=True))
        self.score = Linear(config.hidden_size, num_labels, bias=False) if num_labels else None

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None, seq_lens: list[int],
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed ``[T]`` ids → final-normed ``[T, hidden]``; with ``keep_rows``, only those rows
        ``[N, hidden]``: the last layer then runs its output projection and MLP on them alone
        (no later layer reads the other rows), which is all last-token pooling needs."""
        del token_type_ids  # decoders have no segment embedding
        hidden = self.decoder.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        last = len(self.decoder.layers) - 1
        for index, layer in enumerate(self.decoder.layers):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            rows = keep_rows if index == last else None
            hidden = self._attend(layer, positions, hidden, seq_lens, rows)
            if rows is not None:
                residual = residual[rows]
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
        hidden, _ = self.decoder.norm(hidden, residual)
        return hidden

    @staticmethod
    def _attend(layer: DecoderLayer, positions: torch.Tensor, hidden: torch.Tensor, seq_lens: list[int],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        attn = layer.self_attn
        tokens = hidden.shape[0]
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(hidden))
        if attn.q_norm is not None and attn.k_norm is not None:
            q = attn.q_norm(q.reshape(tokens, attn.num_heads, attn.head_dim)).reshape(tokens, -1)
            k = attn.k_norm(k.reshape(tokens, attn.num_kv_heads, attn.head_dim)).reshape(tokens, -1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        out = packed_attention(
            q.view(tokens, attn.num_heads, attn.head_dim),
            k.view(tokens, attn.num_kv_heads, attn.head_dim),
            v.unflatten(-1, (attn.num_kv_heads, attn.head_dim)),  # a strided view: attention reads it in place
            seq_lens,
            causal=True,
            scale=attn.head_dim**-0.5,
        )
        out = out.reshape(tokens, -1)
        return attn.o_proj(out if rows is None else out[rows])

    def classify(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of each request's last token → ``[N, num_labels]`` float32 logits."""
        if self.score is None:
            raise ValueError("this model has no classification head (load it with --convert classify)")
        return self.score(last_tokens).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            seen_score = False
            for name, tensor in weights:
                if name == "score.weight":
                    if self.score is None:
                        continue  # a classifier checkpoint served for embeddings
                    copy_checked(self.score.weight, tensor, name)
                    seen_score = True
                elif name != "lm_head.weight":
                    # Qwen3-Embedding saves the bare Qwen3Model: no "model." prefix.
                    yield (name if name.startswith("model.") else f"model.{name}"), tensor
            if self.score is not None and not seen_score:
                raise ValueError("checkpoint has no score.weight: it is not a sequence-classification model")

        self.decoder.load_weights(decoder_weights())
