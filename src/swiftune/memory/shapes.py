"""Model shapes for the memory planner: the sizes that matter, read from a transformers config,
a dict, a config.json path or a known name, and exact parameter counts (dense and LoRA).

Pure Python: nothing from swiftune, no torch.
"""

from __future__ import annotations

import functools
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
    # mixture of experts: every layer sparse (decoder_sparse_step 1, no mlp_only_layers)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, vocab_size=201088, attention_bias=True, sliding_window=128,
                        tie_word_embeddings=False),
    # Mixtral-8x7B (config.json of mistralai/Mixtral-8x7B-v0.1): 8 experts top-2 of width 14,336 in
    # every layer, Mistral-7B's attention, no sliding window (sliding_window null), RoPE base 1e6
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=32000, rope_theta=1e6, max_position_embeddings=32768,
                         sliding_window=None, router_aux_loss_coef=0.02, tie_word_embeddings=False),
    # Qwen3-VL-8B (Qwen/Qwen3-VL-8B-Instruct's config.json): a Qwen3-8B text decoder (36 layers, 4096 hidden,
    # 12288 MLP, 32 q / 8 kv heads of 128, untied head; M-RoPE theta 5e6, 256K positions) and the vision
    # tower of transformers' Qwen3VLVisionConfig defaults (27 blocks of 1152 hidden, 4304 MLP, 16 heads;
    # patch 16, temporal patch 2, 2x2 merge, 2304 learned positions, deepstack mergers after blocks 8, 16
    # and 24) whose mergers project to the text's 4096 (out_hidden_size)
    "qwen3-vl-8b": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=dict(model_type="qwen3_vl_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=False),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=4096,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])),
}

# composite vision-language configs whose vision_config is Qwen3-VL's vision tower (:class:`VisionShape`)
_QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

# MoE families whose fused experts PEFT (0.21, 0.22) targets for the per-expert linear names (its weight
# conversion table), "all-linear" included
PEFT_MAPS_EXPERT_NAMES = ("qwen3_moe", "mixtral")
_QK_NORM = ("qwen3", "gemma3_text", "gemma3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text")
_FOUR_NORMS = ("gemma2", "gemma3_text", "gemma3")


# ----------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class VisionShape:
    """The sizes of Qwen3-VL's vision tower (``model.visual``): a patch embedding (Conv3d over
    ``temporal_patch x patch x patch`` pixels of ``in_channels``), learned positions, ``depth`` ViT
    blocks (LayerNorm, qkv / proj attention of ``heads``, GELU MLP of ``intermediate``), a patch
    merger (``merge x merge`` patches -> one text token of ``out_hidden``) and ``deepstack`` more
    mergers (post-shuffle LayerNorm) whose features are added to the first decoder layers."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    temporal_patch: int
    merge: int
    in_channels: int
    out_hidden: int
    position_embeddings: int
    deepstack: int

    @property
    def patches_per_token(self) -> int:
        """Vision patches one merged image token stands for (``merge**2``)."""
        return self.merge * self.merge

    @property
    def merged_hidden(self) -> int:
        """Width of a merger's input: ``merge**2`` patches concatenated."""
        return self.hidden * self.patches_per_token

    @property
    def patch_values(self) -> int:
        """Pixel values of one patch (``pixel_values`` is ``[patches, patch_values]``)."""
        return self.in_channels * self.temporal_patch * self.patch * self.patch


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
    # mixture of experts (0 experts: dense). ``moe_layers`` of the ``layers`` have a sparse block of
    # ``experts`` experts of width ``expert_intermediate`` (``experts_per_token`` of them per token)
    # and a router; the others a dense MLP of width ``intermediate``.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    expert_bias: bool = False  # gpt-oss: biases on the experts' projections and on the router
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per query head
    vision: VisionShape | None = None  # a vision-language model's vision tower (Qwen3-VL), else None

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0

    @property
    def active_intermediate(self) -> int:
        """MLP width one token goes through in a sparse layer (``k * I_e``; ``intermediate`` if dense)."""
        return self.experts_per_token * self.expert_intermediate if self.is_moe else self.intermediate

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


