"""One record per supported architecture family: everything swiftune needs to know about it.

Patching, the batch-layout decision, the fast rollout engine and offloaded checkpointing all
read these records instead of keeping tables of their own, so supporting another family is one
:class:`Family` entry in :data:`FAMILIES` (keyed by ``config.model_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


def layer_window(module: nn.Module) -> int | None:
    """Sliding window of an attention layer that knows its own type (Qwen2/3, Gemma 2/3: layer_types)."""
    return getattr(module, "sliding_window", None)


def config_window(module: nn.Module) -> int | None:
    """Mistral: one window for every layer, from the config."""
    return getattr(module.config, "sliding_window", None)


def no_window(module: nn.Module) -> None:
    """Families whose attention is never windowed."""
    return None


@dataclass(frozen=True)
class ExpertsSpec:
    """How a family's experts module (``{prefix}Experts``) stores its fused 3-D weights.

    Attributes:
        transposed: ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (gpt-oss: ``x @ W_e``) rather
            than ``[E, 2I, H]`` / ``[E, H, I]`` (Qwen3-MoE: ``x @ W_e^T``).
        interleaved: gate and up columns alternate and the module's own ``_apply_gate`` activates
            them (gpt-oss's clamped SwiGLU); else the first half is the gate (``act_fn(gate) * up``).
        biased: ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` (gpt-oss).
    """

    transposed: bool = False
    interleaved: bool = False
    biased: bool = False


@dataclass(frozen=True)
class RouterSpec:
    """How a family's router (``{prefix}TopKRouter``) turns its logits into routing weights, so that the
    rollout engine's one-launch top-k (:func:`swiftune.kernels.moe_router.moe_router_topk`) computes what
    the router's own forward does.

    Attributes:
        order: ``"softmax_first"`` (softmax over all experts, then top-k: Qwen3-MoE, Mixtral) or
            ``"topk_first"`` (top-k of the logits, then a softmax over those k: gpt-oss).
        normalize_attr: the router attribute that says whether the top-k probabilities are
            renormalised (Qwen3-MoE's ``norm_topk_prob``); ``None``: always (Mixtral, Qwen3-VL-MoE).
        float32_weights: the weights stay float32 (Mixtral) rather than being cast to the logits' dtype.
    """

    order: str = "softmax_first"
    normalize_attr: str | None = None
    float32_weights: bool = False


@dataclass(frozen=True)
class Family:
    """What swiftune knows about one architecture family.

    Attributes:
        model_type: ``config.model_type`` of the family's text decoder (the key of :data:`FAMILIES`).
        prefix: class-name prefix of the family's modules (``Qwen3`` -> ``Qwen3Attention``,
            ``Qwen3MLP``, ``Qwen3RMSNorm``, ``Qwen3DecoderLayer``).
        window: reads an attention layer's sliding window the way the family's own forward does.
        softcap: whether the attention call passes ``attn_logit_softcapping`` (Gemma 2 does;
            Gemma 3 has the attribute but does not pass it).
        norm_offset: 1.0 for Gemma's ``(1 + w)`` RMSNorm, else 0.0.
        embed_scale: whether the decoder multiplies the embeddings by ``sqrt(hidden_size)``
            (Gemma); newer transformers do it inside the embedding module (``embed_scale``),
            older ones in the decoder's forward, which the rollout engine does not run.
        pre_norm: whether every decoder layer is exactly ``h + attn(norm_1(h))`` then
            ``h + mlp(norm_2(h))`` (no norms after attention or MLP), which lets the rollout
            engine fold each residual add into the next norm.
        mlp_output_feeds_only_residual: whether the MLP's output feeds nothing but the residual
            add (no norm after the MLP saving it for backward), so a checkpoint recompute may skip
            computing a tiled MLP's output.
        fast_rollout: whether the fast rollout engine can run the family's decoder.
        moe: whether the decoder's feed-forward blocks are (mostly) sparse mixture-of-experts blocks
            with a router (``output_router_logits``, the load-balancing auxiliary loss).
        experts: the layout of the family's experts module, whose forward swiftune replaces with
            grouped GEMMs (:mod:`swiftune.models.experts`); ``None`` for dense families.
        router: how the family's router computes its routing weights (:class:`RouterSpec`), for the
            rollout engine's fused top-k; ``None`` for dense families.
        gated_mlp: whether the module named :attr:`mlp_class` is a dense gated MLP
            (``gate_proj``/``up_proj``/``down_proj``/``act_fn``) that the fused SwiGLU/GeGLU forward
            replaces; gpt-oss's ``GptOssMLP`` is its MoE block (router + experts) instead.
        vision_language: whether ``model_type`` is a vision-language model's (composite config with a
            ``vision_config``): only its text decoder is patched (:mod:`swiftune.models.qwen3_vl`).
    """

    model_type: str
    prefix: str
    window: Callable[[nn.Module], int | None] = no_window
    softcap: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False
    pre_norm: bool = False
    mlp_output_feeds_only_residual: bool = False
    fast_rollout: bool = True
    moe: bool = False
    experts: ExpertsSpec | None = None
    router: RouterSpec | None = None
    gated_mlp: bool = True
    vision_language: bool = False

    @property
    def attention_class(self) -> str:
        return f"{self.prefix}Attention"

    @property
    def mlp_class(self) -> str:
        return f"{self.prefix}MLP"

    @property
    def norm_class(self) -> str:
        return f"{self.prefix}RMSNorm"

    @property
    def experts_class(self) -> str:
        return f"{self.prefix}Experts"

    @property
    def router_class(self) -> str:
        """The MoE router module (its forward returns the router logits first)."""
        return f"{self.prefix}TopKRouter"

    @property
    def decoder_layer_class(self) -> str:
        return f"{self.prefix}DecoderLayer"


def _plain(model_type: str, prefix: str, window: Callable[[nn.Module], int | None] = no_window) -> Family:
    """A Llama-style family: pre-norm layers, plain RMSNorm, no embedding scale."""
    return Family(model_type, prefix, window=window, pre_norm=True, mlp_output_feeds_only_residual=True)


def _gemma(model_type: str, prefix: str, window: Callable[[nn.Module], int | None] = no_window,
           softcap: bool = False) -> Family:
    """A Gemma family: ``(1 + w)`` norms, scaled embeddings; Gemma 2/3 add norms after attention and MLP."""
    return Family(model_type, prefix, window=window, softcap=softcap, norm_offset=1.0, embed_scale=True)


def _qwen3_moe() -> Family:
    """Qwen3-MoE: Qwen3's attention (q/k norm) and norms; in the sparse MoE block the router stays
    transformers' and the fused 3-D experts run as grouped GEMMs (:mod:`swiftune.models.experts`);
    layers listed in ``mlp_only_layers`` keep a dense ``Qwen3MoeMLP``, which is fused as usual.

    Not ``mlp_output_feeds_only_residual``: the offloaded-checkpoint recompute may skip a tiled MLP's
    output only where the MLP is a dense MLP, and this family's ``mlp`` is mostly the MoE block.
    On the fast rollout engine: its layers run the model's own MoE block, whose experts route on the
    device inside the decode step's CUDA graph (:func:`swiftune.models.experts.rollout_experts`).
    """
    return Family("qwen3_moe", "Qwen3Moe", window=layer_window, pre_norm=True, moe=True, experts=ExpertsSpec(),
                  router=RouterSpec(normalize_attr="norm_topk_prob"))


def _gpt_oss() -> Family:
    """gpt-oss: biased q/k/v/o projections, one attention-sink logit per head (``sinks``, passed to the
    attention function as ``s_aux``), sliding (128) and full layers alternating (``layer_types``; each
    layer's ``sliding_window``), YaRN RoPE (cos/sin from transformers' rotary module, half width),
    every layer a MoE block (``GptOssMLP``: router with bias, experts with biases and clamped SwiGLU,
    the experts as grouped GEMMs; its forward also returns the router scores). On the fast rollout
    engine: the sinks join its prefill and decode attention, each layer keeps its own window."""
    return Family("gpt_oss", "GptOss", window=layer_window, pre_norm=True, moe=True, gated_mlp=False,
                  experts=ExpertsSpec(transposed=True, interleaved=True, biased=True),
                  router=RouterSpec(order="topk_first"))


def _mixtral() -> Family:
    """Mixtral: Mistral's attention (no q/k norm, one sliding window for every layer from the config,
    ``None`` in the released checkpoints) and norms; every layer a sparse MoE block whose router stays
    transformers' (``MixtralTopKRouter``: softmax, top-k, renormalised) and whose fused 3-D experts
    (``MixtralExperts``, Qwen3-MoE's layout: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) run
    as grouped GEMMs. No dense ``MixtralMLP`` exists. On the fast rollout engine as Qwen3-MoE."""
    return Family("mixtral", "Mixtral", window=config_window, pre_norm=True, moe=True, experts=ExpertsSpec(),
                  router=RouterSpec(float32_weights=True), gated_mlp=False)


def _qwen3_vl() -> Family:
    """Qwen3-VL (dense): the text decoder is Qwen3's (q/k norm, SwiGLU, pre-norm layers, modules
    ``Qwen3VLText*``) with multimodal RoPE from its own rotary module; the vision tower stays
    transformers'. ``fast_rollout=False``: the text engine cannot prefill image prompts; the vision
    engine built on it (``rl/rollout/vision_fast.py``) prefills through the model's own forward and
    decodes with the text engine's step (docs/vision.md)."""
    return Family("qwen3_vl", "Qwen3VLText", pre_norm=True, mlp_output_feeds_only_residual=True,
                  fast_rollout=False, vision_language=True)


def _qwen3_vl_moe() -> Family:
    """Qwen3-VL-MoE: Qwen3-VL's vision tower and M-RoPE text decoder with Qwen3-MoE's sparse blocks
    (router ``Qwen3VLMoeTextTopKRouter`` stays transformers'; fused experts ``[E, 2I, H]`` / ``[E, H, I]``,
    Qwen3-MoE's layout, as grouped GEMMs). Rolled out as Qwen3-VL (``fast_rollout=False`` for the text engine)."""
    return Family("qwen3_vl_moe", "Qwen3VLMoeText", pre_norm=True, moe=True, experts=ExpertsSpec(),
                  router=RouterSpec(), fast_rollout=False, vision_language=True)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _plain("llama", "Llama"),
        _plain("mistral", "Mistral", window=config_window),
        _plain("qwen2", "Qwen2", window=layer_window),
        _plain("qwen3", "Qwen3", window=layer_window),
        _gemma("gemma", "Gemma"),
        _gemma("gemma2", "Gemma2", window=layer_window, softcap=True),
        _gemma("gemma3_text", "Gemma3", window=layer_window),
        _qwen3_moe(),
        _gpt_oss(),
        _qwen3_vl(),
        _qwen3_vl_moe(),
        _mixtral(),
    )
}


def family_of(config: object) -> Family | None:
    """The record of ``config``'s family (a model config, or anything with ``model_type``), or ``None``."""
    return FAMILIES.get(getattr(config, "model_type", None))


def supported_model_types() -> str:
    """The supported ``model_type`` values, sorted and comma-separated (for messages)."""
    return ", ".join(sorted(FAMILIES))


def decoder_layers_whose_mlp_feeds_only_the_residual() -> frozenset[str]:
    """Decoder-layer class names of the families with :attr:`Family.mlp_output_feeds_only_residual`."""
    return frozenset(f.decoder_layer_class for f in FAMILIES.values() if f.mlp_output_feeds_only_residual)
