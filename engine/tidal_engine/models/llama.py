"""One decoder-only model for Llama, Qwen2 and Qwen3.

The three differ only in details the ArchConfig spells out: Qwen2 has q/k/v bias,
Qwen3 normalises each head of q and k before rotary, and any of them may tie the LM
head to the embedding.

Parallelism (distributed/): the model is built for this process's rank. Tensor parallel:
QKV and gate_up are column-parallel, o_proj and down_proj row-parallel (one all-reduce
each), the embedding and the LM head split the vocabulary; attention runs this rank's
heads. Pipeline parallel: a stage builds only its run of layers (the others are empty
placeholders, so checkpoint indices still line up), the first stage the embedding, the
last the final norm and the LM head; a stage that is not the last returns its hidden
state and residual for the next one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tidal_engine.kernels.fused import use_fused
from tidal_engine.layers.activation import SiluAndMul
from tidal_engine.layers.attention import Attention, AttentionMetadata
from tidal_engine.layers.kv_cache_dtype import kv_scale_kind, scalar_scale
from tidal_engine.distributed.parallel_state import get_parallel
from tidal_engine.distributed.partition import layer_range
from tidal_engine.layers.linear import (
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    as_tensor,
    copy_checked,
)
from tidal_engine.layers.norm import RMSNorm
from tidal_engine.layers.rotary import RotaryEmbedding
from tidal_engine.models.config import ArchConfig
from tidal_engine.quantization.base import QuantizationConfig


def _method(quant: QuantizationConfig | None, prefix: str, modules: list[str]) -> LinearMethod | None:
    """The quantization method of the linear that loads the HF modules ``prefix.<module>``."""
    return quant.linear_method([f"{prefix}.{m}" for m in modules]) if quant is not None else None


class DecoderAttention(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding, quant: QuantizationConfig | None = None,
                 prefix: str = "self_attn") -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, self.head_dim,
            bias=config.attention_bias, method=_method(quant, prefix, ["q_proj", "k_proj", "v_proj"]),
        )
        heads = self.qkv_proj.heads  # this tensor rank's query heads and the KV heads they read
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias,
            input_range=(heads.q_start * self.head_dim, heads.num_heads * self.head_dim),
            method=_method(quant, prefix, ["o_proj"]),
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary  # one instance shared by every layer (same cos/sin cache)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self._use_fused_prologue(qkv):
            return self.o_proj(self._attend_fused(positions, qkv, kv_cache, meta))
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            num_tokens = hidden.shape[0]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).reshape(num_tokens, -1)
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, -1)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        out = self.attn(q, k, v.contiguous(), kv_cache, meta)
        return self.o_proj(out)

    def _use_fused_prologue(self, qkv: torch.Tensor) -> bool:
        """The GPU path: q/k norm, rotary and the K/V store in one Triton kernel. Only with the
        Triton attention backend (the torch backend stays the reference end to end) and a
        kernel cos/sin table (built for CUDA models only)."""
        return (
            use_fused(qkv)
            and getattr(self.attn.backend, "name", "") == "triton"
            and self.rotary_emb.cos_sin_cache is not None
        )

    def _attend_fused(
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # One launch instead of q-norm, k-norm, rotary, v.contiguous() and write_kv; q, k and v
        # are read straight from the QKV output. Same numbers as that sequence of kernels.
        from tidal_engine.kernels.triton.qkv_prologue import qkv_prologue

        q_weight: torch.Tensor | None = None
        k_weight: torch.Tensor | None = None
        eps = 0.0
        if self.q_norm is not None and self.k_norm is not None:
            # Both norms are built with the config's rms_norm_eps, so one eps serves both.
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        q = qkv_prologue(
            qkv,
            positions,
            self.rotary_emb.cos_sin_cache,
            q_weight,
            k_weight,
            eps,
            kv_cache,
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.attn.k_scale,
            self.attn.v_scale,
        )
        return self.attn.forward_prepared(q, kv_cache, meta)


class DecoderMLP(nn.Module):
    def __init__(self, config: ArchConfig, quant: QuantizationConfig | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": size, "up": size}, bias=config.mlp_bias,
                                                       method=_method(quant, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias,
                                           input_range=self.gate_up_proj.output_ranges["gate"],
                                           method=_method(quant, prefix, ["down_proj"]))
        self.act = SiluAndMul()
        self.gate_up_proj.output_activation_name = self.act.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj applies the activation: in its kernel's epilogue where it can (decode).
        return self.down_proj(self.gate_up_proj(x, output_activation=self.act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding, quant: QuantizationConfig | None = None,
                 prefix: str = "model.layers.0") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, quant, f"{prefix}.mlp")

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# HF checkpoint names of the tensors we store merged: hf sub-module → (our module, shard).
_MERGED_SHARDS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(\w+)$")
_LAYER_SUFFIX = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Our linear modules → the HF modules they load (one each, or the shards of a merged one).
_LINEAR_MODULES: dict[str, list[str]] = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds."""


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config  # the decoder linears' format; embedding and head stay plain
        layout = get_parallel()
        self.is_first_stage, self.is_last_stage = layout.is_first_stage, layout.is_last_stage
        self.start_layer, self.end_layer = layer_range(config.num_hidden_layers, layout.pp_size, layout.pp_rank)
        # The last stage of a tied model keeps its own copy of the embedding as its head.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.is_first_stage else None
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary_emb, quant_config, f"model.layers.{i}")
            if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self._local_layers = list(self.layers[self.start_layer : self.end_layer])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size) if self.is_last_stage else None
        if config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.tie_to(self.embed_tokens)

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions ``[T]`` → final-normed hidden states ``[T, hidden_size]``.

        ``kv_caches``: this stage's layers' caches. A stage after the first takes the previous
        stage's (hidden, residual) as ``intermediate``; a stage before the last returns them."""
        residual: torch.Tensor | None = None
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids)
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous stage's activations"
            hidden, residual = intermediate
        for layer, kv_cache in zip(self._local_layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if self.norm is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits (last stage only)."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head.logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named checkpoint tensors (or lazy slices of them) into the model: each
        parameter's loader takes this rank's slice, q/k/v and gate/up go into their merged
        layers, and tensors another pipeline stage holds are skipped unread.

        Raises ValueError for an unknown, mis-shaped or missing tensor.
        """
        expected, optional = self._expected_checkpoint_names()
        loaded: set[str] = set()
        tied_head = self.config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is None
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints save the rotary buffer; we compute our own
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if self._load_kv_scale(name, tensor):
                continue  # optional: fp8 KV-cache scales (1.0 where absent)
            if name not in expected and name not in optional and not self._unchecked(name):
                raise ValueError(f"unexpected tensor in checkpoint: {name} {tuple(tensor.shape)}")
            if not self._holds(name):
                loaded.add(name)  # another pipeline stage's
                continue
            try:
                self._load_one(name, tensor)
                if tied_head and name == "model.embed_tokens.weight":
                    assert self.lm_head is not None
                    self.lm_head.load("weight", tensor)
            except ValueError as exc:
                raise ValueError(f"cannot load {name}: {exc}") from None
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _load_kv_scale(self, name: str, tensor: Any) -> bool:
        """Take ``name`` if it is a layer's KV-cache scale (any of the names checkpoints use);
        returns whether it was one. The scales only matter for an fp8 cache."""
        match = _LAYER_SUFFIX.match(name)
        kind = kv_scale_kind(match.group(2)) if match is not None else None
        if kind is None or match is None or int(match.group(1)) >= self.config.num_hidden_layers:
            return False  # not a scale, or no such layer: load_weights reports it
        index = int(match.group(1))
        if kind == "ignore" or not self.start_layer <= index < self.end_layer:
            return True
        value = scalar_scale(name, as_tensor(tensor))
        attn = self.layers[index].self_attn.attn
        if kind in ("k", "kv"):
            attn.k_scale = value
        if kind in ("v", "kv"):
            attn.v_scale = value
        return True

    def _holds(self, name: str) -> bool:
        """Whether this pipeline stage keeps the checkpoint tensor ``name``."""
        match = _LAYER_NAME.match(name)
        if match is not None:
            return self.start_layer <= int(match.group(1)) < self.end_layer
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is not None or (self.config.tie_word_embeddings and self.lm_head is not None)
        return self.lm_head is not None  # model.norm.weight, lm_head.weight

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is not None:
                self.embed_tokens.load("weight", tensor)
        elif name == "model.norm.weight":
            assert self.norm is not None
            copy_checked(self.norm.weight, tensor, "weight")
        elif name == "lm_head.weight":
            assert self.lm_head is not None
            self.lm_head.load("weight", tensor)
        else:
            match = _LAYER_NAME.match(name)
            assert match is not None  # guaranteed: name is one of _expected_checkpoint_names
            layer = self.layers[int(match.group(1))]
            module_name, param_name = match.group(2), match.group(3)
            if module_name in _MERGED_SHARDS:
                merged_name, shard = _MERGED_SHARDS[module_name]
                layer.get_submodule(merged_name).load_shard(shard, param_name, tensor)
            elif module_name.endswith("norm"):
                copy_checked(getattr(layer.get_submodule(module_name), param_name), tensor, param_name)
            else:
                layer.get_submodule(module_name).load(param_name, tensor)

    def _unchecked(self, name: str) -> bool:
        """A quantized checkpoint's tensor of a layer another pipeline stage holds: this stage
        does not know that layer's format (ignore lists may name single layers), so it skips it."""
        match = _LAYER_NAME.match(name)
        return self.quant_config is not None and match is not None and not self._holds(name)

    def _expected_checkpoint_names(self) -> tuple[set[str], set[str]]:
        """The HF names a complete checkpoint for this config must contain, and those it may
        contain (tensors a quantization method reads past)."""
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        optional: set[str] = set()
        if not cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if cfg.qk_norm:
            norms += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}"
            names.update(f"{prefix}.{suffix}" for suffix in norms)
            layer = self.layers[i]
            if isinstance(layer, MissingLayer):
                if self.quant_config is None:
                    names.update(f"{prefix}.{suffix}" for suffix in self._plain_linear_names())
                continue
            for module_name, hf_modules in _LINEAR_MODULES.items():
                linear = layer.get_submodule(module_name)
                assert isinstance(linear, LinearBase)
                params = [n for n, p in linear.named_parameters(recurse=False) if p is not None]
                for hf_module in hf_modules:
                    names.update(f"{prefix}.{hf_module}.{p}" for p in params)
                    optional.update(f"{prefix}.{hf_module}.{p}" for p in linear.method.ignored_params)
        return names, optional

    def _plain_linear_names(self) -> list[str]:
        """A plain layer's linear tensors (weights and the biases the config has)."""
        cfg = self.config
        names = [f"{m}.weight" for modules in _LINEAR_MODULES.values() for m in modules]
        if cfg.attention_bias:
            names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if cfg.o_proj_bias:
            names.append("self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names += ["mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"]
        return names