_REQUIRED_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def model_shape(model_config: Any) -> ModelShape:
    """A :class:`ModelShape` from a transformers config, a dict of its fields, a known name
    (``"qwen3-8b"``, see :data:`KNOWN_MODELS`), or a path to a ``config.json`` (or its folder).

    Multimodal configs contribute their ``text_config``, and Qwen3-VL's (``qwen3_vl``, ``qwen3_vl_moe``)
    their vision tower (:class:`VisionShape`, from ``vision_config``).  Bias and norm layout follow the
    modeling files: Qwen2 has q/k/v biases (always) and no o bias; Llama-style configs use
    ``attention_bias`` for q/k/v/o and ``mlp_bias`` for the MLP; Qwen3 and Gemma 3 normalise q and
    k per head; Gemma 2/3 have four RMSNorms per layer.  A :class:`ModelShape` is returned as is.
    """
    if isinstance(model_config, ModelShape):
        return model_config
    cfg = _config_dict(model_config)
    vision = _vision_shape(cfg)
    if isinstance(cfg.get("text_config"), Mapping):
        text = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        if vision is not None and cfg.get("tie_word_embeddings") is not None:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]  # Qwen3-VL ties by the composite's flag
        cfg = text
    missing = [k for k in _REQUIRED_CONFIG_KEYS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"the model config has no {', '.join(missing)}: the planner needs a decoder's config "
                         f"(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)")
    mt = str(cfg.get("model_type", "llama"))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    attn_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        **_moe_fields(cfg, mt, int(cfg["num_hidden_layers"])),
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
        vision=vision,
    )


def _vision_shape(cfg: Mapping[str, Any]) -> VisionShape | None:
    """Qwen3-VL's vision tower from a composite config's ``vision_config`` (missing fields: the
    defaults of transformers' ``Qwen3VLVisionConfig``); ``None`` for any other config."""
    vision = cfg.get("vision_config")
    if str(cfg.get("model_type")) not in _QWEN3_VL_TYPES or not isinstance(vision, Mapping):
        return None
    return VisionShape(
        depth=int(vision.get("depth", 27)), hidden=int(vision.get("hidden_size", 1152)),
        intermediate=int(vision.get("intermediate_size", 4304)), heads=int(vision.get("num_heads", 16)),
        patch=int(vision.get("patch_size", 16)), temporal_patch=int(vision.get("temporal_patch_size", 2)),
        merge=int(vision.get("spatial_merge_size", 2)), in_channels=int(vision.get("in_channels", 3)),
        out_hidden=int(vision.get("out_hidden_size", 3584)),
        position_embeddings=int(vision.get("num_position_embeddings", 2304)),
        deepstack=len(vision.get("deepstack_visual_indexes", (8, 16, 24)) or ()),
    )


