"""Fused linear + selective log-softmax for RL: ``log p(index)`` without ``[tokens, vocab]`` logits.

Math (per token row ``h``, sampled token ``i``; notation of :mod:`swiftune.losses.chunking`)::

    z  = h W^T (+ b)          u = s z            y = c tanh(u / c)          y' = y / T
    lse = log sum_j exp(y'_j)     logp_j = y'_j - lse     p_j = exp(logp_j)
    logp = logp_i                 entropy H = -sum_j p_j logp_j

Backward, given upstream ``gl = dL/dlogp`` and ``ge = dL/dH`` (either may be absent)::

    dL/dy'_j = gl * ([j == i] - p_j)  -  ge * p_j * (logp_j + H)
    dL/dz_j  = dL/dy'_j * (1/T) * (1 - (y_j / c)^2) * s          (softcap, scale: chain rule)
    dL/dh    = dL/dz @ W          dL/dW = dL/dz^T @ h          dL/db = sum_rows dL/dz

Forward walks the flattened batch x sequence axis in chunks of ``chunk_tokens`` rows (and the
vocabulary in blocks of at most ``vocab_chunk`` columns with an online log-sum-exp), and keeps per
token only ``lse`` (and ``H``) in float32.  Backward **recomputes** each chunk's logits from the
saved ``hidden``/``weight``: one extra logits matmul instead of holding ``tokens x vocab`` floats,
so the extra peak memory is about ``chunk_tokens x vocab x 2`` bytes with the fused Triton block
kernels (``x (4 + 4 + 2)`` with the PyTorch block math) at any context length (figures against
the materialising ``log_softmax(...).gather``: docs/benchmarks.md).  The entropy output is
differentiable (its gradient costs nothing extra unless it is used).

``offload=True`` (CUDA only; a no-op on CPU tensors) copies the saved hidden states to pinned CPU
memory on a side stream while the forward chunks compute, frees the GPU copy as soon as the caller
drops it, and in backward streams them back chunk by chunk, prefetching chunk ``k+1`` on the side
stream while chunk ``k`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from ..kernels.launch import Backend, choose_backend
from .blocks import (
    BlockStats,
    LogitTransform,
    backprop_block,
    block_grad,
    block_stats,
    compute_dtypes,
    finish_head_grads,
    fused_kernel,
)
from .chunking import resolve_chunk_tokens, vocab_blocks

_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


#: Largest pinned block of an offloaded copy. torch's pinned (caching host) allocator rounds every request up to
#: a power of two, so one ``[T, H]`` buffer of 5.5 GB (Qwen3-8B, 676K tokens) pins 8 GiB; blocks of at most
#: this many bytes (a power of two) lose less than one row each.
PINNED_BLOCK_BYTES = 64 * 2**20


def row_blocks(rows: int, row_bytes: int, block_bytes: int = PINNED_BLOCK_BYTES) -> list[tuple[int, int]]:
    """``[(r0, r1)]``: consecutive row ranges covering ``rows`` rows, each at most ``block_bytes`` (one
    row at least)."""
    per = max(1, block_bytes // max(1, row_bytes))
    return [(r, min(r + per, rows)) for r in range(0, rows, per)]


def block_pieces(a: int, b: int, blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``[(block index, lo, hi)]``: rows ``a:b`` as slices ``lo:hi`` of the blocks that hold them, in order."""
    out = []
    for i, (r0, r1) in enumerate(blocks):
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
            out.append((i, lo - r0, hi - r0))
    return out


