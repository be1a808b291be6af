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
  (a decode step then runs the plain weights: 2.2x faster on the H200 at G=8, docs/benchmarks.md)
  and runs the PEFT layers otherwise.
* **Static KV cache.** Per layer ``K, V [rows, kv_heads, prompt + max_new, head_dim]`` in the
  model's dtype, zero-initialised, allocated once per call shape; on CUDA the rows decoded at
  once are capped so the cache fits ``memory_fraction`` of free memory (whole groups per chunk).
  ``keep_cache=True`` keeps it (and the captured graphs) for the next call of the same shape;
  ``"auto"`` (default) keeps it only while it takes at most ``KEEP_CACHE_FRACTION`` (10%) of the
  GPU's memory, so that a long-context training step between two generations gets a large cache's
  memory back (at the price of re-capturing the graphs next time).
* **Attention.** During a call the model's attention implementation is switched to
  ``"swiftune_rollout"`` (registered with transformers' ``AttentionInterface``; restored after),
  so every layer's own q/k/v projections, q/k norms and RoPE run as usual and only the attention
  itself is ours: prefill is one packed pass (:func:`swiftune.attention.packed_attention`,
  varlen/flex on GPU) over the distinct prompts whose K/V are written into the static cache rows of
  each prompt's ``G`` completions (``share_prompt_prefill=True``: each prompt prefilled once);
  decode writes each row's new K/V at its own slot (row ``b`` is at position ``cur[b]``: prompts
  are not padded, positions are exact) and attends over the first ``kv_len`` slots with a
  ``j <= cur[b]`` (and sliding-window) mask. ``kv_len`` is the used length rounded up to
  ``kv_bucket``, so a step reads only the part of the cache in use.
* **Sampling** (:func:`sample_tokens`): temperature, then top-k, top-p and min-p
  (:func:`swiftune.rl.rollout.filter_logits`), then a Gumbel-max draw ``argmax(logp + g)`` with
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
  (:mod:`swiftune.rl.engine_cuda`). On CPU the same step runs eagerly.

Stop strings come from the engine's ``stop_strings`` plus a ``stop`` attribute of the params
(:class:`FastSamplingParams`) and need a ``tokenizer``.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import build_packed_batch
from ..models.patching import causal_lm_of
from .engine_cache import DecodeContext, Workspace
from .engine_layers import fused_prenorm_supported, prenorm_layers
from .rollout import Rollouts, SamplingParams, filter_logits

ATTENTION_NAME = "swiftune_rollout"
CTX_KWARG = "swiftune_rollout"
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
#: ``keep_cache="auto"`` keeps a KV cache between calls only up to this share of the GPU's memory.
KEEP_CACHE_FRACTION = 0.10


@dataclass
class FastSamplingParams(SamplingParams):
    """:class:`SamplingParams` plus stop strings (vLLM's ``stop``)."""

    stop: Sequence[str] = ()


