"""Model shapes for the memory planner: the sizes that matter, read from a transformers config,
a dict, a config.json path or a known name, and exact parameter counts (dense and LoRA).

Pure Python: nothing from swiftune, no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Architecture sizes of real models (random weights are built from these in the benchmarks).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                       tie_word_embeddings=False),
}

_QK_NORM = ("qwen3", "gemma3_text", "gemma3")
_FOUR_NORMS = ("gemma2", "gemma3_text", "gemma3")


# ----------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on (read from a config)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def model_shape(model_config: Any) -> ModelShape:
    """A :class:`ModelShape` from a transformers config, a dict of its fields, a known name
    (``"qwen3-8b"``, see :data:`KNOWN_MODELS`), or a path to a ``config.json`` (or its folder).

    Multimodal configs contribute their ``text_config``.  Bias and norm layout follow the
    modeling files: Qwen2 has q/k/v biases (always) and no o bias; Llama-style configs use
    ``attention_bias`` for q/k/v/o and ``mlp_bias`` for the MLP; Qwen3 and Gemma 3 normalise q and
    k per head; Gemma 2/3 have four RMSNorms per layer.  A :class:`ModelShape` is returned as is.
    """
    if isinstance(model_config, ModelShape):
        return model_config
    cfg = _config_dict(model_config)
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    mt = str(cfg.get("model_type", "llama"))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    attn_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        model_type=mt,
        hidden=hidden,
        intermediate=int(cfg["intermediate_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if mt == "qwen2" else attn_bias,
        o_bias=False if mt == "qwen2" else attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=mt in _QK_NORM,
        norms_per_layer=4 if mt in _FOUR_NORMS else 2,
    )


def _config_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, str):
        key = model_config.lower()
        if key in KNOWN_MODELS:
            return dict(KNOWN_MODELS[key])
        path = os.path.join(model_config, "config.json") if os.path.isdir(model_config) else model_config
        if not os.path.isfile(path):
            raise ValueError(
                f"unknown model {model_config!r}: give a config.json path, a model folder, or one of "
                f"{', '.join(KNOWN_MODELS)}"
            )
        with open(path) as f:
            return json.load(f)
    if isinstance(model_config, Mapping):
        return dict(model_config)
    to_dict = getattr(model_config, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        # to_dict() drops class-level defaults in a few versions; read the attributes we need.
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                    "attention_bias", "mlp_bias", "model_type"):
            if hasattr(model_config, key):
                d[key] = getattr(model_config, key)
        text = getattr(model_config, "text_config", None)
        if text is not None and hasattr(text, "to_dict"):
            d["text_config"] = _config_dict(text)
        return d
    raise TypeError(f"cannot read a model shape from {type(model_config).__name__}")


def param_count(shape: ModelShape) -> int:
    """Parameters of the model: embeddings, (untied) LM head, per-layer projections, norms.

    Per layer::

        attn = H*dq + 2*H*dkv + dq*H  (+ dq + 2*dkv if q/k/v biases, + H if o bias)
               (+ 2*d for Qwen3 / Gemma 3 q/k norms)
        mlp  = 3*H*I  (+ 2*I + H with MLP biases)
        norm = norms_per_layer * H

    Total: ``V*H*(1 if tied else 2) + L*(attn + mlp + norm) + H`` (final norm).
    """
    H, I, d = shape.hidden, shape.intermediate, shape.head_dim
    dq, dkv = shape.q_dim, shape.kv_dim
    attn = H * dq + 2 * H * dkv + dq * H
    if shape.qkv_bias:
        attn += dq + 2 * dkv
    if shape.o_bias:
        attn += H
    if shape.qk_norm:
        attn += 2 * d
    mlp = 3 * H * I + ((2 * I + H) if shape.mlp_bias else 0)
    layer = attn + mlp + shape.norms_per_layer * H
    embed = shape.vocab * H * (1 if shape.tied else 2)
    return embed + shape.layers * layer + H


def linear_weight_count(shape: ModelShape) -> int:
    """Weights of the decoder's linear projections (what 4-bit loading quantises; biases, norms,
    embeddings and the LM head stay in the load dtype): ``L * (H*dq + 2*H*dkv + dq*H + 3*H*I)``."""
    H, I, dq, dkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    return shape.layers * (H * dq + 2 * H * dkv + dq * H + 3 * H * I)


def lora_param_count(shape: ModelShape, rank: int) -> int:
    """LoRA parameters on every linear layer of the decoder (PEFT ``"all-linear"``: not the LM head).

    A LoRA pair on a ``[in -> out]`` linear has ``r * (in + out)`` parameters, so per layer::

        r * [(H + dq) + 2 (H + dkv) + (dq + H) + 2 (H + I) + (I + H)]
    """
    H, I, dq, dkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    per_layer = (H + dq) + 2 * (H + dkv) + (dq + H) + 2 * (H + I) + (I + H)
    return rank * per_layer * shape.layers