class _Offloaded:
    """A pinned CPU copy of a 2-D CUDA tensor in row blocks (:func:`row_blocks`), written asynchronously
    on a side stream."""

    def __init__(self, t: torch.Tensor, block_bytes: int = PINNED_BLOCK_BYTES) -> None:
        self.device = t.device
        self.width, self.dtype = t.shape[1], t.dtype
        main = torch.cuda.current_stream(t.device)
        side = _side_stream(t.device)
        self.blocks = row_blocks(t.shape[0], t.shape[1] * t.element_size(), block_bytes)
        self.cpu = [torch.empty((r1 - r0, t.shape[1]), dtype=t.dtype, device="cpu", pin_memory=True)
                    for r0, r1 in self.blocks]
        side.wait_stream(main)  # the kernels that produced t must finish before we read it
        with torch.cuda.stream(side):
            for (r0, r1), block in zip(self.blocks, self.cpu):
                block.copy_(t[r0:r1], non_blocking=True)
        # t may be freed by the caller right after forward: its block must not be reused by the
        # allocator before the side stream has finished reading it.
        t.record_stream(side)
        self.done = side.record_event()

    def _to_device(self, a: int, b: int) -> torch.Tensor:
        pieces = block_pieces(a, b, self.blocks)
        if len(pieces) == 1:
            i, lo, hi = pieces[0]
            return self.cpu[i][lo:hi].to(self.device, non_blocking=True)
        x = torch.empty((b - a, self.width), dtype=self.dtype, device=self.device)
        at = 0
        for i, lo, hi in pieces:
            x[at:at + hi - lo].copy_(self.cpu[i][lo:hi], non_blocking=True)
            at += hi - lo
        return x

    def chunks(self, bounds: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
        """Yield rows ``a:b`` on the GPU for each bound, prefetching the next on the side stream."""
        main = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        side.wait_event(self.done)

        def fetch(a: int, b: int) -> tuple[torch.Tensor, torch.cuda.Event]:
            with torch.cuda.stream(side):
                x = self._to_device(a, b)
            return x, side.record_event()

        pending = fetch(*bounds[0]) if bounds else None
        for k in range(len(bounds)):
            assert pending is not None
            x, ready = pending
            pending = fetch(*bounds[k + 1]) if k + 1 < len(bounds) else None
            main.wait_event(ready)
            x.record_stream(main)  # allocated on the side stream, consumed on the main one
            yield x


@dataclass(frozen=True)
class LogProbConfig:
    """What :class:`ChunkedLogProb` runs with, fixed for one call (a frozen argument of ``apply``)."""

    tf: LogitTransform
    chunk_tokens: int | None
    multiplier: float
    vocab_chunk: int | None
    offload: bool
    want_entropy: bool
    cd: torch.dtype
    acc: torch.dtype
    fused: bool  # Triton block kernels (CUDA or interpreter) vs plain-PyTorch block math


def use_fused(backend: Backend, hidden: torch.Tensor, weight: torch.Tensor, acc: torch.dtype) -> bool:
    """Triton block kernels where they run (float64 always takes the PyTorch block math)."""
    if acc == torch.float64:
        return False
    return choose_backend(backend, fused_kernel(), {"hidden": hidden, "weight": weight}) == "triton"


def _row_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


class ChunkedLogProb(torch.autograd.Function):
    """``logp[r] = log softmax(y'(hidden[rows[r]]))[labels[r]]`` (and entropy), recomputing in backward.

    ``rows=None`` means every row of ``hidden`` (then ``labels`` has one entry per row); a 1-D
    ``rows`` tensor restricts the computation to those rows (used by cross entropy with
    ``reduction="none"`` to skip ignored tokens).  Outputs are flat ``[len(labels)]`` tensors.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows, cfg: LogProbConfig):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        H, V = hidden.shape[-1], weight.shape[0]
        h2 = hidden.reshape(-1, H)
        n = labels.numel()
        blocks = vocab_blocks(V, cfg.vocab_chunk)
        chunk = resolve_chunk_tokens(
            cfg.chunk_tokens, n, H, blocks[0][1] - blocks[0][0], hidden.device, cfg.cd.itemsize, cfg.multiplier,
            cfg.fused,
        )
        with torch.autocast(hidden.device.type, enabled=False):
            offloaded = _Offloaded(h2) if cfg.offload and hidden.is_cuda and rows is None else None
            w_c = weight.to(cfg.cd)
            b_c = None if bias is None else bias.to(cfg.cd)
            lse = torch.empty(n, dtype=cfg.acc, device=hidden.device)
            logp = torch.empty_like(lse)
            ent = torch.empty_like(lse) if cfg.want_entropy else None
            for a, b in _row_bounds(n, chunk):
                h = (h2[a:b] if rows is None else h2.index_select(0, rows[a:b])).to(cfg.cd)
                lab = labels[a:b]
                st: BlockStats | None = None
                for v0, v1 in blocks:
                    bs = block_stats(h, w_c, b_c, v0, v1, lab, cfg.tf, cfg.acc, cfg.want_entropy, cfg.fused)
                    st = bs if st is None else st.merge(bs)
                assert st is not None
                lse[a:b] = st.lse
                logp[a:b] = st.target - st.lse
                if ent is not None:
                    ent[a:b] = st.ent
        ctx.cfg, ctx.chunk, ctx.blocks, ctx.offloaded = cfg, chunk, blocks, offloaded
        ctx.offload_released = False
        ctx.hidden_shape, ctx.hidden_dtype = hidden.shape, hidden.dtype
        ctx.save_for_backward(None if offloaded is not None else hidden, weight, bias, labels, rows, lse, ent)
        return (logp, ent) if ent is not None else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):  # type: ignore[override]
        hidden, weight, bias, labels, rows, lse, ent = ctx.saved_tensors
        cfg: LogProbConfig = ctx.cfg
        if ctx.offload_released:
            raise RuntimeError("a second backward through an offloaded selective_log_softmax is not supported")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        nothing = (None,) * 6
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return nothing
        n, H = lse.numel(), ctx.hidden_shape[-1]
        device = lse.device
        # cross-entropy form: L = sum g_ce * (lse - y'_label) + g_ent * H, with g_ce = -dL/dlogp
        g_ce = torch.zeros_like(lse) if g_logp is None else -g_logp.reshape(-1).to(cfg.acc)
        g_e = None if g_ent is None else g_ent.reshape(-1).to(cfg.acc)
        bounds = _row_bounds(n, ctx.chunk)
        single = len(ctx.blocks) == 1
        with torch.autocast(device.type, enabled=False):
            w_c = weight.to(cfg.cd)
            b_c = None if bias is None else bias.to(cfg.cd)
            grad_w = torch.zeros(weight.shape, dtype=_acc_for(weight, cfg), device=device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=_acc_for(bias, cfg), device=device) if need_b else None
            grad_h = None
            if need_h:
                alloc = torch.empty if rows is None else torch.zeros  # every row written vs a subset
                grad_h = alloc((ctx.hidden_shape.numel() // H, H), dtype=ctx.hidden_dtype, device=device)
            if ctx.offloaded is not None:
                sources: Iterator[torch.Tensor] = ctx.offloaded.chunks(bounds)
            else:
                h2 = hidden.reshape(-1, H)
                sources = (h2[a:b] if rows is None else h2.index_select(0, rows[a:b]) for a, b in bounds)
            for (a, b), h in zip(bounds, sources):
                h = h.to(cfg.cd)
                lab = labels[a:b]
                gh_acc = None
                for v0, v1 in ctx.blocks:
                    gc = block_grad(
                        h, w_c, b_c, v0, v1, lab, lse[a:b], g_ce[a:b], None if g_e is None else g_e[a:b],
                        None if g_e is None else ent[a:b], cfg.tf, cfg.acc, cfg.fused,
                    )
                    gh = backprop_block(gc, h, w_c, v0, v1, grad_w, grad_b, need_h)
                    del gc
                    if gh is not None:
                        gh_acc = gh if single else (gh.to(cfg.acc) if gh_acc is None else gh_acc.add_(gh))
                if grad_h is not None:
                    assert gh_acc is not None
                    if rows is None:
                        grad_h[a:b] = gh_acc
                    else:
                        grad_h.index_copy_(0, rows[a:b], gh_acc.to(grad_h.dtype))
        if ctx.offloaded is not None:  # release the pinned buffer now, not when the graph dies
            ctx.offloaded, ctx.offload_released = None, True
        grad_h, grad_w, grad_b = finish_head_grads(grad_h, grad_w, grad_b, ctx.hidden_shape, weight, bias)
        return grad_h, grad_w, grad_b, None, None, None


def _acc_for(param: torch.Tensor, cfg: LogProbConfig) -> torch.dtype:
    """Accumulate parameter grads in float32 (float64 when computing in float64)."""
    return cfg.acc if param.dtype != torch.float64 else torch.float64


def check_labels(labels: torch.Tensor, vocab_size: int, name: str) -> None:
    """One host sync: every label must index the vocabulary (an out-of-range one would be ignored)."""
    if labels.numel() == 0:
        return
    lo, hi = torch.stack([labels.min(), labels.max()]).tolist()
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} values must be in [0, {vocab_size}), got range [{lo}, {hi}]")


def check_head_shapes(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      targets: torch.Tensor, name: str) -> None:
    """``hidden [..., H]`` with one integer target id per row (``targets [...]``, called ``name``), an LM
    head ``weight [V, H]`` and an optional ``bias [V]``."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        # a float label would be truncated to a class id without a word (F.cross_entropy reads floats as
        # probabilities instead)
        raise ValueError(f"{name} must be integer token ids (torch.long), got {targets.dtype}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and {name} {tuple(targets.shape)} leading shapes differ")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def materialised_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        logit_scale: float | None, logit_softcap: float | None) -> torch.Tensor:
    """The references' whole ``[..., V]`` logits ``softcap(scale * (hidden W^T + b))`` in float32 (float64
    for float64 inputs), the transforms in :class:`~swiftune.losses.blocks.LogitTransform`'s order."""
    z = F.linear(hidden, weight, bias)
    y = z.to(torch.promote_types(z.dtype, torch.float32))
    if logit_scale is not None:
        y = y * logit_scale
    if logit_softcap is not None:
        y = logit_softcap * torch.tanh(y / logit_softcap)
    return y