def sample_tokens(
    logits: torch.Tensor, uniform: torch.Tensor | None, temperature: float,
    top_k: int | None = None, top_p: float = 1.0, min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` (float32) and its sampling log-prob (static shapes, no sync).

    ``temperature == 0``: argmax, log-prob under ``softmax(logits)``. Otherwise the logits are divided
    by the temperature and filtered (top-k, top-p, min-p), and the token is ``argmax(logp + g)`` with
    Gumbel noise ``g = -log(-log u)`` from ``uniform [B, V]`` in [0, 1): an exact draw from the
    filtered distribution ``softmax(logp)``.
    """
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(filter_logits(logits / temperature, top_k, top_p, min_p), dim=-1)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        tokens = (logp + gumbel).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def rollout_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function used inside :class:`FastRolloutEngine` calls only."""
    ctx = kwargs.get(CTX_KWARG)
    if ctx is None:
        raise RuntimeError("the swiftune_rollout attention only runs inside FastRolloutEngine.generate")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ctx.attend(module.layer_idx, query, key, value, scale, sliding_window, softcap), None


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


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, rollout_attention)


def head_dim_of(config) -> int:
    """Attention head size: ``config.head_dim`` where the config sets it (Qwen3, Gemma), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Bytes of K and V that one token occupies in the cache, over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * itemsize


class FastRolloutEngine:
    """Fast batched sampling from the training model itself (see the module docstring).

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
        fused_layers: on patched pre-norm models (Llama, Mistral, Qwen2, Qwen3), run the engine's
            own layer loop (:mod:`swiftune.rl.engine_layers`): each residual add folded into the
            next RMSNorm, and in decode steps the q/k norms, RoPE and K/V cache writes in one
            kernel; the same numbers as the layers' own forward, up to six launches fewer per layer
            (on the H200, Qwen3-1.7B, G=8: 2.82 vs 3.22 ms a decode step; docs/benchmarks.md).
            Other architectures, or ``False``, run each layer's own forward.
    """

    def __init__(self, model: nn.Module, pad_token_id: int = 0, seed: int = 0, *, tokenizer=None,
                 stop_strings: Sequence[str] = (), max_batch_size: int | None = None, use_cuda_graph: bool = True,
                 keep_cache: bool | str = "auto", check_every: int = 16, kv_bucket: int = 256, lora: str = "auto",
                 share_prompt_prefill: bool = True, attention_backend: str = "auto", memory_fraction: float = 0.8,
                 compact_finished: bool = True, fused_layers: bool = True):
        if keep_cache not in (True, False, "auto"):
            raise ValueError(f"keep_cache must be True, False or 'auto', got {keep_cache!r}")
        if lora not in ("auto", "runtime", "merge"):
            raise ValueError(f"lora must be 'auto', 'runtime' or 'merge', got {lora!r}")
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
        self._generator: torch.Generator | None = None
        self._ws: Workspace | None = None
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ model access
    def load_weights(self, model: nn.Module) -> None:
        """The engine samples from the training model itself: nothing to copy."""
        if model is not self.model:
            self.release()
        self.model = model

    def _keeps_cache(self) -> bool:
        if self.keep_cache != "auto":
            return bool(self.keep_cache)
        if self._ws is None or self._ws.tok.device.type != "cuda":
            return True
        total = torch.cuda.get_device_properties(self._ws.tok.device).total_memory
        return self._ws.nbytes() <= KEEP_CACHE_FRACTION * total

    def release(self) -> None:
        """Free the KV cache and the captured graphs."""
        self._drop_workspace()

    def _drop_workspace(self) -> None:
        # The graphs' step closure refers back to the workspace: cut that cycle so the old graphs and
        # cache are freed here, not by a later garbage-collection pass (which could land mid-capture).
        if self._ws is not None:
            self._ws.drop_graphs()
        self._ws = None

    def _hf(self) -> nn.Module:
        return causal_lm_of(self.model)

    def _parts(self):
        hf = self._hf()
        if hf.config.model_type not in SUPPORTED:
            raise ValueError(f"FastRolloutEngine supports {SUPPORTED}, not {hf.config.model_type!r}: "
                             "use TransformersRolloutEngine")
        return hf, hf.model

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    # ------------------------------------------------------------------ forward pieces
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        hf, decoder = self._parts()
        h = decoder.embed_tokens(ids)
        if hf.config.model_type.startswith("gemma") and not hasattr(decoder.embed_tokens, "embed_scale"):
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
            return prenorm_layers(decoder, h, pos, pe[0], ctx, CTX_KWARG)
        for i, layer in enumerate(decoder.layers[: decoder.config.num_hidden_layers]):
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe[i], **{CTX_KWARG: ctx})
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
        tok, lp = sample_tokens(logits, ws.uniform, params.temperature, params.top_k, params.top_p, params.min_p)
        active = ~ws.finished
        tok = torch.where(active, tok, torch.full_like(tok, self.pad_token_id))
        lp = torch.where(active, lp, torch.zeros_like(lp))
        ws.out_tok.index_copy_(1, ws.step, tok[:, None])
        ws.out_lp.index_copy_(1, ws.step, lp[:, None])
        ws.lengths.add_(active.long())
        ws.finished.logical_or_((tok[:, None] == ws.stop_ids[None, :]).any(dim=1) & active)
        ws.tok.copy_(tok)
        ws.step.add_(1)

    def _decode_step(self, ws: Workspace, ctx: DecodeContext, params: SamplingParams, kv_len: int) -> None:
        """One decode step on static buffers: capturable (no host sync, static shapes for a kv_len)."""
        ctx.mode, ctx.kv_len = "decode", kv_len
        hidden = self._hidden(ws.tok[:, None], ws.cur[:, None], ctx)
        self._sample_record(ws, self._logits(hidden[:, -1]), params)
        ws.cur.add_(1)

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, params: SamplingParams) -> Rollouts:
        if not prompt_ids:
            return Rollouts([], [], [], num_generations)
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        stops = tuple(self.stop_strings) + tuple(getattr(params, "stop", ()) or ())
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need FastRolloutEngine(tokenizer=...)")
        hf, _ = self._parts()
        _register()
        out = Rollouts([], [], [], num_generations)
        self.stats = {}
        was_training = self.model.training
        attn_before = hf.config._attn_implementation
        backups = None
        self.model.eval()
        try:
            with torch.no_grad():
                backups = self._merge_lora()
                hf.config._attn_implementation = ATTENTION_NAME
                per_chunk = self._prompts_per_chunk(prompt_ids, num_generations, params)
                for a in range(0, len(prompt_ids), per_chunk):
                    ids, lps, done, steps = self._generate_chunk(prompt_ids[a:a + per_chunk], num_generations,
                                                                 params, stops)
                    out.completion_ids += ids
                    out.logprobs += lps
                    out.finished += done
                    out.stats["decode_steps"] = out.stats.get("decode_steps", 0.0) + steps
        finally:
            hf.config._attn_implementation = attn_before
            if backups is not None:
                self._unmerge_lora(backups)
            self.model.train(was_training)
            if not self._keeps_cache():
                self.release()
        self.stats.update(out.stats)
        out.stats = dict(self.stats)
        return out

    def _merge_lora(self) -> list | None:
        """``lora="merge"``: merge active adapters; returns (weight, saved copy) pairs to restore."""
        if self.lora == "runtime" or not hasattr(self.model, "merge_adapter"):
            return None
        layers = [m for m in self.model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
        if not layers or any(getattr(m, "disable_adapters", False) or getattr(m, "merged", False) for m in layers):
            return None  # adapters disabled (reference policy) or already merged: run as they are
        if self.lora == "auto":
            weight = layers[0].get_base_layer().weight
            if weight.device.type != "cuda":
                return None
            copy_bytes = sum(m.get_base_layer().weight.numel() for m in layers) * weight.element_size()
            if copy_bytes > torch.cuda.mem_get_info(weight.device)[0] // 4:
                return None
        saved = [(m.get_base_layer().weight, m.get_base_layer().weight.detach().clone()) for m in layers]
        self.model.merge_adapter()
        return saved

    def _unmerge_lora(self, saved: list) -> None:
        self.model.unmerge_adapter()
        with torch.no_grad():
            for weight, copy in saved:  # (W + dW) - dW is not W in floating point: restore the bits
                weight.data.copy_(copy)

    def _row_bytes(self, length: int) -> int:
        hf, _ = self._parts()
        cfg = hf.config
        itemsize = next(self.model.parameters()).element_size()
        return kv_bytes_per_token(cfg, itemsize) * length

    def _prompts_per_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> int:
        per_chunk = len(prompts)
        if self.max_batch_size is not None:
            per_chunk = max(1, self.max_batch_size // n)
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
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
        hf, _ = self._parts()
        cfg = hf.config
        dtype = self._parts()[1].embed_tokens.weight.dtype
        self._ws = Workspace(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, head_dim_of(cfg), length,
                             max_tokens, hf.lm_head.out_features, dtype, device)
        return self._ws

    def _prefill(self, ws: Workspace, ctx: DecodeContext, prompts: Sequence[Sequence[int]], n: int) -> torch.Tensor:
        """One packed forward over the prompts; writes their K/V into every row of their group."""
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

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                        stops: tuple[str, ...]) -> tuple[list[list[int]], list[torch.Tensor], list[bool], int]:
        device = next(self.model.parameters()).device
        rows, max_tokens = len(prompts) * n, max(1, params.max_tokens)
        longest = max(len(p) for p in prompts)
        ws = self._workspace(rows, longest + max_tokens, max_tokens, device)
        hf, decoder = self._parts()
        # whether the fused layer loop applies: a walk over every layer's norms, so once per call
        fused = self.fused_layers and fused_prenorm_supported(decoder, hf.config.model_type,
                                                                 decoder.embed_tokens.weight.dtype)
        ctx = DecodeContext(ws, self.attention_backend, fused)
        gen = self.generator(device)
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device).repeat_interleave(n)
        ws.cur.copy_(prompt_len)
        ws.step.zero_()
        ws.lengths.zero_()
        ws.finished.zero_()
        ws.out_tok.fill_(self.pad_token_id)
        ws.out_lp.zero_()
        stop_ids = sorted({int(s) for s in params.stop_token_ids}) or [-1]
        if ws.stop_ids.numel() != len(stop_ids) or ws.stop_ids.tolist() != stop_ids:
            ws.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
            ws.drop_graphs()  # the graphs read the old tensor
        sampling = params.temperature > 0
        if sampling:
            ws.uniform.uniform_(generator=gen)
        t0 = time.perf_counter()
        self._sample_record(ws, self._prefill(ws, ctx, prompts, n), params)  # token 0 from the prefill
        _sync(device)
        t1 = time.perf_counter()

        use_graphs = device.type == "cuda" and self.use_cuda_graph
        # what captured graphs depend on besides their workspace: computed once per call, not per step
        graph_key = ((params.temperature, params.top_k, params.top_p, params.min_p,
                      tuple(p.data_ptr() for p in self.model.parameters())) if use_graphs else None)
        view, slot_row = ws, list(range(rows))  # the rows decoded now; original row of each slot
        done: dict[int, tuple[list[int], torch.Tensor, bool]] = {}  # rows that left the batch
        view_ctx = {rows: ctx}
        capture = 0.0
        stop_at: dict[int, int] = {}  # original row -> tokens kept (stop strings)
        checked = [0] * rows
        steps = 1
        for s in range(1, max_tokens):
            if (s - 1) % self.check_every == 0 and s > 1:
                if stops:
                    self._check_stop_strings(view, slot_row, s, stops, stop_at, checked)
                finished = view.finished.tolist()
                live = [i for i, f in enumerate(finished) if not f]
                if not live:
                    break
                if self.compact_finished and len(live) <= view.rows // 2:
                    keep = min(view.rows, 1 << (len(live) - 1).bit_length())
                    ended = [i for i, f in enumerate(finished) if f]
                    self._collect(view, slot_row, s, ended, done)
                    slots = live + ended[:keep - len(live)]
                    ws.keep_slots(slots)
                    slot_row = [slot_row[i] for i in slots]
                    view = ws.view(keep)
                    view_ctx.setdefault(keep, DecodeContext(view, self.attention_backend, fused))
                    self.stats["compactions"] = self.stats.get("compactions", 0.0) + 1
            kv_len = min(ws.length, math.ceil((longest + s) / self.kv_bucket) * self.kv_bucket)
            if sampling:
                view.uniform.uniform_(generator=gen)
            if use_graphs:
                graphs = self._graphs(view, view_ctx[view.rows], params, graph_key)
                before = graphs.capture_s
                graphs.run(kv_len)
                capture += graphs.capture_s - before
            else:
                self._decode_step(view, view_ctx[view.rows], params, kv_len)
            steps += 1
        if stops:
            self._check_stop_strings(view, slot_row, steps, stops, stop_at, checked)
        self._collect(view, slot_row, steps, list(range(view.rows)), done)  # syncs: the decode loop is done
        t2 = time.perf_counter()
        for key, value in (("prefill_s", t1 - t0), ("decode_s", t2 - t1 - capture), ("capture_s", capture)):
            self.stats[key] = self.stats.get(key, 0.0) + value
        self.stats["kv_cache_bytes"] = float(ws.nbytes())
        ids, lps, fins = [], [], []
        for r in range(rows):
            toks, lp, fin = done[r]
            k = min(len(toks), stop_at.get(r, len(toks)))
            ids.append(toks[:k])
            lps.append(lp[:k].clone())
            fins.append(fin or r in stop_at)
        return ids, lps, fins, steps

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
        from .engine_cuda import DecodeGraphs

        if ws.graphs is None or ws.graph_key != key:
            ws.graphs = None  # free the old graphs and their pool before capturing new ones
            ws.graphs = DecodeGraphs(lambda kv_len: self._decode_step(ws, ctx, params, kv_len), ws.state())
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
