"""``FastRolloutEngine``: static-KV-cache sampling on the training model, decode steps as CUDA graphs.

Same interface as :class:`~swiftune.rl.rollout.TransformersRolloutEngine` (``generate`` /
``load_weights``, :class:`~swiftune.rl.rollout.Rollouts` out), built for speed:

* **Shared weights.** The engine runs the training model's own modules (embedding, decoder
  layers, final norm, LM head): no copy. LoRA (PEFT) adapters: ``lora="runtime"`` runs
  the PEFT layers as they are (base matmul + low-rank update, exact, nothing written);
  ``lora="merge"`` merges the active adapters with PEFT's ``merge_adapter`` for the duration of the
  call, then ``unmerge_adapter`` and copies back a saved copy of the base weights, so they are
  bit-identical afterwards (costs one extra copy of the adapted base weights while generating).
  ``lora="auto"`` (default) merges on CUDA when that copy takes under a quarter of the free memory
  (a decode step then runs the plain weights, much faster than the PEFT layers at a few rows)
  and runs the PEFT layers otherwise (:mod:`.lora_merge`).
* **Static KV cache.** Per layer ``K, V [rows, kv_heads, prompt + max_new, head_dim]`` in the
  model's dtype, zero-initialised, allocated once per call shape; on CUDA the rows decoded at
  once are capped so the cache fits ``memory_fraction`` of free memory (whole groups per chunk).
  ``keep_cache=True`` keeps it (and the captured graphs) for the next call of the same shape;
  ``"auto"`` (default) keeps it only while it takes at most ``KEEP_CACHE_FRACTION`` (10%) of the
  GPU memory this process may use (the card's, times its per-process memory fraction), so that a
  long-context training step between two generations gets a large cache's memory back (at the price
  of re-capturing the graphs next time).
* **Attention.** During a call the model's attention implementation is switched to
  ``"swiftune_rollout"`` (:func:`swiftune.attention.registry.register_rollout_attention`; restored after),
  so every layer's own q/k/v projections, q/k norms and RoPE run as usual and only the attention
  itself is ours: prefill is one packed pass (:func:`swiftune.attention.packed_attention`,
  varlen/flex on GPU) over the distinct prompts whose K/V are written into the static cache rows of
  each prompt's ``G`` completions (``share_prompt_prefill=True``: each prompt prefilled once);
  decode writes each row's new K/V at its own slot (row ``b`` is at position ``cur[b]``: prompts
  are not padded, positions are exact) and attends over the first ``kv_len`` slots with a
  ``j <= cur[b]`` (and sliding-window) mask. ``kv_len`` is the used length rounded up to
  ``kv_bucket``, so a step reads only the part of the cache in use.
* **Sampling** (:func:`~swiftune.rl.rollout.sampling.sample_tokens`): the repetition penalty
  (over a static ``[rows, vocab]`` ``seen`` mask of the prompt and the tokens sampled so far,
  updated in place by each step), then temperature, then top-k,
  top-p and min-p (:func:`~swiftune.rl.rollout.sampling.filter_logits`), then a Gumbel-max draw ``argmax(logp + g)`` with
  ``g = -log(-log u)``, ``u`` drawn from the engine's seeded ``torch.Generator`` into a static buffer
  before each step (exactly a sample of the filtered distribution; no RNG inside the graph). The
  recorded log-prob is under the filtered, temperature-scaled distribution (temperature 0: greedy,
  log-probs at temperature 1), as in the transformers engine.
* **Stopping.** A row finishes at a stop token (on device, inside the step), at a stop string
  (host check every ``check_every`` steps on the decoded tail of each row; the completion keeps
  the token that completes the string) or at ``max_tokens``. Finished rows are masked: their
  tokens are ``pad``, their log-probs are not recorded. The loop ends when all rows are finished,
  checked every ``check_every`` steps (the only host syncs of the decode loop).
* **Finished rows leave the batch** (``compact_finished=True``): at a check where at most half the
  rows decoded together are still running, the finished rows' outputs are copied to the host, the
  live rows' KV cache and state are moved to the first slots, and decoding goes on over a view of
  the next power of two of them (``Workspace.view``; its own CUDA graphs). A long tail of a few
  rows then costs a small batch's step, not the full one's.
* **CUDA graphs** (``use_cuda_graph=True``, CUDA only): the decode step (forward, sampling,
  recording, stop test) is captured once per ``kv_len`` bucket and replayed
  (:mod:`.cuda_graphs`). On CPU the same step runs eagerly.
* **Mixture of experts** (Qwen3-MoE, Mixtral, gpt-oss): each layer's MoE block is the model's own (transformers'
  router); for the duration of a call the experts modules that :func:`swiftune.patch_model` bound run
  :func:`~swiftune.models.experts.rollout_experts_forward` (routing sorted on the device, grouped GEMMs
  with device offsets, a deterministic combine), so the decode step has no host sync and its graph
  replay equals the eager step. Unpatched experts (transformers' forward syncs) are refused for CUDA
  graphs. gpt-oss's per-head attention sinks join the softmax of the prefill and decode attention
  (:func:`swiftune.attention.kv_cache.sink_cached_attention`), each layer with its own window.

Stop strings come from the engine's ``stop_strings`` plus a ``stop`` attribute of the params
(:class:`FastSamplingParams`) and need a ``tokenizer``.

The code reads top to bottom like a ``generate.py``: :meth:`FastRolloutEngine.generate` splits
the prompts into chunks that fit the cache; each chunk is :meth:`~FastRolloutEngine.prefill`
(one packed forward writing the cache, token 0), then :meth:`~FastRolloutEngine.decode_n`, the
loop of :meth:`~FastRolloutEngine.decode_one` steps with a host check every ``check_every``
steps; then the model forward those steps share, and the bookkeeping (memory, stop strings,
graphs).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ...attention import build_packed_batch
from ...attention.kv_cache import ROLLOUT_KWARG
from ...attention.registry import register_rollout_attention
from ...losses import free_gpu_bytes, gpu_capacity_bytes
from ...models.experts import check_decode_kernel_max_tokens, rollout_experts
from ...models.families import FAMILIES
from ...models.nf4_decode import NF4_DECODE_MAX_ROWS, check_nf4_decode_max_rows, nf4_decode_layers
from ...models.nf4_dense import nf4_dense_bytes, nf4_dense_layers
from ...models.patching import causal_lm_of
from .kv_cache import DecodeContext, DecodeOptions, Workspace, check_kv_cache_dtype
from .layers import fused_prenorm_supported, prenorm_layers
from .lora_merge import merge_lora, unmerge_lora
from .protocol import Rollouts, SamplingParams, check_prompts
from .sampling import SamplingStream, mark_seen, sample_tokens, seen_mask

#: model types the engine runs (the families whose record says it can)
SUPPORTED = tuple(t for t, f in FAMILIES.items() if f.fast_rollout)
#: why a known family is not on the engine (its decode step lacks what the family's attention needs)
_VISION_WHY = " (its prompts need the vision tower in the prefill: use swiftune.rl.rollout.vision_fast's engine)"
_UNSUPPORTED_WHY = {"qwen3_vl": _VISION_WHY, "qwen3_vl_moe": _VISION_WHY}
#: ``keep_cache="auto"`` keeps a KV cache between calls only up to this share of the GPU's memory.
KEEP_CACHE_FRACTION = 0.10


@dataclass
class FastSamplingParams(SamplingParams):
    """:class:`SamplingParams` plus stop strings (vLLM's ``stop``)."""

    stop: Sequence[str] = ()


def head_dim_of(config) -> int:
    """Attention head size: ``config.head_dim`` where the config sets it (Qwen3, Gemma), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, itemsize: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V that one token occupies in the cache, over all layers: ``itemsize`` bytes an element, or
    with ``kv_cache_dtype="fp8"`` a byte a code plus a float32 scale per head's vector."""
    per_head = head_dim_of(config) + 4 if kv_cache_dtype == "fp8" else head_dim_of(config) * itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


@dataclass
class Chunk:
    """One chunk of prompts being decoded: its workspace and what the decode loop tracks.

    ``view`` is the workspace (or, after compaction, the view of its first slots) decoded now;
    slot ``i`` of it holds original row ``slot_row[i]``. Rows that left the batch are in ``done``,
    rows cut by a stop string in ``stop_at`` (original row -> tokens kept).
    """

    ws: Workspace
    ctx: DecodeContext
    params: SamplingParams
    stops: tuple[str, ...]
    longest: int  # longest prompt, in tokens
    max_tokens: int
    fused: bool
    generator: torch.Generator
    graph_key: tuple | None  # None: decode steps run eagerly
    view: Workspace | None = None
    slot_row: list[int] = field(default_factory=list)
    view_ctx: dict[int, DecodeContext] = field(default_factory=dict)
    done: dict[int, tuple[list[int], torch.Tensor, bool]] = field(default_factory=dict)
    stop_at: dict[int, int] = field(default_factory=dict)
    checked: list[int] = field(default_factory=list)
    steps: int = 0
    capture_s: float = 0.0

    @property
    def sampling(self) -> bool:
        return self.params.temperature > 0


class FastRolloutEngine:
    """Fast batched sampling from the training model itself (see the module docstring).

    Subclasses may extend the per-call state (``workspace_class``, a :class:`Workspace` with more
    per-row fields) and the decoder config (:meth:`_decoder_config`): :mod:`.vision_fast` does.

    Args:
        model: the policy (a transformers causal LM of a supported family, or a PEFT model of one).
        pad_token_id: token written for finished rows (never returned).
        seed: seed of the engine's ``torch.Generator``.
        tokenizer: needed for stop strings only.
        stop_strings: stop strings applied to every call (besides ``params.stop``).
        max_batch_size: most rows decoded at once (None: as many as the memory allows).
        use_cuda_graph: capture the decode step as CUDA graphs (CUDA only).
        keep_cache: keep the KV cache and graphs between calls of the same shape (True), free them after
            each call (False), or keep them when they take at most 10% of the GPU's memory ("auto").
        check_every: decode steps between host checks (all finished? stop strings?).
        kv_bucket: granularity of the attended cache length (one graph per bucket).
        lora: ``"runtime"`` (PEFT layers as they are), ``"merge"`` (merged for the call, restored exactly) or
            ``"auto"`` (merge on CUDA when the saved copy fits a quarter of free memory, else runtime).
        share_prompt_prefill: prefill each distinct prompt once for its ``G`` rows.
        attention_backend: backend of the packed prefill attention.
        memory_fraction: share of free CUDA memory the KV cache may take.
        compact_finished: at each host check, once at most half the rows decoded together are
            still running, move those to the front and decode only them (the next power of two of
            them), so finished rows stop costing compute and KV reads.
        fused_layers: on patched pre-norm models (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral), run the
            engine's own layer loop (:mod:`swiftune.rl.rollout.layers`): each residual add folded into the
            next RMSNorm, and in decode steps the q/k norms, RoPE and K/V cache writes in one
            kernel; the same numbers as the layers' own forward, with fewer kernel launches per
            layer (the step time is in docs/benchmarks.md). Other architectures, or ``False``,
            run each layer's own forward.
        moe_decode_max_tokens: mixture-of-experts models: the most tokens a decode step sends through
            the fused decode kernels (:mod:`swiftune.kernels.moe_decode`) rather than the grouped GEMM
            (``None``: :func:`swiftune.models.experts.default_decode_kernel_cap`, 16 tokens, 64 for
            gpt-oss's interleaved layout, where the kernels won on the H200; 0: the grouped GEMM always).
        moe_fused_routing: mixture-of-experts models: the routers' softmax / top-k / renormalisation in one
            Triton launch (:mod:`swiftune.kernels.moe_router`) instead of five; ``False``: torch's ops (the
            baseline of an A/B).
        moe_route_kernels: mixture-of-experts steps above the decode kernels' cap (G=64 on Qwen3-MoE, and
            prefill): the grouped-GEMM path's sort by expert in two launches and weighted combine in one
            (:mod:`swiftune.kernels.moe_route`), the same bits as torch's ops with about twenty fewer launches
            a layer (the decode step's time: docs/benchmarks.md, "rollout_moe"); ``False``: torch's ops.
        decode_attention: a decode step's attention over the cache (no soft-cap): ``"split"``, the cache cut
            into chunks across the SMs and merged, sinks included (:mod:`swiftune.kernels.decode_attention`,
            flash-decoding); ``"sdpa"``, one program per row and K/V head over the whole cache (gpt-oss's
            sinks: matmul, float32 softmax, matmul); ``"auto"``: ``"split"`` on CUDA for head dimensions of 16
            to 128 (powers of two: where it was timed), else ``"sdpa"`` (the A/B: docs/benchmarks.md,
            "rollout_decode_attention").
        nf4_decode_kernel: bitsandbytes NF4 (QLoRA) base weights: decode steps of 2 to ``nf4_decode_max_rows``
            rows multiply through swiftune's weight-only NF4 kernel (:mod:`swiftune.models.nf4_decode`), which
            decodes the 4-bit codes in registers, instead of bitsandbytes' dequantise-then-multiply (faster at
            G=8 and 16 on the H200: docs/benchmarks.md, "rollout_nf4"); ``False``: bitsandbytes' own forward always.
            Models without NF4 layers, and devices where the kernel does not run, are unaffected.
        nf4_decode_max_rows: the most rows such a step sends through the NF4 kernel (2 to 64; default 16, a
            G=16 step); larger steps take bitsandbytes' forward, whose dequantised copy more rows share.
        nf4_dense: NF4 base weights: dequantise every NF4 layer once per ``generate`` call into a copy in its
            compute dtype and decode from that (:mod:`swiftune.models.nf4_dense`; freed after the call, training
            untouched), instead of dequantising (bitsandbytes) or decoding (the NF4 kernel) the codes at every
            step. ``"auto"``: on CUDA when the copies take at most a quarter of the free memory (the 8B shape's
            ~14 GB on an 80 GB GPU, not on a 24 GB one); ``True``: always; ``False``: never. While it is on, the
            NF4 kernel is not bound.
        fp8_stacked_qkv: FP8 base weights (``load_in_fp8``): a decode step multiplies q/k/v's codes, which
            ``quantize_model_fp8`` lays out in one buffer, as one product, each projection's LoRA adapter
            (at run time) added to its columns (:func:`swiftune.models.lora_linear.stacked_fp8_products`), instead
            of three products (on by default: faster at G 8 and 64 in ``scripts/gpu_suite.sh fp8-stacked-ab``);
            ``False``: three products. Other weights, and q/k/v not laid out so, are unaffected.
        fp8_stacked_gate_up: the same for each gated MLP's gate / up codes (``quantize_model_fp8`` lays them out
            in one buffer too), the fused activation reading the product's two column halves in place
            (``rollout.layers.decode_mlp``); on by default (faster at G 8 and 64 in ``scripts/gpu_suite.sh
            fp8-stacked-gate-up-ab``). The fused layer loop's decode steps only (pre-norm families).
        fp8_norm_codes: in those decode steps, the residual add + RMSNorm kernel before q/k/v and before gate/up
            also makes the FP8 codes they read (:func:`swiftune.kernels.add_rms_norm_fp8`, the bytes the
            separate quantise launch makes, so the same tokens and log-probabilities); on by default, ``False``
            for the separate launch (the A/B of ``scripts/gpu_suite.sh fp8-norm-kv-ab``).
        fp8_glu_codes: in those decode steps, a gated MLP's activation kernel also makes the FP8 codes its
            ``down_proj`` reads (:func:`swiftune.kernels.glu_fp8`, the quantiser's bytes: the same tokens and
            log-probabilities), where ``down_proj`` would quantise its input (the FP8 x FP8 rows, 17-64, and
            ``_scaled_mm``'s above); off: timed on an H100 it saved no time (``scripts/gpu_suite.sh fp8-glu-codes-ab``).
        lora_decode_kernel: adapters at run time (``lora="runtime"``, and FP8 or 4-bit bases, which are never
            merged): in the fused layer loop's decode steps each adapter's product is added to its projection's
            in two launches (:func:`swiftune.kernels.lora_decode_add_`) instead of two matmuls and, for PEFT's
            float32 adapters, three casts; plain and FP8 bases. ``"auto"`` (default): on for a model on CUDA (faster at
            G=8 over FP8 weights in ``scripts/gpu_suite.sh lora-decode-quick``), off elsewhere (on CPU the kernel
            would run in Triton's interpreter); ``True`` / ``False`` force it (``False``: the ops, the A/B's
            baseline). The sums run in another order, so log-probabilities move by float32 rounding.
        kv_cache_dtype: ``"auto"`` (default): the KV cache in the model's dtype. ``"fp8"``: each cached K / V
            vector as e4m3 codes with a float32 scale per slot and head (:class:`~.kv_cache.Workspace`), about
            half the cache's bytes, so a decode step whose cache read is as large as its weight read (many rows,
            long completions) reads less, and a group fits more tokens. The prompt's own attention in the
            prefill uses the unquantised K/V; every decode step attends to the dequantised cache, so the sampled
            tokens' log-probabilities differ from the model's by the cache's rounding (tests/test_kv_cache_fp8.py
            measures it). Off by default (timed: docs/fp8.md).
    """

    #: the static per-call state (KV cache, per-row decode state) of a chunk
    workspace_class: type[Workspace] = Workspace

    def __init__(self, model: nn.Module, pad_token_id: int = 0, seed: int = 0, *, tokenizer=None,
                 stop_strings: Sequence[str] = (), max_batch_size: int | None = None, use_cuda_graph: bool = True,
                 keep_cache: bool | str = "auto", check_every: int = 16, kv_bucket: int = 256, lora: str = "auto",
                 share_prompt_prefill: bool = True, attention_backend: str = "auto", memory_fraction: float = 0.8,
                 compact_finished: bool = True, fused_layers: bool = True, moe_decode_max_tokens: int | None = None,
                 moe_fused_routing: bool = True, moe_route_kernels: bool = True, decode_attention: str = "auto",
                 nf4_decode_kernel: bool = True, nf4_decode_max_rows: int = NF4_DECODE_MAX_ROWS,
                 nf4_dense: bool | str = "auto", fp8_stacked_qkv: bool = True, fp8_stacked_gate_up: bool = True,
                 fp8_norm_codes: bool = True, fp8_glu_codes: bool = False, lora_decode_kernel: bool | str = "auto",
                 kv_cache_dtype: str = "auto"):
        if keep_cache not in (True, False, "auto"):
            raise ValueError(f"keep_cache must be True, False or 'auto', got {keep_cache!r}")
        if lora not in ("auto", "runtime", "merge"):
            raise ValueError(f"lora must be 'auto', 'runtime' or 'merge', got {lora!r}")
        if decode_attention not in ("auto", "sdpa", "split"):
            raise ValueError(f"decode_attention must be 'auto', 'sdpa' or 'split', got {decode_attention!r}")
        if nf4_dense not in (True, False, "auto"):
            raise ValueError(f"nf4_dense must be True, False or 'auto', got {nf4_dense!r}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.seed = seed
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.max_batch_size = max_batch_size
        self.use_cuda_graph = use_cuda_graph
        self.keep_cache = keep_cache
        self.check_every = max(1, int(check_every))
        self.kv_bucket = max(1, int(kv_bucket))
        self.lora = lora
        self.share_prompt_prefill = share_prompt_prefill
        self.attention_backend = attention_backend
        self.memory_fraction = memory_fraction
        self.compact_finished = compact_finished
        self.fused_layers = fused_layers
        self.moe_decode_max_tokens = (None if moe_decode_max_tokens is None
                                      else check_decode_kernel_max_tokens(moe_decode_max_tokens))
        self.moe_fused_routing = bool(moe_fused_routing)
        self.moe_route_kernels = bool(moe_route_kernels)
        self.decode_attention = decode_attention
        self.nf4_decode_kernel = bool(nf4_decode_kernel)
        self.nf4_decode_max_rows = check_nf4_decode_max_rows(nf4_decode_max_rows, "nf4_decode_max_rows")
        self.nf4_dense = nf4_dense
        self.fp8_stacked_qkv = bool(fp8_stacked_qkv)
        self.fp8_stacked_gate_up = bool(fp8_stacked_gate_up)
        self.fp8_norm_codes = bool(fp8_norm_codes)
        self.fp8_glu_codes = bool(fp8_glu_codes)
        if lora_decode_kernel not in (True, False, "auto"):
            raise ValueError(f"lora_decode_kernel must be True, False or 'auto', got {lora_decode_kernel!r}")
        self.lora_decode_kernel = lora_decode_kernel
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self._stream = SamplingStream(self.seed)
        self._ws: Workspace | None = None
        self.stats: dict[str, float] = {}

    def load_weights(self, model: nn.Module) -> None:
        """The engine samples from the training model itself: nothing to copy."""
        if model is not self.model:
            self.release()
        self.model = model

    def release(self) -> None:
        """Free the KV cache and the captured graphs."""
        self._drop_workspace()

    def generator(self, device: torch.device) -> torch.Generator:
        return self._stream.on(device)

    def rng_state(self) -> torch.Tensor | None:
        """The sampling stream's state (None before the first draw): GRPO checkpoints store it."""
        return self._stream.state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Continue the sampling stream from ``state`` (:meth:`rng_state` of a checkpoint), from the next draw
        (the noise is drawn outside the captured graphs, so they need no new capture)."""
        self._stream.resume_from(state)

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams) -> Rollouts:
        if not prompt_ids:
            return Rollouts([], [], [], num_generations)
        check_prompts(prompt_ids, num_generations)
        stops = tuple(self.stop_strings) + tuple(getattr(params, "stop", ()) or ())
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need FastRolloutEngine(tokenizer=...)")
        hf, _ = self._parts()
        attention_name = register_rollout_attention()
        out = Rollouts([], [], [], num_generations)
        self.stats = {}
        was_training = self.model.training
        attention_config = self._decoder_config()  # the text decoder's (a vision tower keeps its own)
        attn_before = attention_config._attn_implementation
        backups = None
        self.model.eval()
        dense = self._uses_nf4_dense()
        try:
            with torch.no_grad(), rollout_experts(self.model, FAMILIES[hf.config.model_type],
                                                  self.moe_decode_max_tokens, self.moe_fused_routing,
                                                  self.moe_route_kernels) as (bound, total), \
                    nf4_dense_layers(self.model, dense) as dense_layers, \
                    nf4_decode_layers(self.model, self.nf4_decode_kernel and not dense, self.nf4_decode_max_rows):
                if bound < total:
                    self._check_unbound_experts(total - bound)
                if dense_layers:
                    self.stats["nf4_dense_layers"] = float(dense_layers)
                backups = merge_lora(self.model, self.lora)
                attention_config._attn_implementation = attention_name
                per_chunk = self._prompts_per_chunk(prompt_ids, num_generations, params)
                for a in range(0, len(prompt_ids), per_chunk):
                    ids, lps, done, steps = self._generate_chunk(prompt_ids[a:a + per_chunk], num_generations,
                                                                 params, stops)
                    out.completion_ids += ids
                    out.logprobs += lps
                    out.finished += done
                    out.stats["decode_steps"] = out.stats.get("decode_steps", 0.0) + steps
        finally:
            attention_config._attn_implementation = attn_before
            if backups is not None:
                unmerge_lora(self.model, backups)
            self.model.train(was_training)
            # graphs captured over dequantised copies point at memory freed with them: they go too
            if dense or not self._keeps_cache():
                self.release()
        self.stats.update(out.stats)
        out.stats = dict(self.stats)
        return out

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                        stops: tuple[str, ...]) -> tuple[list[list[int]], list[torch.Tensor], list[bool], int]:
        chunk = self._start_chunk(prompts, n, params, stops)
        device = chunk.ws.tok.device
        t0 = time.perf_counter()
        self._sample_record(chunk.ws, self.prefill(chunk.ws, chunk.ctx, prompts, n), params)  # token 0
        chunk.steps = 1
        _sync(device)
        t1 = time.perf_counter()
        self.decode_n(chunk)
        t2 = time.perf_counter()
        for key, value in (("prefill_s", t1 - t0), ("decode_s", t2 - t1 - chunk.capture_s),
                           ("capture_s", chunk.capture_s)):
            self.stats[key] = self.stats.get(key, 0.0) + value
        self.stats["kv_cache_bytes"] = float(chunk.ws.nbytes())
        return self._results(chunk)

    def prefill(self, ws: Workspace, ctx: DecodeContext, prompts: Sequence[Sequence[int]], n: int) -> torch.Tensor:
        """One packed forward over the prompts; writes their K/V into every row of their group and
        returns the logits of each row's first completion token ``[rows, V]``."""
        device = ws.tok.device
        seqs = list(prompts) if self.share_prompt_prefill else [p for p in prompts for _ in range(n)]
        lengths = [len(s) for s in seqs]
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)[None]
        pos = torch.cat([torch.arange(length, device=device) for length in lengths])[None]
        dst_rows, dst_slots, src = [], [], []
        for r in range(len(prompts) * n):
            s = r // n if self.share_prompt_prefill else r
            dst_rows += [r] * lengths[s]
            dst_slots += list(range(lengths[s]))
            src += list(range(offsets[s], offsets[s + 1]))
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        ctx.mode = "prefill"
        ctx.dst_rows, ctx.dst_slots, ctx.src_tok = as_t(dst_rows), as_t(dst_slots), as_t(src)
        ctx.packed = build_packed_batch(1, ids.shape[1], pos, None, backend=self.attention_backend)
        hidden = self._hidden(ids, pos, ctx)[0]
        logits = self._logits(hidden[as_t(offsets[1:]) - 1])
        ctx.packed = ctx.dst_rows = ctx.dst_slots = ctx.src_tok = None
        return logits.repeat_interleave(n, dim=0) if self.share_prompt_prefill else logits

    def decode_one(self, ws: Workspace, ctx: DecodeContext, params: SamplingParams, kv_len: int) -> None:
        """One decode step on static buffers: capturable (no host sync, static shapes for a kv_len)."""
        ctx.mode, ctx.kv_len = "decode", kv_len
        hidden = self._hidden(ws.tok[:, None], ws.cur[:, None], ctx)
        self._sample_record(ws, self._logits(hidden[:, -1]), params)
        ws.cur.add_(1)

    def decode_n(self, chunk: Chunk) -> None:
        """Tokens ``1 .. max_tokens - 1`` of every row: :meth:`decode_one` steps (replayed as CUDA
        graphs where captured), with a host check every ``check_every`` steps that ends the loop
        when every row is finished and moves finished rows out of the batch."""
        ws = chunk.ws
        for s in range(1, chunk.max_tokens):
            if (s - 1) % self.check_every == 0 and s > 1 and not self._host_check(chunk, s):
                break
            kv_len = min(ws.length, math.ceil((chunk.longest + s) / self.kv_bucket) * self.kv_bucket)
            if chunk.sampling:
                chunk.view.uniform.uniform_(generator=chunk.generator)
            ctx = chunk.view_ctx[chunk.view.rows]
            if chunk.graph_key is not None:
                graphs = self._graphs(chunk.view, ctx, chunk.params, chunk.graph_key)
                before = graphs.capture_s
                graphs.run(kv_len)
                chunk.capture_s += graphs.capture_s - before
            else:
                self.decode_one(chunk.view, ctx, chunk.params, kv_len)
            chunk.steps += 1
        if chunk.stops:
            self._check_stop_strings(chunk.view, chunk.slot_row, chunk.steps, chunk.stops, chunk.stop_at,
                                     chunk.checked)
        # syncs: the decode loop is done
        self._collect(chunk.view, chunk.slot_row, chunk.steps, list(range(chunk.view.rows)), chunk.done)

    def _host_check(self, chunk: Chunk, s: int) -> bool:
        """Stop strings, then whether any row is still running (``False``: the loop ends); compacts
        the batch when at most half of the rows decoded together still run."""
        view = chunk.view
        if chunk.stops:
            self._check_stop_strings(view, chunk.slot_row, s, chunk.stops, chunk.stop_at, chunk.checked)
        finished = view.finished.tolist()
        live = [i for i, f in enumerate(finished) if not f]
        if not live:
            return False
        if self.compact_finished and len(live) <= view.rows // 2:
            keep = min(view.rows, 1 << (len(live) - 1).bit_length())
            ended = [i for i, f in enumerate(finished) if f]
            self._collect(view, chunk.slot_row, s, ended, chunk.done)
            slots = live + ended[:keep - len(live)]
            chunk.ws.keep_slots(slots)
            chunk.slot_row = [chunk.slot_row[i] for i in slots]
            chunk.view = chunk.ws.view(keep)
            chunk.view_ctx.setdefault(keep, self._context(chunk.view, chunk.fused))
            self.stats["compactions"] = self.stats.get("compactions", 0.0) + 1
        return True

    @property
    def decode_options(self) -> DecodeOptions:
        """The decode-step choices the layers read, as one object for each step's :class:`DecodeContext`."""
        return DecodeOptions(decode_attention=self.decode_attention, fp8_stacked_qkv=self.fp8_stacked_qkv,
                             fp8_stacked_gate_up=self.fp8_stacked_gate_up, fp8_norm_codes=self.fp8_norm_codes,
                             fp8_glu_codes=self.fp8_glu_codes, lora_decode_kernel=self._lora_decode_kernel_on())

    def _lora_decode_kernel_on(self) -> bool:
        if self.lora_decode_kernel != "auto":
            return bool(self.lora_decode_kernel)
        return next(self.model.parameters()).device.type == "cuda"

    def _context(self, ws: Workspace, fused: bool) -> DecodeContext:
        """The attention context of a workspace (or of a compacted view of one)."""
        return DecodeContext(ws, self.attention_backend, fused, self.decode_options)

    def _start_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                     stops: tuple[str, ...]) -> Chunk:
        """The workspace of a chunk, reset for its prompts (positions, outputs, stop tokens)."""
        device = next(self.model.parameters()).device
        rows, max_tokens = len(prompts) * n, max(1, params.max_tokens)
        longest = max(len(p) for p in prompts)
        ws = self._workspace(rows, longest + max_tokens, max_tokens, device)
        hf, decoder = self._parts()
        # whether the fused layer loop applies: a walk over every layer's norms, so once per call
        fused = self.fused_layers and fused_prenorm_supported(decoder, hf.config.model_type,
                                                                 decoder.embed_tokens.weight.dtype)
        ctx = self._context(ws, fused)
        gen = self.generator(device)
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device).repeat_interleave(n)
        ws.cur.copy_(prompt_len)
        ws.step.zero_()
        ws.lengths.zero_()
        ws.finished.zero_()
        ws.out_tok.fill_(self.pad_token_id)
        ws.out_lp.zero_()
        if params.repetition_penalty != 1.0:  # the prompts' tokens; each step adds its sample (in the graph)
            ws.seen.view(len(prompts), n, ws.vocab).copy_(seen_mask(prompts, ws.vocab, device)[:, None])
        stop_ids = sorted({int(s) for s in params.stop_token_ids}) or [-1]
        if ws.stop_ids.numel() != len(stop_ids) or ws.stop_ids.tolist() != stop_ids:
            ws.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
            ws.drop_graphs()  # the graphs read the old tensor
        if params.temperature > 0:
            ws.uniform.uniform_(generator=gen)
        use_graphs = device.type == "cuda" and self.use_cuda_graph
        # what captured graphs depend on besides their workspace: computed once per call, not per step
        graph_key = ((params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
                      tuple(p.data_ptr() for p in self.model.parameters())) if use_graphs else None)
        return Chunk(ws, ctx, params, stops, longest, max_tokens, fused, gen, graph_key, view=ws,
                     slot_row=list(range(rows)), view_ctx={rows: ctx}, checked=[0] * rows)

    def _results(self, chunk: Chunk) -> tuple[list[list[int]], list[torch.Tensor], list[bool], int]:
        """Each original row's completion, cut at its stop string, in row order."""
        ids, lps, fins = [], [], []
        for r in range(chunk.ws.rows):
            toks, lp, fin = chunk.done[r]
            k = min(len(toks), chunk.stop_at.get(r, len(toks)))
            ids.append(toks[:k])
            lps.append(lp[:k].clone())
            fins.append(fin or r in chunk.stop_at)
        return ids, lps, fins, chunk.steps

    # ------------------------------------------------------------------ the model forward
    def _hf(self) -> nn.Module:
        return causal_lm_of(self.model)

    def _parts(self):
        hf = self._hf()
        if hf.config.model_type not in SUPPORTED:
            raise ValueError(f"FastRolloutEngine supports {SUPPORTED}, not {hf.config.model_type!r}"
                             f"{_UNSUPPORTED_WHY.get(hf.config.model_type, '')}: use TransformersRolloutEngine "
                             "(GRPOConfig(rollout_engine='transformers'))")
        return hf, hf.model

    def _decoder_config(self):
        """The config of the decoder the engine runs (its layer and head counts, its attention switch): the
        model's own; a vision-language engine's is its text decoder's (:mod:`.vision_fast`)."""
        return self._hf().config

    def _check_unbound_experts(self, unbound: int) -> None:
        """transformers' own experts forward (a model not patched by swiftune) reads the routing back to
        the host, which a CUDA-graph capture cannot hold: refuse there; eager decoding runs it."""
        device = next(self.model.parameters()).device
        if device.type == "cuda" and self.use_cuda_graph:
            raise ValueError(f"{unbound} experts module(s) run transformers' own forward, whose host syncs cannot be "
                             "captured in the decode step's CUDA graph: call swiftune.patch_model(model) first (its "
                             "grouped experts route on the device), or pass use_cuda_graph=False")

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        hf, decoder = self._parts()
        h = decoder.embed_tokens(ids)
        if FAMILIES[hf.config.model_type].embed_scale and not hasattr(decoder.embed_tokens, "embed_scale"):
            h = h * torch.tensor(hf.config.hidden_size**0.5, dtype=h.dtype)  # older transformers: scaled in the model
        return h

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, ctx: DecodeContext) -> torch.Tensor:
        _, decoder = self._parts()
        h = self._embed(ids)
        layer_types = _rope_layer_types(decoder)
        if layer_types is None:
            pe = [decoder.rotary_emb(h, pos)] * decoder.config.num_hidden_layers
        else:  # Gemma 3: a rotary table per layer type (local sliding layers use another base)
            tables = {t: decoder.rotary_emb(h, pos, t) for t in set(layer_types)}
            pe = [tables[t] for t in layer_types]
        ctx.masks = {}
        if ctx.fused_layers:
            return prenorm_layers(decoder, h, pos, pe[0], ctx, ROLLOUT_KWARG)
        for i, layer in enumerate(decoder.layers[: decoder.config.num_hidden_layers]):
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe[i], **{ROLLOUT_KWARG: ctx})
            h = out[0] if isinstance(out, tuple) else out
        return decoder.norm(h)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hf, _ = self._parts()
        logits = hf.lm_head(hidden).float()
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _sample_record(self, ws: Workspace, logits: torch.Tensor, params: SamplingParams) -> None:
        """Sample each row's next token and record it (finished rows record ``pad``, no log-prob)."""
        penalty = params.repetition_penalty
        tok, lp = sample_tokens(logits, ws.uniform, params.temperature, params.top_k, params.top_p, params.min_p,
                                seen=ws.seen if penalty != 1.0 else None, repetition_penalty=penalty)
        if penalty != 1.0:
            mark_seen(ws.seen, tok)
        active = ~ws.finished
        tok = torch.where(active, tok, torch.full_like(tok, self.pad_token_id))
        lp = torch.where(active, lp, torch.zeros_like(lp))
        ws.out_tok.index_copy_(1, ws.step, tok[:, None])
        ws.out_lp.index_copy_(1, ws.step, lp[:, None])
        ws.lengths.add_(active.long())
        ws.finished.logical_or_((tok[:, None] == ws.stop_ids[None, :]).any(dim=1) & active)
        ws.tok.copy_(tok)
        ws.step.add_(1)

    # ------------------------------------------------------------------ memory, stop strings, graphs
    def _uses_nf4_dense(self) -> bool:
        """Whether this call decodes NF4 layers from dequantised copies (``nf4_dense``; ``"auto"``: on CUDA
        when the copies take at most a quarter of the free memory)."""
        if self.nf4_dense is False:
            return False
        size = nf4_dense_bytes(self.model)
        if size == 0 or self.nf4_dense is True:
            return size > 0
        device = next(self.model.parameters()).device
        return device.type == "cuda" and size <= free_gpu_bytes(device) // 4

    def _keeps_cache(self) -> bool:
        if self.keep_cache != "auto":
            return bool(self.keep_cache)
        if self._ws is None or self._ws.tok.device.type != "cuda":
            return True
        # the process's share of the card (set_per_process_memory_fraction: a shared GPU, or a smaller one
        # emulated), not the whole card's memory
        return self._ws.nbytes() <= KEEP_CACHE_FRACTION * gpu_capacity_bytes(self._ws.tok.device)

    def _drop_workspace(self) -> None:
        # The graphs' step closure refers back to the workspace: cut that cycle so the old graphs and
        # cache are freed here, not by a later garbage-collection pass (which could land mid-capture).
        if self._ws is not None:
            self._ws.drop_graphs()
        self._ws = None

    def _row_bytes(self, length: int) -> int:
        cfg = self._decoder_config()
        itemsize = next(self.model.parameters()).element_size()
        return kv_bytes_per_token(cfg, itemsize, self.kv_cache_dtype) * length

    def _prompts_per_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        per_chunk = len(prompts)
        if self.max_batch_size is not None:
            per_chunk = max(1, self.max_batch_size // n)
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            free = free_gpu_bytes(device)  # within the process's memory fraction, cached bytes included
            held = self._ws.nbytes() if self._ws is not None else 0
            length = max(len(p) for p in prompts) + params.max_tokens
            fit = int((free + held) * self.memory_fraction) // max(1, self._row_bytes(length) * n)
            if fit < 1:
                raise RuntimeError(f"the KV cache of one group ({n} rows x {length} tokens) does not fit in "
                                   f"{self.memory_fraction:.0%} of free GPU memory")
            per_chunk = min(per_chunk, fit)
        return per_chunk

    def _workspace(self, rows: int, length: int, max_tokens: int, device: torch.device) -> Workspace:
        if self._ws is not None and self._ws.fits(rows, length, max_tokens) and self._ws.k[0].device == device:
            return self._ws
        self._drop_workspace()  # free the old one first
        hf, decoder = self._parts()
        cfg = self._decoder_config()
        dtype = decoder.embed_tokens.weight.dtype
        self._ws = self.workspace_class(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, head_dim_of(cfg),
                                        length, max_tokens, hf.lm_head.out_features, dtype, device,
                                        kv_cache_dtype=self.kv_cache_dtype)
        return self._ws

    @staticmethod
    def _collect(view: Workspace, slot_row: list[int], upto: int, slots: list[int],
                 done: dict[int, tuple[list[int], torch.Tensor, bool]]) -> None:
        """Copy the outputs of ``slots`` to the host, keyed by original row (first copy wins)."""
        slots = [i for i in slots if slot_row[i] not in done]
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=view.tok.device)
        lengths = view.lengths.index_select(0, index).tolist()
        finished = view.finished.index_select(0, index).tolist()
        toks = view.out_tok[:, :upto].index_select(0, index).cpu()  # only the columns written so far
        lps = view.out_lp[:, :upto].index_select(0, index).cpu()
        for j, i in enumerate(slots):
            done[slot_row[i]] = (toks[j, :lengths[j]].tolist(), lps[j, :lengths[j]], bool(finished[j]))

    def _graphs(self, ws: Workspace, ctx: DecodeContext, params: SamplingParams, key: tuple):
        """The workspace's graphs, captured anew when ``key`` (sampling settings, weight storage) changed."""
        from .cuda_graphs import DecodeGraphs

        if ws.graphs is None or ws.graph_key != key:
            ws.graphs = None  # free the old graphs and their pool before capturing new ones
            ws.graphs = DecodeGraphs(lambda kv_len: self.decode_one(ws, ctx, params, kv_len), ws.state())
            ws.graph_key = key
        return ws.graphs

    def _check_stop_strings(self, ws: Workspace, slot_row: list[int], upto: int, stops: tuple[str, ...],
                            stop_at: dict[int, int], checked: list[int]) -> None:
        """Host check: the first token count ``k`` whose decoded tail contains a stop string ends the row
        (``stop_at`` and ``checked`` are keyed by original row; ``ws`` slot ``i`` holds row ``slot_row[i]``)."""
        lengths = ws.lengths.tolist()
        toks = ws.out_tok[:, :upto].cpu().tolist()
        tail = 4 * max(len(s) for s in stops) + 4  # tokens enough to hold any stop string
        newly = []
        for i, length in enumerate(lengths):
            r = slot_row[i]
            if r in stop_at:
                continue
            for k in range(checked[r] + 1, min(length, upto) + 1):
                text = self.tokenizer.decode(toks[i][max(0, k - tail):k])
                if any(s in text for s in stops):
                    stop_at[r] = k
                    newly.append(i)
                    break
            checked[r] = max(checked[r], min(length, upto))
        if newly:
            ws.finished[torch.tensor(newly, dtype=torch.long, device=ws.finished.device)] = True


@functools.cache
def _rotary_takes_layer_type(rotary_cls: type) -> bool:
    """Whether ``rotary_emb(x, pos, layer_type)`` gives a table per layer type (Gemma 3); per class, once."""
    try:
        return "layer_type" in inspect.signature(rotary_cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - not introspectable
        return False


def _rope_layer_types(decoder: nn.Module) -> list[str] | None:
    """The layer types whose rotary tables differ, or None (one table for every layer)."""
    return list(decoder.config.layer_types) if _rotary_takes_layer_type(type(decoder.rotary_emb)) else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