def selective_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_tokens: int | None = None,
    offload: bool = False,
    return_entropy: bool = False,
    bias: torch.Tensor | None = None,
    *,
    chunk_multiplier: float = 1.0,
    vocab_chunk: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``index`` under ``softmax(softcap(scale * (hidden @ W^T + b)) / T)``.

    Args:
        hidden: ``[..., H]`` final hidden states (any float dtype; bf16 on GPU).
        weight: ``[V, H]`` LM-head weight.  ``bias``: optional ``[V]``.
        index: ``[...]`` token ids (the sampled completion tokens), same leading shape as hidden.
        temperature: sampling temperature ``T`` (> 0), applied last.
        logit_softcap: Gemma-style ``c * tanh(x / c)``, applied after ``logit_scale``.
        logit_scale: multiplies the logits first (Cohere/Granite style).
        chunk_tokens: rows per chunk; ``None`` chooses from free memory
            (:func:`~swiftune.losses.chunking.choose_chunk_tokens`), scaled by ``chunk_multiplier``.
        offload: keep the saved hidden states in pinned CPU memory (CUDA; no-op on CPU).
        return_entropy: also return the (differentiable) entropy of the same distribution.
        vocab_chunk: widest vocabulary block (default 2^18; larger vocabularies are split).
        backend: ``"auto"`` runs the per-block math as Triton kernels where they run (CUDA, or CPU
            under ``TRITON_INTERPRET=1``) and in plain PyTorch otherwise; ``"reference"`` forces
            the PyTorch block math (still chunked), ``"triton"`` the kernels.

    Returns:
        float32 ``logp`` shaped like ``index`` (float64 for float64 inputs), or ``(logp, entropy)``.
    """
    check_head_shapes(hidden, weight, bias, index, "index")
    labels = index.reshape(-1).long()
    check_labels(labels, weight.shape[0], "index")
    cd, acc = compute_dtypes(hidden, weight)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    cfg = LogProbConfig(
        LogitTransform(logit_scale, logit_softcap, float(temperature)),
        chunk_tokens, chunk_multiplier, vocab_chunk, bool(offload and grads), return_entropy, cd, acc,
        use_fused(backend, hidden, weight, acc),
    )
    out = ChunkedLogProb.apply(hidden, weight, bias, labels, None, cfg)
    if return_entropy:
        logp, ent = out
        return logp.view(index.shape), ent.view(index.shape)
    return out.view(index.shape)


def selective_log_softmax_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    return_entropy: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: materialises the logits (float32, or float64 for float64 inputs)."""
    y = materialised_logits(hidden, weight, bias, logit_scale, logit_softcap)
    logp_all = torch.log_softmax(y / temperature, dim=-1)
    logp = logp_all.gather(-1, index.long().unsqueeze(-1)).squeeze(-1)
    if return_entropy:
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    return logp
