"""The static state of :class:`~swiftune.rl.rollout.fast.FastRolloutEngine`: KV cache, per-row
decode state and outputs (:class:`Workspace`), and what the attention function reads during one
forward (:class:`DecodeContext`): the packed prefill or the per-row decode attention over the
cache (the attention arithmetic itself is :mod:`swiftune.attention.kv_cache`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...attention import packed_attention
from ...attention.kv_cache import (additive_mask, cached_attention, sink_cached_attention, slot_mask,
                                   softcapped_cached_attention)
from ...attention.sinks import sink_attention
from ...kernels.decode_attention import split_decode_attention
from ...kernels.launch import HAS_TRITON


class Workspace:
    """Static buffers of one call shape: KV cache, decode state, outputs, random numbers."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, length: int, max_tokens: int,
                 vocab: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.length, self.max_tokens, self.vocab = rows, length, max_tokens, vocab
        shape = (rows, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        z = dict(dtype=torch.long, device=device)
        self.row_ids = torch.arange(rows, **z)
        self.tok = torch.zeros(rows, **z)
        self.cur = torch.zeros(rows, **z)
        self.step = torch.zeros(1, **z)
        self.lengths = torch.zeros(rows, **z)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.out_tok = torch.zeros(rows, max_tokens, **z)
        self.out_lp = torch.zeros(rows, max_tokens, dtype=torch.float32, device=device)
        self.uniform = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        # the tokens of each row so far (prompt + completion), for the repetition penalty: static, updated in place
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.stop_ids = torch.full((1,), -1, **z)
        self.graphs: Any = None  # cuda_graphs.DecodeGraphs
        self.graph_key: Any = None
        self.views: dict[int, Workspace] = {}

    # per-row tensors, in the order compaction permutes them
    ROW_FIELDS = ("row_ids", "tok", "cur", "lengths", "finished", "out_tok", "out_lp", "uniform", "seen")

    def view(self, rows: int) -> Workspace:
        """The first ``rows`` slots as a workspace of their own (slices: same storage, no copy).

        After finished rows are compacted away, the decode step runs on such a view, so a step
        costs what its live rows need; on CUDA each view gets its own graphs.
        """
        if rows == self.rows:
            return self
        if rows not in self.views:
            v = object.__new__(Workspace)
            v.rows, v.length, v.max_tokens, v.vocab = rows, self.length, self.max_tokens, self.vocab
            v.k = [t[:rows] for t in self.k]
            v.v = [t[:rows] for t in self.v]
            for name in self.ROW_FIELDS:
                setattr(v, name, getattr(self, name)[:rows])
            v.step, v.stop_ids = self.step, self.stop_ids
            v.graphs, v.graph_key, v.views = None, None, {}
            self.views[rows] = v
        return self.views[rows]

    def keep_slots(self, slots: list[int]) -> None:
        """Move the rows of ``slots`` (in that order) to the front: KV cache and per-row state."""
        index = torch.tensor(slots, dtype=torch.long, device=self.tok.device)
        n = len(slots)
        for t in self.k + self.v + [getattr(self, name) for name in self.ROW_FIELDS if name != "row_ids"]:
            t[:n].copy_(t.index_select(0, index))

    def drop_graphs(self) -> None:
        """Forget captured graphs (and views): they read tensors that are about to change or go."""
        for v in self.views.values():
            v.graphs = None
        self.views = {}
        self.graphs = None

    def fits(self, rows: int, length: int, max_tokens: int) -> bool:
        return rows == self.rows and length <= self.length and max_tokens <= self.max_tokens

    def state(self) -> list[torch.Tensor]:
        return [self.tok, self.cur, self.step, self.lengths, self.finished, self.seen]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class DecodeContext:
    """What the attention function needs during one forward (passed to every layer as a kwarg)."""

    def __init__(self, ws: Workspace, backend: str, fused_layers: bool = False, decode_attention: str = "auto",
                 fp8_stacked_qkv: bool = False, fp8_stacked_gate_up: bool = False):
        self.ws, self.backend = ws, backend
        self.fused_layers = fused_layers  # run the engine's fused pre-norm layer loop (decided per call)
        self.decode_attention = decode_attention  # "auto", "sdpa", or "split": swiftune.kernels.decode_attention
        self.fp8_stacked_qkv = fp8_stacked_qkv  # q/k/v's FP8 products as one (lora_linear.stacked_fp8_products)
        self.fp8_stacked_gate_up = fp8_stacked_gate_up  # and gate/up's (rollout.layers.decode_mlp)
        self.mode = "decode"
        self.kv_len = 0
        self.packed = None
        self.dst_rows = self.dst_slots = self.src_tok = None
        self.masks: dict[Any, torch.Tensor] = {}

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`mask` as an additive ``0 / -inf`` mask in ``dtype``, built once per step."""
        key = ("bias", window, dtype)
        if key not in self.masks:
            self.masks[key] = additive_mask(self.mask(window), dtype)
        return self.masks[key]

    def mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, kv_len]`` bool slot mask of this step (built once per step and window)."""
        if window not in self.masks:
            self.masks[window] = slot_mask(self.ws.cur, self.kv_len, window)
        return self.masks[window]

    def attend(self, layer: int, query, key, value, scale: float, window: int | None, softcap: float | None,
               sinks: torch.Tensor | None = None):
        if sinks is not None and softcap:
            raise ValueError("attention sinks with a soft-cap: no family has both, and no backend computes it")
        ws = self.ws
        kc, vc = ws.k[layer], ws.v[layer]
        if self.mode == "prefill":  # query [1, Hq, T, D] packed prompts
            q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
            if sinks is not None:  # gpt-oss: the training side's packed sink attention (flex on CUDA)
                out = sink_attention(q, k, v, self.packed, scale=scale, sinks=sinks, window=window,
                                     backend=self.backend)
            else:
                out = packed_attention(q, k, v, self.packed, scale=scale, window=window, softcap=softcap,
                                       backend=self.backend)
            kc[self.dst_rows, :, self.dst_slots] = k[self.src_tok].to(kc.dtype)
            vc[self.dst_rows, :, self.dst_slots] = v[self.src_tok].to(vc.dtype)
            return out.unsqueeze(0)
        # decode: query [B, Hq, 1, D]; row b's new K/V go to slot cur[b]
        kc[ws.row_ids, :, ws.cur] = key[:, :, 0].to(kc.dtype)
        vc[ws.row_ids, :, ws.cur] = value[:, :, 0].to(vc.dtype)
        return self.attend_cached(layer, query, scale, window, softcap, sinks)

    def split_attention_applies(self, query: torch.Tensor) -> bool:
        """Whether a decode step's attention runs the split kernel: ``"split"`` always (it raises on a head
        dimension it cannot take); ``"auto"`` on CUDA for the head dimensions it was timed at, powers of two
        from 16 to 128 (Gemma 3's 256 keeps SDPA until measured); on the CPU SDPA (the interpreter is for the
        tests, which ask for ``"split"``)."""
        if self.decode_attention != "auto":
            return self.decode_attention == "split"
        dim = query.shape[-1]
        return query.is_cuda and HAS_TRITON and 16 <= dim <= 128 and dim & (dim - 1) == 0

    def attend_cached(self, layer: int, query, scale: float, window: int | None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None):
        """Decode attention of ``query [B, Hq, 1, D]`` over the cache, this step's K/V already in it
        (``sinks [Hq]``: gpt-oss's sink logits); returns ``[B, 1, Hq, D]``."""
        keys = self.ws.k[layer][:, :, :self.kv_len]
        values = self.ws.v[layer][:, :, :self.kv_len]
        if not softcap and self.split_attention_applies(query):
            rows, heads, _, dim = query.shape
            kv_heads = keys.shape[1]
            out = split_decode_attention(query.reshape(rows, kv_heads, heads // kv_heads, dim), keys, values,
                                         self.ws.cur, window, scale, sinks)
            return out.reshape(rows, 1, heads, dim)
        if sinks is not None:
            return sink_cached_attention(query, keys, values, self.mask(window), scale, sinks)
        if not softcap:
            return cached_attention(query, keys, values, self.bias(window, query.dtype), scale)
        return softcapped_cached_attention(query, keys, values, self.mask(window), scale, softcap)
