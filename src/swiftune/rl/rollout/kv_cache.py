"""The static state of :class:`~swiftune.rl.rollout.fast.FastRolloutEngine`: KV cache, per-row
decode state and outputs (:class:`Workspace`), and what the attention function reads during one
forward (:class:`DecodeContext`): the packed prefill or the per-row decode attention over the
cache (the attention arithmetic itself is :mod:`swiftune.attention.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...attention import packed_attention
from ...attention.kv_cache import (additive_mask, cached_attention, sink_cached_attention, slot_mask,
                                   softcapped_cached_attention)
from ...attention.sinks import sink_attention
from ...kernels.decode_attention import dequantize_cache, split_decode_attention
from ...kernels.fp8_quant import fp8_quantize_rowwise
from ...kernels.launch import HAS_TRITON

#: ``FastRolloutEngine(kv_cache_dtype=...)``: the model's dtype, or e4m3 codes with a float32 scale per slot and head
KV_CACHE_DTYPES = ("auto", "fp8")


class Workspace:
    """Static buffers of one call shape: KV cache, decode state, outputs, random numbers.

    ``kv_cache_dtype="fp8"``: each cached K / V vector (one slot of one head) is stored as ``float8_e4m3fn``
    codes with one float32 scale (``k_scale`` / ``v_scale [rows, kv_heads, length]`` per layer; the codes times
    the scale is the vector), quantised as :func:`~swiftune.kernels.fp8_quant.fp8_quantize_rowwise` quantises a
    row: 2 x (D + 4) bytes a slot and head instead of 2 x 2 D in bf16. ``"auto"``: the model's dtype, no scales."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, length: int, max_tokens: int,
                 vocab: int, dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto"):
        self.rows, self.length, self.max_tokens, self.vocab = rows, length, max_tokens, vocab
        shape = (rows, kv_heads, length, head_dim)
        fp8 = check_kv_cache_dtype(kv_cache_dtype) == "fp8"
        codes = torch.float8_e4m3fn if fp8 else dtype
        self.k = [torch.zeros(shape, dtype=codes, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=codes, device=device) for _ in range(layers)]
        scales = shape[:3]
        self.k_scale = [torch.ones(scales, device=device) for _ in range(layers)] if fp8 else None
        self.v_scale = [torch.ones(scales, device=device) for _ in range(layers)] if fp8 else None
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
            v.k_scale = None if self.k_scale is None else [t[:rows] for t in self.k_scale]
            v.v_scale = None if self.v_scale is None else [t[:rows] for t in self.v_scale]
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
        for t in self._caches() + [getattr(self, name) for name in self.ROW_FIELDS if name != "row_ids"]:
            t = _bytes_view(t)
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
        return sum(t.numel() * t.element_size() for t in self._caches())

    def _caches(self) -> list[torch.Tensor]:
        return self.k + self.v + (self.k_scale + self.v_scale if self.k_scale is not None else [])

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
              ) -> None:
        """``key, value [N, Hk, D]`` into slot ``slots[i]`` of row ``rows[i]`` (an FP8 cache: their codes and
        per-slot scales)."""
        if self.k_scale is None:
            self.k[layer][rows, :, slots] = key.to(self.k[layer].dtype)
            self.v[layer][rows, :, slots] = value.to(self.v[layer].dtype)
            return
        for codes, scales, x in ((self.k, self.k_scale, key), (self.v, self.v_scale, value)):
            q, s = fp8_quantize_rowwise(x)
            _bytes_view(codes[layer])[rows, :, slots] = _bytes_view(q)
            scales[layer][rows, :, slots] = s[..., 0]

    def read(self, layer: int, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``kv_len`` slots of layer ``layer``'s K and V in ``dtype`` (an FP8 cache dequantised: what
        the SDPA and eager decode paths read)."""
        keys, values = self.k[layer][:, :, :kv_len], self.v[layer][:, :, :kv_len]
        if self.k_scale is None:
            return keys, values
        return (dequantize_cache(keys, self.k_scale[layer][:, :, :kv_len], dtype),
                dequantize_cache(values, self.v_scale[layer][:, :, :kv_len], dtype))


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as their bytes (``uint8``), other tensors as they are: indexed writes and row moves of the codes
    then run on a dtype every torch op takes on every device."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` if it is one of :data:`KV_CACHE_DTYPES`; a ``ValueError`` saying what to pass otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} ('auto': the model's dtype; 'fp8': "
                         f"e4m3 codes with a float32 scale per slot and head), got {kv_cache_dtype!r}")
    return kv_cache_dtype


@dataclass(frozen=True)
class DecodeOptions:
    """The engine's decode-step choices that the layers read (:class:`~.fast.FastRolloutEngine`'s arguments of
    the same names)."""

    decode_attention: str = "auto"  # "auto", "sdpa", or "split": swiftune.kernels.decode_attention
    fp8_stacked_qkv: bool = False  # q/k/v's FP8 products as one (lora_linear.stacked_fp8_products)
    fp8_stacked_gate_up: bool = False  # and gate/up's (rollout.layers.decode_mlp)
    fp8_norm_codes: bool = False  # the norms make the next projections' FP8 codes (add_rms_norm_fp8)
    fp8_glu_codes: bool = False  # the MLP's activation makes down_proj's FP8 codes (glu_fp8)
    lora_decode_kernel: bool = False  # runtime LoRA products in two launches each (lora_decode_add_)


class DecodeContext:
    """What the attention function needs during one forward (passed to every layer as a kwarg)."""

    def __init__(self, ws: Workspace, backend: str, fused_layers: bool = False,
                 options: DecodeOptions = DecodeOptions()):
        self.ws, self.backend = ws, backend
        self.fused_layers = fused_layers  # run the engine's fused pre-norm layer loop (decided per call)
        self.options = options
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
        if self.mode == "prefill":  # query [1, Hq, T, D] packed prompts
            q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
            if sinks is not None:  # gpt-oss: the training side's packed sink attention (flex on CUDA)
                out = sink_attention(q, k, v, self.packed, scale=scale, sinks=sinks, window=window,
                                     backend=self.backend)
            else:
                out = packed_attention(q, k, v, self.packed, scale=scale, window=window, softcap=softcap,
                                       backend=self.backend)
            ws.write(layer, self.dst_rows, self.dst_slots, k[self.src_tok], v[self.src_tok])
            return out.unsqueeze(0)
        # decode: query [B, Hq, 1, D]; row b's new K/V go to slot cur[b]
        ws.write(layer, ws.row_ids, ws.cur, key[:, :, 0], value[:, :, 0])
        return self.attend_cached(layer, query, scale, window, softcap, sinks)

    def split_attention_applies(self, query: torch.Tensor) -> bool:
        """Whether a decode step's attention runs the split kernel: ``"split"`` always (it raises on a head
        dimension it cannot take); ``"auto"`` on CUDA for the head dimensions it was timed at, powers of two
        from 16 to 128 (Gemma 3's 256 keeps SDPA until measured); on the CPU SDPA (the interpreter is for the
        tests, which ask for ``"split"``)."""
        if self.options.decode_attention != "auto":
            return self.options.decode_attention == "split"
        dim = query.shape[-1]
        return query.is_cuda and HAS_TRITON and 16 <= dim <= 128 and dim & (dim - 1) == 0

    def attend_cached(self, layer: int, query, scale: float, window: int | None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None):
        """Decode attention of ``query [B, Hq, 1, D]`` over the cache, this step's K/V already in it
        (``sinks [Hq]``: gpt-oss's sink logits); returns ``[B, 1, Hq, D]``."""
        ws = self.ws
        if not softcap and self.split_attention_applies(query):
            rows, heads, _, dim = query.shape
            keys, values = ws.k[layer][:, :, :self.kv_len], ws.v[layer][:, :, :self.kv_len]
            scales = {} if ws.k_scale is None else {"key_scales": ws.k_scale[layer][:, :, :self.kv_len],
                                                     "value_scales": ws.v_scale[layer][:, :, :self.kv_len]}
            kv_heads = keys.shape[1]
            out = split_decode_attention(query.reshape(rows, kv_heads, heads // kv_heads, dim), keys, values,
                                         ws.cur, window, scale, sinks, **scales)
            return out.reshape(rows, 1, heads, dim)
        keys, values = ws.read(layer, self.kv_len, query.dtype)
        if sinks is not None:
            return sink_cached_attention(query, keys, values, self.mask(window), scale, sinks)
        if not softcap:
            return cached_attention(query, keys, values, self.bias(window, query.dtype), scale)
        return softcapped_cached_attention(query, keys, values, self.mask(window), scale, softcap)