def _moe_fields(cfg: Mapping[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """Expert counts of a MoE config (Qwen3-MoE: ``num_experts``, sparse layers every
    ``decoder_sparse_step`` but ``mlp_only_layers``; gpt-oss and Mixtral: ``num_local_experts``, every
    layer sparse, experts as wide as ``intermediate_size``; gpt-oss adds biases and sinks); nothing for
    a dense config."""
    if model_type in ("gpt_oss", "mixtral"):
        oss = model_type == "gpt_oss"
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        return dict(experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                    expert_intermediate=int(cfg["intermediate_size"]), moe_layers=layers, expert_bias=oss,
                    attention_sinks=oss)
    experts = int(cfg.get("num_experts") or 0)
    if model_type != "qwen3_moe" or experts == 0:
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return dict(experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate=int(cfg["moe_intermediate_size"]), moe_layers=sparse)


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
        try:
            with open(path) as f:
                loaded = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a model's config.json ({e}); give a config.json path, a model folder, "
                             f"or one of {', '.join(KNOWN_MODELS)}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} holds a JSON {type(loaded).__name__}, not a model's config.json (an object "
                             "with hidden_size, num_hidden_layers, ...)")
        return loaded
    if isinstance(model_config, Mapping):
        return dict(model_config)
    to_dict = getattr(model_config, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        # to_dict() drops class-level defaults in a few versions; read the attributes we need.
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                    "attention_bias", "mlp_bias", "model_type", "num_experts", "num_local_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            if hasattr(model_config, key):
                d[key] = getattr(model_config, key)
        text = getattr(model_config, "text_config", None)
        if text is not None and hasattr(text, "to_dict"):
            d["text_config"] = _config_dict(text)
        vision = getattr(model_config, "vision_config", None)
        if vision is not None and hasattr(vision, "to_dict"):
            d["vision_config"] = vision.to_dict()
        return d
    raise TypeError(f"cannot read a model shape from {type(model_config).__name__}")


def _attention_params(shape: ModelShape) -> int:
    H, d, dq, dkv = shape.hidden, shape.head_dim, shape.q_dim, shape.kv_dim
    attn = H * dq + 2 * H * dkv + dq * H
    if shape.qkv_bias:
        attn += dq + 2 * dkv
    if shape.o_bias:
        attn += H
    if shape.qk_norm:
        attn += 2 * d
    if shape.attention_sinks:
        attn += shape.heads
    return attn


def _expert_params(shape: ModelShape) -> int:
    """One expert: ``3 H I_e`` (gate, up, down) ``+ 2 I_e + H`` with biases (gpt-oss)."""
    H, Ie = shape.hidden, shape.expert_intermediate
    return 3 * H * Ie + ((2 * Ie + H) if shape.expert_bias else 0)


def _router_params(shape: ModelShape) -> int:
    return shape.experts * shape.hidden + (shape.experts if shape.expert_bias else 0)


def param_count(shape: ModelShape) -> int:
    """Parameters of the model: embeddings, (untied) LM head, per-layer projections, norms, experts.

    Per layer::

        attn = H*dq + 2*H*dkv + dq*H  (+ dq + 2*dkv if q/k/v biases, + H if o bias)
               (+ 2*d for Qwen3 / Gemma 3 / Qwen3-MoE q/k norms, + heads for gpt-oss's sinks)
        mlp  = 3*H*I  (+ 2*I + H with MLP biases)                     dense layers
               E*H (+ E) + E*(3*H*I_e (+ 2*I_e + H))                  sparse layers: router, E experts
        norm = norms_per_layer * H

    Total: ``V*H*(1 if tied else 2) + L*(attn + norm) + sum of the layers' mlp + H`` (final norm), plus
    a vision-language model's vision tower (:func:`vision_param_count`).
    """
    H, I = shape.hidden, shape.intermediate
    dense_mlp = 3 * H * I + ((2 * I + H) if shape.mlp_bias else 0)
    sparse_mlp = _router_params(shape) + shape.experts * _expert_params(shape) if shape.is_moe else 0
    dense_layers = shape.layers - (shape.moe_layers if shape.is_moe else 0)
    embed = shape.vocab * H * (1 if shape.tied else 2)
    per_layer = _attention_params(shape) + shape.norms_per_layer * H
    vision = vision_param_count(shape.vision) if shape.vision is not None else 0
    return (embed + shape.layers * per_layer + dense_layers * dense_mlp + (shape.layers - dense_layers) * sparse_mlp + H
            + vision)


def _vision_linears(v: VisionShape) -> list[tuple[int, int, int]]:
    """``(in, out, count)`` of the vision tower's ``nn.Linear`` layers (all with biases): each block's
    qkv, proj, linear_fc1, linear_fc2; each merger's linear_fc1 and linear_fc2."""
    mergers = 1 + v.deepstack
    return [(v.hidden, 3 * v.hidden, v.depth), (v.hidden, v.hidden, v.depth), (v.hidden, v.intermediate, v.depth),
            (v.intermediate, v.hidden, v.depth), (v.merged_hidden, v.merged_hidden, mergers),
            (v.merged_hidden, v.out_hidden, mergers)]


def vision_param_count(v: VisionShape) -> int:
    """Parameters of Qwen3-VL's vision tower and mergers::

        patch embedding   Hv C t p^2 + Hv          (Conv3d with bias)
        positions         N_pos Hv
        per block         4 Hv (two LayerNorms) + Hv 3Hv + 3Hv + Hv^2 + Hv + Hv Iv + Iv + Iv Hv + Hv
        merger            2 Hv (LayerNorm) + Hm^2 + Hm + Hm Out + Out        Hm = Hv merge^2
        deepstack merger  2 Hm (post-shuffle LayerNorm) + the same linears
    """
    linears = sum(count * (fan_in * fan_out + fan_out) for fan_in, fan_out, count in _vision_linears(v))
    norms = v.depth * 4 * v.hidden + 2 * v.hidden + v.deepstack * 2 * v.merged_hidden
    return v.hidden * v.patch_values + v.hidden + v.position_embeddings * v.hidden + linears + norms


def vision_lora_param_count(v: VisionShape, rank: int) -> int:
    """LoRA parameters PEFT's ``"all-linear"`` puts on the vision tower and its mergers: ``r (in + out)``
    per linear of :func:`_vision_linears` (the patch embedding is a Conv3d: not a linear layer)."""
    return sum(count * rank * (fan_in + fan_out) for fan_in, fan_out, count in _vision_linears(v))


def expert_param_count(shape: ModelShape) -> int:
    """Parameters of all experts of all sparse layers (0 for a dense model)."""
    return shape.moe_layers * shape.experts * _expert_params(shape) if shape.is_moe else 0


def active_param_count(shape: ModelShape, embedding: bool = True) -> int:
    """Parameters one token uses: everything but the ``E - k`` experts it is not routed to, in each
    sparse layer (a dense model: :func:`param_count`). ``embedding=False`` leaves out the input
    embedding table of an untied model, of which a token reads one row. Published "active" counts
    differ on that: Qwen3-30B-A3B's 3.3B counts the table, gpt-oss-20b's 3.6B does not."""
    total = param_count(shape)
    if not embedding and not shape.tied:
        total -= shape.vocab * shape.hidden
    if not shape.is_moe:
        return total
    return total - shape.moe_layers * (shape.experts - shape.experts_per_token) * _expert_params(shape)


def linear_weight_count(shape: ModelShape) -> int:
    """Weights of the decoder's ``nn.Linear`` projections (what 4-bit loading quantises; biases, norms,
    embeddings and the LM head stay in the load dtype): ``L * (H*dq + 2*H*dkv + dq*H)`` plus ``3*H*I``
    per dense MLP. A MoE block's experts and router are 3-D / plain parameters in transformers 5, not
    linear layers, so they are not counted here (they stay in the load dtype)."""
    H, I, dq, dkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    dense_layers = shape.layers - (shape.moe_layers if shape.is_moe else 0)
    return shape.layers * (H * dq + 2 * H * dkv + dq * H) + dense_layers * 3 * H * I


def lora_param_count(shape: ModelShape, rank: int, vision: bool = True) -> int:
    """LoRA parameters of PEFT's ``"all-linear"`` (every linear layer of the decoder, not the LM head;
    on a vision-language model also the vision tower's and mergers' linears, unless ``vision=False``:
    adapters on the text decoder only, e.g. its seven projections by name).

    A LoRA pair on a ``[in -> out]`` linear has ``r * (in + out)`` parameters, so per layer::

        r * [(H + dq) + 2 (H + dkv) + (dq + H)]  +  r * [2 (H + I) + (I + H)] (the MLP)

    On Qwen3-MoE and Mixtral PEFT maps the per-expert names (Mixtral: ``w1``/``w3``/``w2``) onto
    the fused 3-D experts instead: the
    experts of every sparse layer (gate/up at rank ``2 r``, see :func:`expert_lora_param_count`) and the
    router (``r (H + E)``). PEFT 0.21 then no longer finds the dense MLPs' projections; 0.22 adapts them too
    (:func:`peft_adapts_dense_mlps_of_moe_models`). The released models have none: every layer is sparse.
    On gpt-oss, whose experts and router are plain parameters PEFT has no mapping for, ``"all-linear"`` is
    the attention projections only.
    """
    towers = vision_lora_param_count(shape.vision, rank) if vision and shape.vision is not None else 0
    return _text_lora_param_count(shape, rank) + towers


def _text_lora_param_count(shape: ModelShape, rank: int) -> int:
    H, I, dq, dkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    attention = rank * ((H + dq) + 2 * (H + dkv) + (dq + H)) * shape.layers
    mlp = rank * (2 * (H + I) + (I + H))  # a dense gated MLP's gate, up and down
    if not shape.is_moe:
        return attention + mlp * shape.layers
    dense_layers = shape.layers - shape.moe_layers
    if shape.model_type not in PEFT_MAPS_EXPERT_NAMES:
        return attention + mlp * dense_layers
    router = rank * (H + shape.experts) * shape.moe_layers
    dense = mlp * dense_layers if peft_adapts_dense_mlps_of_moe_models() else 0
    return attention + expert_lora_param_count(shape, rank, gate_up_rank=2 * rank) + router + dense


@functools.cache  # the installed PEFT does not change within a process; the planner's searches ask many times
def peft_adapts_dense_mlps_of_moe_models() -> bool:
    """Whether the installed PEFT's ``"all-linear"`` on Qwen3-MoE / Mixtral also adapts the projections of the
    dense MLP layers (``mlp_only_layers``) beside the fused experts: from PEFT 0.22, which maps the experts through
    ``target_parameters`` and keeps the projection names in ``target_modules``; 0.21 replaced the names. Without
    PEFT installed: the newer behaviour."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("peft")
    except PackageNotFoundError:
        return True
    from packaging.version import Version

    return Version(installed) >= Version("0.22.0.dev0")


def expert_lora_param_count(shape: ModelShape, rank: int, gate_up_rank: int | None = None) -> int:
    """LoRA parameters PEFT adds on the fused experts of every sparse layer: a ``[E, a, b]`` parameter
    gets ``r * E * (a + b)``, so ``E * (r_gu (2 I_e + H) + r (H + I_e))`` per sparse layer.
    ``gate_up_rank``: ``rank`` with explicit ``target_parameters``; PEFT gives ``2 * rank`` where it
    maps ``gate_proj`` + ``up_proj`` (each rank ``r``) onto the fused ``gate_up_proj``."""
    if not shape.is_moe:
        return 0
    H, Ie = shape.hidden, shape.expert_intermediate
    r_gu = rank if gate_up_rank is None else gate_up_rank
    return shape.experts * (r_gu * (2 * Ie + H) + rank * (H + Ie)) * shape.moe_layers
