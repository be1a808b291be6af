"""Memory planner: the peak GPU memory of one training step, predicted from the config alone.

Everything here is a pure function of a model's shape and a few training choices; nothing is
allocated.  :func:`plan_memory` returns a :class:`MemoryPlan` broken down by component,
:func:`max_tokens` bisects it for the longest context that fits (model shapes: :mod:`.shapes`;
the ``swiftune plan`` command: :mod:`.cli`).  The formulas are written out in ``docs/memory.md``; the short form,
with ``T`` tokens in the step, ``L`` layers, hidden ``H``, intermediate ``I``, ``nq``/``nkv``
heads of ``d``, vocabulary ``V``, ``b`` bytes per weight/activation element (2: bf16) and ``P``
parameters::

    weights       = P b
    LoRA          = P_lora (lb + lb + 8)               params + grads + AdamW m, v (fp32)
    full FT       = P b (grads) + P s_opt              s_opt = 8 (AdamW, fp32 states)
    checkpoints   = L_gpu T H b                        the saved layer inputs kept on the GPU
    layer         = max(MLP phase, attention phase)    one layer recomputed and backpropagated
    loss          = T H b (x3) + c V b                 fused chunked CE, chunk c (full logits: T V (b + 12))
    vision        = the vision tower's saved tensors    Qwen3-VL: image_tokens x merge^2 patches
    overhead      = context + 5% of activations
    per rank, N processes (``world_size``): FSDP2 (``fsdp=True``) divides weights, trainable params,
    grads and optimizer states by N and adds the parameters it gathers (the root module's embeddings,
    LM head and final norm, plus two decoder layers; full FT: their unsharded grads too); DDP
    replicates them all and adds its gradient buckets (one more copy of the trainable grads);
    activations are per rank (``tokens``: one process's tokens); pinned host memory is per rank too:
    the ranks of one host share it (``host_bytes // ranks_per_host`` each)

The checkpointing module uses :func:`layer_working_set` and :func:`step_reserve` to decide how
many layer inputs it may keep on the GPU (``swiftune.training.checkpointing``).

Layering: pure Python, nothing from swiftune outside this package and no torch, so every layer
may use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .shapes import (KNOWN_MODELS, PEFT_MAPS_EXPERT_NAMES, ModelShape, VisionShape, expert_lora_param_count,
                     linear_weight_count, lora_param_count, model_shape, param_count, vision_param_count)

GiB = 2**30

#: Bytes the CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's bookkeeping take
#: outside ``torch.cuda.memory_allocated`` (measured order of magnitude on H100/H200, CUDA 12-13).
CUDA_CONTEXT_BYTES = int(0.75 * GiB)

#: Fragmentation of the caching allocator, as a fraction of the activation bytes (long-context
#: steps allocate and free multi-GB blocks of a few sizes; 5% is the usual reserved/allocated gap).
FRAGMENTATION = 0.05


def offload_margin_bytes(gpu_bytes: int) -> int:
    """GPU memory the offloaded checkpointing leaves unused when it sizes its budget: 5% of the GPU
    + 1 GiB (headroom for allocator rounding and whatever the step allocates beyond the plan).
    The planner's offload split uses the same margin, so it predicts the layers the run keeps."""
    return int(0.05 * gpu_bytes) + GiB


#: Size of one pinned host page of offloaded checkpointing (a power of two: PyTorch's pinned
#: allocator rounds up to those; :class:`swiftune.training.offload_memory.PagePool` holds them).
PAGE_BYTES = 64 * 2**20


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages of ``page_bytes`` that hold ``nbytes``."""
    return -(-nbytes // page_bytes) if nbytes > 0 else 0


def choose_page_bytes(layer_bytes: int, page_bytes: int = PAGE_BYTES) -> int:
    """``page_bytes``, or the next power of two of a smaller layer (tiny layers: one small page)."""
    if layer_bytes <= 0:
        return page_bytes
    return min(page_bytes, 1 << max(0, (layer_bytes - 1).bit_length()))


def pinned_slot_bytes(layer_bytes: int, page_bytes: int = PAGE_BYTES) -> int:
    """Pinned host memory one offloaded layer input takes: whole pages (the runtime's
    ``split_layers`` and the planner count host room in these)."""
    page = choose_page_bytes(layer_bytes, page_bytes)
    return pages_for(layer_bytes, page) * page


def host_share_bytes(host_bytes: int, ranks_on_host: int) -> int:
    """One rank's share of host memory that ``ranks_on_host`` processes of a job on one host share.

    Every rank pins its own offloaded layer inputs, so a rank that budgeted all of the host's free
    memory would let N ranks pin N times what is there; each gets ``host_bytes // ranks_on_host``.
    The runtime's host budget (``swiftune.training.offload_memory.host_available_bytes``) and
    :func:`plan_memory` both divide this way.
    """
    if not isinstance(ranks_on_host, int) or isinstance(ranks_on_host, bool) or ranks_on_host < 1:
        raise ValueError(f"ranks_on_host must be a whole number of processes >= 1, got {ranks_on_host!r}")
    return max(0, int(host_bytes)) // ranks_on_host


def derived_input_count(num_layers: int, offloaded: int, host_holds: int) -> int:
    """How many of the ``offloaded`` layer inputs are *derived* (stored nowhere, recomputed from
    the layer before in backward) when the host holds only ``host_holds`` of them: the missing
    ones, if that is at most every second layer; else 0 (the step does not fit). The runtime
    (:func:`swiftune.training.offload_memory.split_layers`) and the planner use this one rule."""
    missing = offloaded - max(0, host_holds)
    return missing if 0 < missing <= num_layers // 2 else 0


#: Default token chunk of the fused loss when none is given: the upper clamp of
#: :func:`swiftune.losses.choose_chunk_tokens` (``losses.chunking.MAX_CHUNK_TOKENS``, what it picks
#: whenever a few GB are free; kept a literal so that the planner imports no torch).
DEFAULT_LOGIT_CHUNK = 1024

#: Tokens per tile of the tiled MLP, default: a tile's intermediate buffers are about 1 GiB
#: (see :func:`swiftune.models.tiled_mlp.auto_tile_tokens`, the same formula).
TILE_BYTES = 1 * GiB

# ----------------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class TrainSetup:
    """Training choices that change activation memory.

    Attributes:
        lora_rank: LoRA rank on all linear layers (ignored with ``full_finetune``).
        full_finetune: every parameter trainable (no LoRA).
        dtype_bytes: bytes of a weight / activation element (2: bf16).
        lora_dtype_bytes: bytes of a LoRA weight.  PEFT's default (``autocast_adapter_dtype=True``)
            keeps adapters in float32 (4): each LoRA linear then saves a float32 copy of its input.
        tiled_mlp: the MLP runs in sequence tiles (:mod:`swiftune.models.tiled_mlp`).
        mlp_tile_tokens: tokens per tile (``None``: the ~1 GiB automatic choice).
        tiled_projections: the LoRA q/k/v/o projections run in tiles too (saves their casts).
        kv_expanded: attention saves K and V expanded to the query heads (torch 2.11's
            ``varlen_attn`` has no GQA flag, so swiftune repeats K/V heads); ``False`` for GQA
            kernels (flash-attn, later torch, flex attention).
        float32_dq: attention's backward accumulates the query gradient in float32 (flash-attn and
            torch's flash / varlen kernels); ``False`` for flex attention, whose backward writes it
            in the activation dtype.
        attention_out_copy: the attention output the next projection saves is a copy of the one
            attention saved (per-document sdpa concatenates its documents' outputs): ``dq b`` more
            a token.
        float32_dq_tokens: the float32 dq accumulator covers at most this many tokens at a time
            (per-document sdpa: the longest document); ``None``: the whole row (varlen, flash).
        attention_group_elements: a q of more elements than this runs in groups of heads (flex, whose
            int32 offsets stop at 2^31: ``attention.backends.flex_in_head_groups``): the layer being
            recomputed keeps the joined output beside the groups' (``dq b`` a token) and its backward joins
            the groups' dq into one more (``dq b``); ``None``: never split.
        chunked_loss: swiftune's fused chunked cross entropy; ``False``: full logits +
            ``F.cross_entropy`` (the transformers baseline).
        logit_chunk_tokens: token chunk of the fused loss (``None``: :data:`DEFAULT_LOGIT_CHUNK`).
        autocast: the step runs under ``torch.autocast`` to the activation dtype (``bf16=True`` in
            the trainers).  If PEFT casts each LoRA input to the adapters' dtype, autocast casts
            it back for the matmul, so what is saved is an activation-dtype copy (and the
            rank-``r`` intermediate in that dtype too), not a float32 one.
        lora_input_casts: PEFT copies each LoRA input to the adapters' dtype (its default).  The
            swiftune trainers switch that off for bf16/fp16 training steps
            (:mod:`swiftune.training.lora_casting`); without autocast the copy is what the float32
            matmul reads, so it stays.
        train_vision: a vision-language model's vision tower and mergers train (PEFT's ``"all-linear"``
            adapts their linears too; full fine-tuning trains them), so their blocks save tensors for
            backward (checkpointed per block, as transformers' checkpointing does); ``False``: adapters
            on the text decoder only, the tower runs without a graph.
        lora_experts: LoRA on the stacked expert weights of a mixture-of-experts model through explicit
            ``target_parameters`` (``mlp.experts.gate_up_proj`` and ``down_proj``, both at rank ``r``), where
            ``"all-linear"`` does not reach them (gpt-oss); on Qwen3-MoE and Mixtral PEFT's all-linear adapts
            them already (counted either way). Their activations (rank ``r`` per routed token) are left out.
    """

    lora_rank: int = 16
    full_finetune: bool = False
    dtype_bytes: int = 2
    lora_dtype_bytes: int = 4
    tiled_mlp: bool = True
    mlp_tile_tokens: int | None = None
    tiled_projections: bool = False
    kv_expanded: bool = True
    float32_dq: bool = True
    attention_out_copy: bool = False
    float32_dq_tokens: int | None = None
    attention_group_elements: int | None = None
    chunked_loss: bool = True
    logit_chunk_tokens: int | None = None
    autocast: bool = False
    lora_input_casts: bool = True
    train_vision: bool = True
    lora_experts: bool = False

    @property
    def lora(self) -> bool:
        return not self.full_finetune and self.lora_rank > 0

    @property
    def lora_copies_input(self) -> bool:
        """Each LoRA layer makes its own copy of its input in the adapters' dtype (and a gradient
        of it in backward): adapters in another dtype than the activations, PEFT's input cast
        not switched off under autocast. Otherwise the adapters read the base layer's input."""
        return (self.lora and self.lora_dtype_bytes != self.dtype_bytes
                and (self.lora_input_casts or not self.autocast))


def auto_tile_tokens(intermediate: int, hidden: int, dtype_bytes: int = 2, tile_bytes: int = TILE_BYTES) -> int:
    """Tokens per MLP tile so that one tile's buffers take about ``tile_bytes``.

    Per token a tile holds gate, up and the activation (``3 I b``), a float32 LoRA copy of the
    activation and its gradient (``2 I 4``, the worst case) and a few hidden-sized rows
    (``4 H 4``).  Rounded down to a multiple of 256 tokens, at least 256.
    """
    per_token = intermediate * (3 * dtype_bytes + 8) + hidden * 16
    tile = int(tile_bytes // max(per_token, 1))
    return max(256, tile - tile % 256)


def _lora_input_bytes(width: int, s: TrainSetup) -> int:
    """Per-token bytes a LoRA pair saves beyond its base layer: ``r`` outputs of A, and a cast
    copy of the input when the adapter dtype differs from the activation dtype (under autocast
    both are in the activation dtype: the matmuls run there; with the casts switched off under
    autocast, the adapters save the base layer's input itself)."""
    saved_bytes = s.dtype_bytes if s.autocast else s.lora_dtype_bytes
    cast = width * saved_bytes if s.lora_copies_input else 0
    return cast + s.lora_rank * saved_bytes


def _saved_per_token(shape: ModelShape, s: TrainSetup) -> tuple[int, int]:
    """(attention half, MLP half) of the per-token bytes a layer saves, its input excluded.

    Per token (patched model: fused RMSNorm saves its input and a float32 ``rstd``; fused RoPE
    saves only cos/sin; packed flash attention saves q, k, v, out and a float32 log-sum-exp;
    frozen linears save no input)::

        attention half
          norm 1     4                                                    rstd (input = the checkpoint)
          q/k/v in   full FT: H b;  LoRA: 3 (cast(H) + r lb)  (tiled: H b)
          q/k norm   (dq + dkv) b + (nq + nkv) 4                          Qwen3 / Gemma 3
          attention  (dq + 2 kv') b + dq b + nq 4                         kv' = dq if K/V expanded
          out copy   dq b                                                 per-document sdpa's concatenation
          o in       LoRA: cast(dq) + r lb  (tiled / full FT: 0, shares attention's out)
        MLP half
          norm 2     H b + 4                                              the residual it normalises
          Gemma 2/3  (H b + 4) per extra norm
          MLP        tiled: H b;  full FT: H b + 3 I b;  LoRA: 2 (cast(H) + r lb) + 2 I b + cast(I) + r lb
          experts    I is k I_e (k experts of width I_e per token), plus the routing E 4 + k (8 + 2 4) + 4;
                     untiled also k (2 8 + 2 H b): per routed row the sort's indices, the gathered input
                     and the expert output (tiled, they live in a tile)

    ``cast(w) = w lb`` when each LoRA layer copies its input (:attr:`TrainSetup.lora_copies_input`:
    PEFT's float32 adapters, casts not switched off), else 0; then the adapters save the shared
    input itself.
    """
    H, I, b = shape.hidden, shape.active_intermediate, s.dtype_bytes
    dq, dkv = shape.q_dim, shape.kv_dim
    kvx = dq if s.kv_expanded else dkv
    attn = 4
    if s.lora and not s.tiled_projections:
        attn += 3 * _lora_input_bytes(H, s) + _lora_input_bytes(dq, s)
        if not s.lora_copies_input:
            attn += H * b  # the adapters save the (shared) normed input itself
    else:
        attn += H * b  # q/k/v input (full FT: for weight grads; tiled: the tile function's input)
    if shape.qk_norm:
        attn += (dq + dkv) * b + (shape.heads + shape.kv_heads) * 4
    attn += (dq + 2 * kvx) * b + dq * b + shape.heads * 4
    if s.attention_out_copy:
        attn += dq * b
    mlp = H * b + 4 + (shape.norms_per_layer - 2) * (H * b + 4)
    if s.tiled_mlp:
        mlp += H * b
    elif s.lora:
        mlp += 2 * _lora_input_bytes(H, s) + 2 * I * b + _lora_input_bytes(I, s)
        if not s.lora_copies_input:
            mlp += H * b + I * b
    else:
        mlp += H * b + 3 * I * b
    if shape.is_moe:
        # the routing, tiled or not: the router's float32 probabilities over the experts, the chosen
        # experts' indices, their weights before and after renormalising and the renormalising sum
        mlp += shape.experts * 4 + shape.experts_per_token * (8 + 2 * 4) + 4
    if shape.is_moe and not s.tiled_mlp:
        # untiled, per routed row (the rest lives inside a tile): the sort's two int64 indices, the row's
        # gathered input (for the expert weights' gradients: trained or adapted experts; counted for frozen
        # ones too) and its expert output (for the routing weight's gradient)
        mlp += shape.experts_per_token * (2 * 8 + 2 * H * b)
    return attn, mlp


def layer_saved_bytes(shape: ModelShape, tokens: int, s: TrainSetup) -> int:
    """Bytes one decoder layer's forward saves for its backward, its own input excluded
    (both halves of :func:`_saved_per_token`)."""
    attn, mlp = _saved_per_token(shape, s)
    return tokens * (attn + mlp)


def _mlp_tile(shape: ModelShape, tokens: int, s: TrainSetup) -> int:
    # a MoE token goes through k experts: the tiled experts size their tiles from k * I_e (models.tiled_mlp)
    tile = s.mlp_tile_tokens or auto_tile_tokens(shape.active_intermediate, shape.hidden, s.dtype_bytes)
    return min(tokens, tile)


def layer_working_set(shape: ModelShape, tokens: int, s: TrainSetup) -> int:
    """Peak bytes of one layer being recomputed and backpropagated: the larger of two phases.

    MLP phase (first in backward): everything the layer saved, the incoming gradient and the
    gradient of the MLP input (``2 H b`` per token), plus either one tile's buffers (tiled:
    ``tile (3 I b + 2 I 4 + 4 H 4)``, constant in T) or the gradients of gate, up, act
    (``3 I b``) and, for float32 LoRA, the float32 gradient of the cast copy (``I 4``).

    Attention phase: the attention half of the saved tensors (the MLP half is freed by then),
    the running gradient (``2 H b``), the gradient of the attention output (``dq b``),
    dq/dk/dv (``(dq + 2 kv') b``), flash attention's float32 dq accumulator (``dq 4``; not with
    flex, ``float32_dq=False``; for ``float32_dq_tokens`` tokens only with per-document sdpa) and
    ``nq 4`` softmax terms, plus for untiled float32 LoRA the
    float32 output gradient and input-cast gradient of the widest projection (``(H + dq) 4``), and
    where attention runs in head groups (``attention_group_elements``) ``2 dq b`` more.
    """
    H, I, b = shape.hidden, shape.active_intermediate, s.dtype_bytes
    dq, dkv = shape.q_dim, shape.kv_dim
    kvx = dq if s.kv_expanded else dkv
    fp32 = 4
    attn_saved, mlp_saved = _saved_per_token(shape, s)
    mlp_phase = tokens * (attn_saved + mlp_saved + 2 * H * b)
    if s.tiled_mlp:
        mlp_phase += _mlp_tile(shape, tokens, s) * (3 * I * b + 2 * I * fp32 + 4 * H * fp32)
    else:
        mlp_phase += tokens * (3 * I * b + (I * fp32 if s.lora_copies_input else 0))
    attn_phase = tokens * (attn_saved + 2 * H * b + dq * b + (dq + 2 * kvx) * b + shape.heads * fp32)
    if s.float32_dq:  # for the whole row, or one document at a time
        attn_phase += dq * fp32 * (tokens if s.float32_dq_tokens is None else min(tokens, s.float32_dq_tokens))
    if not s.tiled_projections and s.lora_copies_input:
        attn_phase += tokens * (H + dq) * fp32
    if s.attention_group_elements is not None and tokens * dq > s.attention_group_elements:
        attn_phase += 2 * tokens * dq * b  # attention in head groups: the joined output and the joined dq
    return max(mlp_phase, attn_phase)


def layer_backward_bytes(shape: ModelShape, tokens: int, s: TrainSetup) -> int:
    """Transient bytes of one layer's backward on top of everything it saved (working set - saved)."""
    return layer_working_set(shape, tokens, s) - layer_saved_bytes(shape, tokens, s)


def loss_bytes(shape: ModelShape, tokens: int, s: TrainSetup) -> int:
    """Bytes of the LM head + loss at their peak (while every checkpoint is alive).

    Chunked (swiftune's fused cross entropy, gradients computed in forward): the final norm's
    saved input and its output, the ``dL/dhidden`` buffer (``3 T H b``), and one chunk of ``c``
    tokens: its logits block (``c V b``, softmax-minus-onehot written over it in place) and the
    chunk's hidden rows and their gradient (``2 c H b``); a trainable LM head adds its float32
    gradient accumulator (``V H 4``).

    Full logits (plain ``F.cross_entropy(logits.float())``): ``T H b`` for the final norm input plus
    ``T V (b + 12)``: the bf16 logits, their float32 copy's log-softmax (saved) and, in backward,
    two float32 gradient blocks.
    """
    H, V, b = shape.hidden, shape.vocab, s.dtype_bytes
    if not s.chunked_loss:
        return tokens * H * b * 2 + tokens * V * (b + 12)
    c = min(tokens, s.logit_chunk_tokens or DEFAULT_LOGIT_CHUNK)
    head = V * H * 4 if s.full_finetune else 0
    return 3 * tokens * H * b + c * V * b + 2 * c * H * b + head


def _vision_saved_per_patch(v: VisionShape, s: TrainSetup) -> int:
    """Bytes one vision block saves per patch when the tower trains, its input excluded (measured
    with autograd's saved-tensor hooks in tests/test_planner_vision.py)::

        LayerNorms     Hv b + 2 (4 + 4)                the second's input; float32 mean and rstd of both
        RoPE           2 d 4                           float32 cos and sin (q and k rotate in float32)
        attention      2 Hv b + 3 Hv b + Hv b + nh 4   rotated q and k, the qkv output (v is a view of
                                                       it), the per-image outputs, the log-sum-exp
        GELU           Iv b                            its input
        linear inputs  (3 Hv + Iv) b                   qkv, proj (the concatenated outputs), fc1, fc2:
                                                       full FT, or LoRA whose adapters read them
                       3 lora(Hv) + lora(Iv)           LoRA: rank-r outputs, cast copies (which replace
                                                       the inputs above when the adapters copy theirs)
    """
    H, I, b = v.hidden, v.intermediate, s.dtype_bytes
    saved = H * b + 16 + 2 * (H // v.heads) * 4 + 6 * H * b + v.heads * 4 + I * b
    inputs = (3 * H + I) * b
    if s.full_finetune:
        return saved + inputs
    saved += 3 * _lora_input_bytes(H, s) + _lora_input_bytes(I, s)
    return saved + (0 if s.lora_copies_input else inputs)


def vision_activation_bytes(shape: ModelShape, image_tokens: int, s: TrainSetup,
                            gradient_checkpointing: bool | str = True) -> tuple[int, int]:
    """``(saved, working)`` bytes of a vision-language model's vision tower for ``image_tokens`` merged
    image tokens in the step (``P = image_tokens merge^2`` patches). ``saved`` lives through the step,
    ``working`` is the peak of one block (added to the step as the larger of it, one decoder layer and
    the loss: the tower runs before the decoder's forward and after its backward).

    Always saved: the float32 pixel values (``P C t p^2 4``) and the mergers' outputs
    (``(1 + deepstack) image_tokens Out b``: the deepstack features wait for their decoder layers).
    Tower training (:attr:`TrainSetup.train_vision` or full fine-tuning): each block's input
    (``depth P Hv b``, checkpointed as transformers checkpoints the vision blocks, ``"offload"``
    included) or, without checkpointing, everything each block saves
    (:func:`_vision_saved_per_patch`), plus each merger's ``4 Hm b`` per merged token; the working set
    is one block's saved tensors and its backward's (``(5 Hv + 2 Iv) b + 4 Hv`` per patch: the
    residual gradients, dq/dk/dv, the MLP's gradients, a float32 dq accumulator). Frozen tower:
    no graph; the working set is one block's forward temporaries, ``(7 Hv + 2 Iv) b`` per patch.
    """
    v = shape.vision
    if v is None or image_tokens <= 0:
        return 0, 0
    patches, b = image_tokens * v.patches_per_token, s.dtype_bytes
    H, I = v.hidden, v.intermediate
    saved = patches * v.patch_values * 4 + (1 + v.deepstack) * image_tokens * v.out_hidden * b
    if not (s.train_vision or s.full_finetune):
        return saved, patches * (7 * H + 2 * I) * b
    per_patch = _vision_saved_per_patch(v, s)
    if gradient_checkpointing is False:
        saved += v.depth * patches * (H * b + per_patch)
    else:
        saved += v.depth * patches * H * b
    saved += (1 + v.deepstack) * image_tokens * 4 * v.merged_hidden * b
    working = patches * (per_patch + (5 * H + 2 * I) * b + 4 * H)
    return saved, working


# ------------------------------------------------------------------------------------- plan


@dataclass
class MemoryPlan:
    """Predicted peak GPU memory of one training step (bytes), by component.

    ``total`` is what the GPU must hold (allocator peak plus overhead); ``allocated`` is the
    part ``torch.cuda.max_memory_allocated`` reports.
    """

    model: str
    tokens: int
    weights: int
    trainable: int
    gradients: int
    optimizer: int
    checkpoints: int
    layer_working_set: int
    loss: int
    transfer: int
    overhead: int
    kept_layers: int
    offloaded_layers: int
    host_bytes: int
    gradient_checkpointing: bool | str
    gpu_bytes: int | None = None
    host_limit: int | None = None
    params: int = 0
    trainable_params: int = 0
    derived_layers: int = 0  # layer inputs recomputed from the layer before instead of stored
    vision: int = 0  # the vision tower's saved tensors (vision_activation_bytes)
    vision_working_set: int = 0  # one vision block at its peak
    image_tokens: int = 0
    world_size: int = 1
    ranks_per_host: int = 1  # the processes that share the host memory host_limit is one share of
    fsdp: bool = False
    distributed: int = 0  # FSDP2: the gathered (unsharded) parameters; DDP: its gradient buckets
    notes: list[str] = field(default_factory=list)

    @property
    def activations(self) -> int:
        return (self.checkpoints + max(self.layer_working_set, self.loss, self.vision_working_set) + self.transfer
                + self.vision)

    @property
    def allocated(self) -> int:
        return self.weights + self.trainable + self.gradients + self.optimizer + self.distributed + self.activations

    @property
    def total(self) -> int:
        return self.allocated + self.overhead

    @property
    def fits(self) -> bool | None:
        if self.gpu_bytes is None:
            return None
        host_ok = self.host_limit is None or self.host_bytes <= self.host_limit
        return self.total <= self.gpu_bytes and host_ok

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(activations=self.activations, allocated=self.allocated, total=self.total, fits=self.fits)
        return d

    def table(self) -> str:
        """A plain-text breakdown (GB = 1e9 bytes)."""
        rows = [
            ("weights", self.weights, f"{self.params:,} params"),
            ("trainable params (LoRA)" if self.trainable else "trainable params", self.trainable,
             f"{self.trainable_params:,} trainable"),
            ("gradients", self.gradients, ""),
            ("optimizer states", self.optimizer, ""),
            *([("FSDP2 gathered params" if self.fsdp else "DDP gradient buckets", self.distributed,
                f"per rank of {self.world_size}" + (", states sharded" if self.fsdp else ", states replicated"))]
              if self.fsdp or self.world_size > 1 else []),
            ("layer checkpoints (GPU)", self.checkpoints,
             f"{self.kept_layers} layers on GPU, {self.offloaded_layers} offloaded"
             + (f", {self.derived_layers} recomputed" if self.derived_layers else "")),
            ("one layer recompute + backward", self.layer_working_set, ""),
            ("loss / logits", self.loss, "peak is max(layer, loss)"),
            *([("vision tower activations", self.vision, f"{self.image_tokens:,} image tokens"),
               ("one vision block at its peak", self.vision_working_set, "in the same max")] if self.image_tokens else []),
            ("offload transfer buffers", self.transfer, ""),
            ("CUDA context + fragmentation", self.overhead, ""),
        ]
        out = [f"memory plan: {self.model}, {self.tokens:,} tokens, checkpointing={self.gradient_checkpointing}"]
        out.append(f"{'component':<34}{'GB':>10}  note")
        for name, value, note in rows:
            out.append(f"{name:<34}{value / 1e9:>10.2f}  {note}")
        out.append(f"{'peak allocated (torch)':<34}{self.allocated / 1e9:>10.2f}")
        out.append(f"{'peak total (GPU)':<34}{self.total / 1e9:>10.2f}"
                   + ("" if self.gpu_bytes is None else f"  of {self.gpu_bytes / 1e9:.1f}: "
                      + ("fits" if self.fits else "does NOT fit")))
        if self.host_bytes:
            out.append(f"{'pinned host memory':<34}{self.host_bytes / 1e9:>10.2f}"
                       + ("" if self.host_limit is None else f"  of {self.host_limit / 1e9:.1f}")
                       + (f" (this rank's share: the host's memory over {self.ranks_per_host} ranks)"
                          if self.host_limit is not None and self.ranks_per_host > 1 else ""))
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)


def _setup(lora_rank: int, full_finetune: bool, dtype_bytes: int, logit_chunk_tokens: int | None,
           overrides: dict[str, Any]) -> TrainSetup:
    unknown = set(overrides) - set(TrainSetup.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown plan_memory options: {sorted(unknown)}")
    return TrainSetup(lora_rank=lora_rank, full_finetune=full_finetune, dtype_bytes=dtype_bytes,
                      logit_chunk_tokens=logit_chunk_tokens, **overrides)


#: Bytes of optimizer state per trainable parameter, by optimizer name.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw_8bit": 2, "sgd": 0, "sgd_momentum": 4}
# bytes per quantised weight, quantisation constants included: bitsandbytes NF4 packs two weights a
# byte with one float32 absmax per 64 weights; double quantisation stores those absmax as 8-bit
# codes with one float32 scale per 256 of them
QUANTIZED_WEIGHT_BYTES = {"nf4": (4 + 32 / 64) / 8, "nf4_double_quant": (4 + 8 / 64 + 32 / (64 * 256)) / 8,
                          "fp8": 1.0}  # e4m3, plus one float32 scale per output row (fp8_scale_bytes)


def fp8_scale_bytes(shape: ModelShape) -> int:
    """The float32 per-row scales of ``load_in_fp8`` weights: one per output feature of each decoder
    projection, ``4 L (dq + 2 dkv + H + 2 I + H)`` bytes."""
    H, I, dq, dkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    return 4 * shape.layers * (dq + 2 * dkv + H + 2 * I + H)


def _quantized_matmul_bytes(shape: ModelShape, tokens: int, quantization: str, s: TrainSetup) -> int:
    """Temporaries of one quantised projection's matmul. bitsandbytes dequantises the weight. FP8:
    the dequantising reference holds the weight in float32 and in the compute dtype; the
    ``_scaled_mm`` path quantises the activation (or gradient) on the fly through the fused kernel
    (``kernels.fp8_quant``: its e4m3 codes only, no float32 copy; the MLP's ``[T, I]`` ones one tile at a
    time when tiled), and copies the e4m3 weight transposed in backward; the larger of the two is kept."""
    weight = shape.hidden * max(shape.intermediate, shape.q_dim)
    if quantization != "fp8":
        return weight * s.dtype_bytes
    mlp_tokens = _mlp_tile(shape, tokens, s) if s.tiled_mlp else tokens
    widest = max(tokens * max(shape.hidden, shape.q_dim), mlp_tokens * shape.intermediate)
    return max(weight * (4 + s.dtype_bytes), widest + weight)


def attention_output_bytes(heads: int, head_dim: int, tokens: int, activation_bytes: int) -> int:
    """Device bytes one layer's attention outputs kept through the recompute take for ``tokens`` query tokens
    (:mod:`swiftune.attention.kept_outputs`): the output (``heads x head_dim`` activation elements a token)
    and the float32 log-sum-exp (one a head)."""
    return int(tokens) * int(heads) * (int(head_dim) * int(activation_bytes) + 4)


def attention_output_host_bytes(heads: int, head_dim: int, tokens: int, activation_bytes: int,
                                page_bytes: int = PAGE_BYTES) -> int:
    """Pinned host bytes one layer's attention outputs take when they are kept on the host
    (``attention_outputs_on_host``): the output and the log-sum-exp, each in whole pages, and one page more:
    a layer whose documents (or shared-prompt pieces) run as several kernel calls stores each call's outputs
    in pages of their own, whose rounding the one page covers for a few long documents."""
    output = int(tokens) * int(heads) * int(head_dim) * int(activation_bytes)
    return (pinned_slot_bytes(output, page_bytes) + pinned_slot_bytes(int(tokens) * int(heads) * 4, page_bytes)
            + choose_page_bytes(output, page_bytes))


def attention_output_device_layers(layers: int, on_host: bool) -> int:
    """How many layers' kept attention outputs the device holds at once: every keeping layer's, or, kept on the
    host, two (the layer in backward and the prefetched one)."""
    return min(int(layers), 2) if on_host else int(layers)


def attention_layers_on_host(layers: int, host_room_bytes: int | None, layer_host_bytes: int) -> int:
    """How many of the ``layers`` that keep their attention outputs keep them on the host: as many as
    ``host_room_bytes`` (what the host budget leaves beside the offloaded layer inputs; ``None``: no
    limit) holds. The layer inputs come first: they are what makes the step fit, the outputs only
    spare their recompute, and a layer without room recomputes its attention."""
    if host_room_bytes is None or layer_host_bytes <= 0:
        return int(layers)
    return max(0, min(int(layers), int(host_room_bytes) // int(layer_host_bytes)))


def plan_memory(
    model_config: Any,
    tokens: int,
    lora_rank: int = 16,
    *,
    full_finetune: bool = False,
    dtype_bytes: int = 2,
    optimizer: str = "adamw",
    gradient_checkpointing: bool | str = True,
    logit_chunk_tokens: int | None = None,
    gpu_bytes: int | None = None,
    host_bytes: int | None = None,
    weight_quantization: str | None = None,
    image_tokens: int = 0,
    world_size: int = 1,
    fsdp: bool = False,
    ranks_per_host: int | None = None,
    attention_output_layers: int = 0,
    attention_outputs_on_host: bool = False,
    **setup: Any,
) -> MemoryPlan:
    """Predict the peak GPU memory of one training step (forward + loss + backward + optimizer).

    Args:
        model_config: transformers config, dict, known name or config.json path (:func:`model_shape`).
        tokens: tokens in the step (batch x sequence, padding-free).
        lora_rank: LoRA rank on all linear layers; ignored with ``full_finetune``.
        full_finetune: all parameters trained; grads in the weight dtype, optimizer states in
            float32 (``optimizer``: ``adamw`` 8 B/param, ``adamw_8bit`` 2, ``sgd`` 0).
        dtype_bytes: weight / activation element size (2 for bf16).
        gradient_checkpointing: ``True`` (every layer input kept on the GPU), ``False`` (every
            layer's saved tensors kept), ``"offload"`` (as many layer inputs on the GPU as
            ``gpu_bytes`` leaves room for, the rest in pinned host memory; with no ``gpu_bytes``
            all are offloaded).
        logit_chunk_tokens: token chunk of the fused loss (default 1024, the automatic clamp).
        gpu_bytes: GPU memory; sets ``fits`` and the offload split.
        host_bytes: the host's memory available for pinned offloaded checkpoints; sets ``fits``.
            With several ranks on the host each plans with its share (:func:`host_share_bytes`:
            ``host_bytes // ranks_per_host``, the runtime's rule), which ``host_limit`` reports.
        weight_quantization: the decoder's linear weights quantised (QLoRA): ``"nf4_double_quant"``
            (what ``load_in_4bit=True`` loads), ``"nf4"`` or ``"fp8"`` (``load_in_fp8=True``: 1 byte a
            weight and a float32 scale per output row); LoRA only. Adds the largest projection's
            matmul temporaries to the working set (:func:`_quantized_matmul_bytes`). A vision-language
            model's vision tower stays in the load dtype (only the text decoder's projections quantise).
        image_tokens: how many of ``tokens`` are merged image tokens (Qwen3-VL: an image of ``h x w``
            patches takes ``h w / merge^2``); the vision tower runs on ``image_tokens merge^2`` patches
            (:func:`vision_activation_bytes`). The tower's weights count whatever this is.
        world_size: processes (GPUs) training together; the plan is one rank's, ``tokens`` that
            rank's tokens. Without ``fsdp`` (DDP) every rank holds everything plus DDP's gradient
            buckets (a flat copy of the trainable grads: ``gradient_as_bucket_view=False``, the default).
        fsdp: FSDP2 (``fully_shard`` per decoder layer and the root): weights, trainable params,
            grads and optimizer states divided by ``world_size`` (rounded up), plus the parameters
            held gathered at once (:func:`fsdp_gathered_params`).
        ranks_per_host: the processes of the job on one host, which share its ``host_bytes``
            (torchrun's ``--nproc_per_node``); default ``world_size`` (one host).
        attention_output_layers: with ``"offload"``, the last this many layers keep their sdpa attention
            outputs on the GPU through the recompute (:func:`attention_output_bytes` each, counted in
            ``checkpoints`` and set aside before layer inputs are kept, as the runtime does).
        attention_outputs_on_host: those outputs go to pinned host memory from the forward to the
            backward instead (:func:`attention_output_host_bytes` a layer, as many layers as the host
            memory left beside the offloaded layer inputs holds: :func:`attention_layers_on_host`); the
            GPU holds the restored outputs of two layers at a time (the one in backward, the prefetched).
        **setup: further :class:`TrainSetup` fields (``tiled_mlp``, ``tiled_projections``,
            ``lora_dtype_bytes``, ``kv_expanded``, ``chunked_loss``, ``mlp_tile_tokens``).
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if gpu_bytes is not None and not gpu_bytes > 0:
        raise ValueError(f"the GPU's memory must be > 0 bytes, got {gpu_bytes} (e.g. 80 GB: gpu_gb=80)")
    if host_bytes is not None and not host_bytes >= 0:
        raise ValueError(f"the host memory for offloaded checkpoints must be >= 0 bytes (0: none), got {host_bytes}")
    if not full_finetune and not (isinstance(lora_rank, int) and not isinstance(lora_rank, bool) and lora_rank >= 1):
        raise ValueError(f"the LoRA rank must be a whole number >= 1 (e.g. 16), got {lora_rank!r}; "
                         "for full fine-tuning pass full_finetune=True (--full_finetune)")
    if logit_chunk_tokens is not None and not logit_chunk_tokens >= 1:
        raise ValueError(f"logit_chunk_tokens must be >= 1 or None (automatic), got {logit_chunk_tokens}")
    if gradient_checkpointing not in (True, False, "offload"):
        raise ValueError(f"gradient_checkpointing must be True, False or 'offload', got {gradient_checkpointing!r}")
    if attention_output_layers and gradient_checkpointing != "offload":
        raise ValueError("attention_output_layers keeps attention outputs through the offloaded checkpointing's "
                         "recompute: it needs gradient_checkpointing='offload'")
    if attention_outputs_on_host and not attention_output_layers:
        raise ValueError("attention_outputs_on_host says where the kept attention outputs go: it needs "
                         "attention_output_layers >= 1 (how many layers keep them)")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    shape = model_shape(model_config)
    s = _setup(lora_rank, full_finetune, dtype_bytes, logit_chunk_tokens, setup)
    name = model_config if isinstance(model_config, str) else shape.model_type
    if (isinstance(attention_output_layers, bool) or not isinstance(attention_output_layers, int)
            or not 0 <= attention_output_layers <= shape.layers):
        # the runtime's check (attention.kept_outputs.check_attention_output_layers), which this leaf cannot import
        raise ValueError(f"attention_output_layers must be an int from 0 (keep none) to the model's {shape.layers} "
                         f"decoder layers (keep every layer's), got {attention_output_layers!r}")
    if image_tokens < 0 or image_tokens > tokens:
        raise ValueError(f"image_tokens must be between 0 and tokens ({tokens}): the image tokens are part of the "
                         f"step's tokens, got {image_tokens}")
    if image_tokens and shape.vision is None:
        raise ValueError(f"image_tokens={image_tokens} needs a vision-language model (a Qwen3-VL config with a "
                         f"vision_config, e.g. 'qwen3-vl-8b'); {name!r} has no vision tower")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of processes >= 1, got {world_size!r}")
    ranks_per_host = world_size if ranks_per_host is None else ranks_per_host
    if (not isinstance(ranks_per_host, int) or isinstance(ranks_per_host, bool) or ranks_per_host < 1
            or world_size % ranks_per_host):
        raise ValueError(f"ranks_per_host must be a whole number >= 1 that divides world_size ({world_size}): the "
                         f"processes of one host (torchrun --nproc_per_node), got {ranks_per_host!r}")
    if host_bytes is not None:
        host_bytes = host_share_bytes(host_bytes, ranks_per_host)  # from here on: this rank's share
    if fsdp and weight_quantization is not None:
        raise ValueError("fsdp=True with weight_quantization is not planned: FSDP2 shards of quantised weights "
                         "are not modelled; plan one GPU per process without fsdp (DDP) instead")
    P = param_count(shape)
    weights = P * dtype_bytes
    if weight_quantization is not None:
        if weight_quantization not in QUANTIZED_WEIGHT_BYTES:
            raise ValueError(f"weight_quantization must be one of {sorted(QUANTIZED_WEIGHT_BYTES)} or None, "
                             f"got {weight_quantization!r}")
        if full_finetune:
            raise ValueError("weight_quantization needs LoRA: quantised weights are not trained")
        linear = linear_weight_count(shape)
        weights = (P - linear) * dtype_bytes + int(linear * QUANTIZED_WEIGHT_BYTES[weight_quantization])
        if weight_quantization == "fp8":
            weights += fp8_scale_bytes(shape)
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    if s.lora:
        n_train = lora_param_count(shape, s.lora_rank, vision=s.train_vision)
        if s.lora_experts and shape.is_moe and shape.model_type not in PEFT_MAPS_EXPERT_NAMES:
            n_train += expert_lora_param_count(shape, s.lora_rank)
        trainable = n_train * s.lora_dtype_bytes
        grads = n_train * s.lora_dtype_bytes
        optim = n_train * opt
    else:
        n_train = P if full_finetune else 0
        trainable = 0
        grads = n_train * dtype_bytes
        optim = n_train * opt

    distributed = 0
    if fsdp:
        weights, trainable, grads, optim = (_shard(b, world_size) for b in (weights, trainable, grads, optim))
        root, layer = fsdp_gathered_params(shape)
        distributed = (root + 2 * layer) * dtype_bytes + ((root + layer) * dtype_bytes if full_finetune else 0)
    elif world_size > 1:
        distributed = grads  # DDP's buckets

    T, L = int(tokens), shape.layers
    per_layer = T * shape.hidden * dtype_bytes  # one saved layer input
    # a quantised weight's matmul needs temporaries of its own, in the forward and in the backward
    quantized_matmul = 0 if weight_quantization is None else _quantized_matmul_bytes(shape, T, weight_quantization, s)
    working = layer_working_set(shape, T, s) + quantized_matmul
    loss = loss_bytes(shape, T, s)
    vision, vision_working = vision_activation_bytes(shape, int(image_tokens), s, gradient_checkpointing)
    transfer = 0
    derived = host = 0
    notes: list[str] = []
    if gradient_checkpointing is False:
        kept, off = L, 0
        # every layer keeps its input and saved set; the last one also runs its backward transient
        checkpoints = L * (per_layer + layer_saved_bytes(shape, T, s))
        working = layer_backward_bytes(shape, T, s) + quantized_matmul
    elif gradient_checkpointing is True:
        kept, off = L, 0
        checkpoints = L * per_layer
    else:
        transfer = 2 * per_layer  # the restored layer input and the prefetched one
        # attention outputs the last layers keep from their forward to their backward (set aside first);
        # kept on the host, the GPU holds two layers' restored ones at a time
        kept_attention = (attention_output_device_layers(attention_output_layers, attention_outputs_on_host)
                          * attention_output_bytes(shape.heads, shape.head_dim, T, dtype_bytes))
        if gpu_bytes is None:
            kept = 0
        else:
            # the runtime's rule (training/checkpointing.py, gpu_budget): what is free once the
            # parameters, optimizer states and the first layer's input exist, minus step_reserve,
            # minus the same margin
            resident = weights + trainable + grads + optim + distributed + per_layer + vision
            reserve = (max(working, loss, vision_working) + transfer) * (1 + FRAGMENTATION) + kept_attention
            room = gpu_bytes - CUDA_CONTEXT_BYTES - offload_margin_bytes(gpu_bytes) - resident - reserve
            kept = max(0, min(L, int(room // per_layer)))
        if kept == L:
            transfer = 0
        off = L - kept
        slot = pinned_slot_bytes(per_layer)  # whole pinned pages, as the runtime counts them
        if host_bytes is not None and per_layer and off * slot > host_bytes:
            # inputs the host cannot hold either are derived, at most every second layer
            derived = derived_input_count(L, off, max(0, int(host_bytes)) // slot)
            if derived:
                off -= derived
                notes.append(f"{derived} layer inputs are recomputed in backward instead of stored (host memory "
                             f"holds {off} of the offloaded ones): one more forward of {derived} layers")
        checkpoints = kept * per_layer + kept_attention
        host = off * slot
        if attention_outputs_on_host:
            attention_slot = attention_output_host_bytes(shape.heads, shape.head_dim, T, dtype_bytes)
            room = None if host_bytes is None else max(0, host_bytes - host)
            on_host = attention_layers_on_host(int(attention_output_layers), room, attention_slot)
            host += on_host * attention_slot
            if on_host < attention_output_layers:
                notes.append(f"{int(attention_output_layers) - on_host} of the {int(attention_output_layers)} layers "
                             "that keep their attention outputs recompute them instead: the host memory left beside "
                             f"the offloaded layer inputs holds {on_host}")
    if s.lora and s.lora_dtype_bytes != dtype_bytes and not s.tiled_projections and not s.autocast:
        notes.append("LoRA adapters in float32 save a float32 copy of each projection's input; "
                     "tiled_projections=True or bf16 adapters remove most of it")
    plan = MemoryPlan(
        model=str(name), tokens=T, weights=weights, trainable=trainable, gradients=grads, optimizer=optim,
        checkpoints=checkpoints, layer_working_set=working, loss=loss, transfer=transfer, overhead=0,
        kept_layers=kept, offloaded_layers=off, derived_layers=derived, host_bytes=host,
        gradient_checkpointing=gradient_checkpointing, gpu_bytes=gpu_bytes, host_limit=host_bytes,
        params=P, trainable_params=n_train, notes=notes, vision=vision, vision_working_set=vision_working,
        image_tokens=int(image_tokens), world_size=world_size, fsdp=bool(fsdp), distributed=distributed,
        ranks_per_host=ranks_per_host,
    )
    plan.overhead = CUDA_CONTEXT_BYTES + int(FRAGMENTATION * plan.activations)
    return plan


def _shard(nbytes: int, world_size: int) -> int:
    """One rank's part of ``nbytes`` sharded over ``world_size`` ranks (rounded up)."""
    return -(-nbytes // world_size)


def fsdp_gathered_params(shape: ModelShape) -> tuple[int, int]:
    """``(root, layer)``: parameters FSDP2 holds unsharded on every rank. ``root``: the root
    module's own (embeddings, untied LM head, final norm), gathered through the whole forward and
    backward (swiftune's fused losses read the LM head after the forward, so the root is not
    resharded); ``layer``: one decoder layer's (the mean over the layers; two are gathered at once,
    the running one and the prefetched one)."""
    root = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
    tower = vision_param_count(shape.vision) if shape.vision is not None else 0
    return root, (param_count(shape) - root - tower) // max(1, shape.layers)


def step_reserve(model_config: Any, tokens: int, setup: TrainSetup, pending_grad_bytes: int = 0) -> int:
    """GPU bytes one step needs besides its layer checkpoints, once weights and optimizer states
    exist: the larger of one layer's working set and the loss, two transfer buffers, the
    gradients still to be allocated, and fragmentation.  Used by the offloaded checkpointing to
    size its automatic GPU budget."""
    shape = model_shape(model_config)
    per_layer = tokens * shape.hidden * setup.dtype_bytes
    act = max(layer_working_set(shape, tokens, setup), loss_bytes(shape, tokens, setup)) + 2 * per_layer
    return int(act * (1 + FRAGMENTATION)) + pending_grad_bytes


def max_tokens(model_config: Any, gpu_bytes: int, lora_rank: int = 16, *, hi: int = 2**26, **kwargs: Any) -> int:
    """The largest token count whose :func:`plan_memory` fits ``gpu_bytes`` (0 if none does).

    Bisection over the pure function: every component is non-decreasing in ``tokens`` (the loss
    chunk is ``min(T, chunk)``; in offload mode fewer layers stay on the GPU as T grows, but the
    total with them is capped by ``gpu_bytes`` by construction), so ``fits`` is monotone.
    """

    def fits(t: int) -> bool:
        return bool(plan_memory(model_config, t, lora_rank, gpu_bytes=gpu_bytes, **kwargs).fits)

    lo = max(1, int(kwargs.get("image_tokens", 0)))  # the image tokens are part of every step
    if not fits(lo):
        return 0
    step = 1024
    while step <= lo:  # the doubling starts above the image tokens
        step *= 2
    while step < hi and fits(step):  # grow until a failure brackets the answer
        lo, step = step, step * 2
    hi_bad = min(step, hi)
    if hi_bad == hi and fits(hi):
        return hi
    while hi_bad - lo > 1:
        mid = (lo + hi_bad) // 2
        if fits(mid):
            lo = mid
        else:
            hi_bad = mid
    return lo


__all__ = [
    "QUANTIZED_WEIGHT_BYTES",
    "attention_layers_on_host",
    "attention_output_device_layers",
    "attention_output_host_bytes",
    "fp8_scale_bytes",
    "host_share_bytes",
    "CUDA_CONTEXT_BYTES",
    "FRAGMENTATION",
    "KNOWN_MODELS",
    "MemoryPlan",
    "ModelShape",
    "TrainSetup",
    "auto_tile_tokens",
    "derived_input_count",
    "layer_backward_bytes",
    "layer_saved_bytes",
    "layer_working_set",
    "lora_param_count",
    "loss_bytes",
    "max_tokens",
    "model_shape",
    "offload_margin_bytes",
    "param_count",
    "plan_memory",
    "step_reserve",
    "vision_activation_bytes",
]
