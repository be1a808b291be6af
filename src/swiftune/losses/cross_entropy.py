"""Fused linear + cross entropy for SFT: the loss of ``hidden @ W^T`` without ``[tokens, vocab]`` logits.

Math (per labelled token row ``h`` with label ``i``; transform order as in
:mod:`swiftune.losses.chunking`)::

    z = h W^T (+ b)        u = s z  (logit_scale)        y = c tanh(u / c)  (logit_softcap)
    lse = log sum_j exp(y_j)          loss_row = lse - y_i
    loss = sum_rows loss_row / D      D = num_items, or the number of labelled rows ("mean"), 1 ("sum")

Gradient (``g`` = upstream gradient of the scalar loss)::

    dloss/dy_j = (softmax(y)_j - [j == i]) / D
    dloss/dz_j = dloss/dy_j * (1 - (y_j / c)^2) * s
    dh = dz @ W        dW = sum_rows dz^T h        db = sum_rows dz          (all times g)

Design choice (reductions "mean" and "sum"): the gradients are computed **during forward**, chunk
by chunk, and backward only multiplies them by ``g``.  Per chunk the logits are projected once and
reused for the loss and its gradient (3 matmuls per chunk; recomputing in backward would cost 4),
and nothing ``[tokens, vocab]``-shaped survives a chunk.  When ``g == 1`` (the usual case: let
``num_items`` do the normalising rather than dividing the loss) the saved buffers are handed to
autograd as they are; otherwise they are scaled out of place (one transient copy).  What stays alive between forward and
backward is ``dL/dhidden`` (the size of ``hidden``, which backward would allocate anyway, while
``hidden`` itself is not saved) and, for a trainable LM head, ``dL/dW`` (float32 accumulator, cast
to ``W``'s dtype at the end).  Since the loss is the last op of the forward pass, that does not
raise the step's peak.  Only labelled rows (``label != ignore_index``) are ever projected.

``reduction="none"`` returns per-token losses (0 where ignored); since each token can then receive
its own upstream gradient, it saves ``hidden`` and **recomputes** each chunk in backward (the
selective-log-softmax engine, restricted to the labelled rows).

The per-block work (log-sum-exp, then ``softmax - onehot`` written over the block in place) runs
as Triton kernels on CUDA (:mod:`swiftune.kernels.logit_stats`, :mod:`swiftune.kernels.logit_grad`;
block sizes from :mod:`swiftune.losses.chunking`; figures against
``F.cross_entropy(F.linear(h, W).float(), labels)``: docs/benchmarks.md).

Vocabularies wider than ``vocab_chunk`` (default 2^18) are processed in blocks: a first pass
gathers the log-sum-exp of every block, a second recomputes each block's logits for the gradient.

Losses are float32 (float64 for float64 inputs); gradients come back in the inputs' dtypes.

Token statistics (``return_token_stats=True``, TRL's ``entropy`` and ``mean_token_accuracy``):
the same chunk loop also returns, per labelled token and without gradient, the entropy
``H = -sum_j p_j log p_j`` of its distribution and whether its label is the arg-max (first
maximum, as ``argmax``). They come from the block already projected for the loss: the entropy
from the statistics pass (one more accumulator in the Triton kernel), the arg-max hit from one
extra read of the block, so no projection is added (vocabularies wider than ``vocab_chunk``:
one more matmul per block for the arg-max).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels.launch import Backend
from .blocks import (
    BlockStats,
    LogitTransform,
    backprop_block,
    block_grad,
    block_stats,
    compute_dtypes,
    finish_head_grads,
    fused_block_grad_,
    fused_block_stats,
    grad_from_logp_,
    matmul_block,
    project,
)
from .chunking import resolve_chunk_tokens, vocab_blocks
from .selective_log_softmax import (
    ChunkedLogProb,
    LogProbConfig,
    check_head_shapes,
    check_labels,
    materialised_logits,
    use_fused,
)


@dataclass(frozen=True)
class _CECfg:
    tf: LogitTransform
    chunk_tokens: int | None
    multiplier: float
    vocab_chunk: int | None
    mean: bool
    cd: torch.dtype
    acc: torch.dtype
    need: tuple[bool, bool, bool]  # grads of hidden, weight, bias
    fused: bool
    stats: bool = False  # also each labelled row's entropy and arg-max hit (no gradient)


class TokenStats(NamedTuple):
    """Per-token side outputs of :func:`linear_cross_entropy`, shaped like ``labels`` (no gradient).

    ``entropy``: entropy of the token's predicted distribution (0 where the label is ignored), in
    the loss's dtype; ``is_top1``: whether the label is the arg-max of the logits (False where ignored).
    """

    entropy: torch.Tensor
    is_top1: torch.Tensor


def _argmax_hit(z: torch.Tensor, labels: torch.Tensor, tf: LogitTransform) -> torch.Tensor:
    """Whether each row's label is its arg-max. The transforms are monotone (softcap: increasing; scale:
    increasing when positive), so the raw block ``z`` has the transformed logits' arg-max."""
    return (z.argmin(dim=1) if tf.scale is not None and tf.scale < 0 else z.argmax(dim=1)) == labels


def _blockwise_hit(h, w_c, b_c, blocks, labels, tf: LogitTransform) -> torch.Tensor:
    """:func:`_argmax_hit` over vocabulary blocks: each block's first maximum, the earliest block on ties."""
    sign = -1.0 if tf.scale is not None and tf.scale < 0 else 1.0
    best = arg = None
    for v0, v1 in blocks:
        top = (matmul_block(h, w_c, b_c, v0, v1) * sign).max(dim=1)
        if best is None:
            best, arg = top.values, top.indices + v0
        else:
            better = top.values > best  # strict: an equal maximum in a later block does not win
            best = torch.where(better, top.values, best)
            arg = torch.where(better, top.indices + v0, arg)
    return arg == labels


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum (or mean over ``denom``) of the cross entropy of the labelled ``rows``; grads in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows, denom, cfg: _CECfg):  # type: ignore[override]
        H, V = hidden.shape[-1], weight.shape[0]
        dev = hidden.device
        h2 = hidden.reshape(-1, H)
        n = rows.numel()
        need_h, need_w, need_b = cfg.need
        blocks = vocab_blocks(V, cfg.vocab_chunk)
        chunk = resolve_chunk_tokens(
            cfg.chunk_tokens, n, H, blocks[0][1] - blocks[0][0], dev, cfg.cd.itemsize, cfg.multiplier, cfg.fused
        )
        # per-row weight of the loss in the sum: 1/D for "mean" (a tensor: no host sync on num_items)
        g_row = (1.0 / denom) if cfg.mean else torch.ones((), dtype=cfg.acc, device=dev)
        acc_w = weight.dtype if weight.dtype == torch.float64 else cfg.acc
        grad_h = torch.zeros(h2.shape, dtype=hidden.dtype, device=dev) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc_w, device=dev) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_w, device=dev) if need_b else None
        loss = torch.zeros((), dtype=cfg.acc, device=dev)
        ent_rows = torch.zeros(n if cfg.stats else 0, dtype=cfg.acc, device=dev)
        hit_rows = torch.zeros(n if cfg.stats else 0, dtype=torch.bool, device=dev)
        any_grad = need_h or need_w or need_b
        with torch.autocast(dev.type, enabled=False):
            w_c = weight.to(cfg.cd)
            b_c = None if bias is None else bias.to(cfg.cd)
            for a in range(0, n, chunk):
                idx = rows[a : a + chunk]
                lab = labels[a : a + chunk]
                h = h2.index_select(0, idx).to(cfg.cd)
                g_ce = g_row.expand(idx.numel())
                gh = None
                if len(blocks) == 1 and cfg.fused:  # one projection serves loss and gradient
                    z = matmul_block(h, w_c, b_c, 0, V)
                    st = fused_block_stats(z, lab, 0, cfg.tf, cfg.stats)
                    loss += (st.lse - st.target).sum()
                    if cfg.stats:  # before the gradient overwrites z
                        hit_rows[a : a + chunk] = _argmax_hit(z, lab, cfg.tf)
                        ent_rows[a : a + chunk] = st.ent
                    if any_grad:
                        gc = fused_block_grad_(z, lab, 0, st.lse, g_ce, None, None, cfg.tf)
                        gh = backprop_block(gc, h, w_c, 0, V, grad_w, grad_b, need_h)
                        del gc
                    del z
                elif len(blocks) == 1:  # the same in PyTorch block math
                    y = project(h, w_c, b_c, 0, V, cfg.tf, cfg.acc)
                    if cfg.stats:
                        hit_rows[a : a + chunk] = y.argmax(dim=1) == lab  # y is the transformed logits
                    # the entropy may reuse y's storage unless the softcap factor still needs y
                    st, logq = BlockStats.of(y, lab, 0, cfg.stats and cfg.tf.softcap is None)
                    if cfg.stats:
                        ent_rows[a : a + chunk] = st.ent if st.ent is not None else _entropy_of(logq)
                    loss += (st.lse - st.target).sum()
                    if any_grad:
                        d = cfg.tf.softcap_factor(y, inplace=True)
                        del y
                        gc = grad_from_logp_(logq, d, lab, 0, g_ce, None, None, cfg.tf, cfg.cd)
                        del logq, d
                        gh = backprop_block(gc, h, w_c, 0, V, grad_w, grad_b, need_h)
                        del gc
                    else:
                        del y, logq
                else:  # pass 1: log-sum-exp over blocks; pass 2: gradient per recomputed block
                    st = None
                    for v0, v1 in blocks:
                        bs = block_stats(h, w_c, b_c, v0, v1, lab, cfg.tf, cfg.acc, cfg.stats, cfg.fused)
                        st = bs if st is None else st.merge(bs)
                    assert st is not None
                    loss += (st.lse - st.target).sum()
                    if cfg.stats:
                        hit_rows[a : a + chunk] = _blockwise_hit(h, w_c, b_c, blocks, lab, cfg.tf)
                        ent_rows[a : a + chunk] = st.ent
                    for v0, v1 in blocks if any_grad else ():
                        gc = block_grad(h, w_c, b_c, v0, v1, lab, st.lse, g_ce, None, None, cfg.tf, cfg.acc, cfg.fused)
                        part = backprop_block(gc, h, w_c, v0, v1, grad_w, grad_b, need_h)
                        del gc
                        if part is not None:
                            gh = part.to(cfg.acc) if gh is None else gh.add_(part)
                if grad_h is not None:
                    assert gh is not None
                    grad_h.index_copy_(0, idx, gh.to(grad_h.dtype))
        if cfg.mean:
            loss = loss / denom
        grad_h, grad_w, grad_b = finish_head_grads(grad_h, grad_w, grad_b, hidden.shape, weight, bias)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.mark_non_differentiable(ent_rows, hit_rows)
        return loss, ent_rows, hit_rows

    @staticmethod
    def backward(ctx, g, _g_ent=None, _g_hit=None):  # type: ignore[override]
        saved = ctx.saved_tensors
        if bool(g == 1):  # the usual case (num_items does the normalising): hand the buffers over
            return saved[0], saved[1], saved[2], None, None, None, None
        # Scaled loss (AMP, loss / steps): out of place, so retain_graph / repeated backward stay
        # correct; the saved buffer is released right after.
        grads = [None if t is None else t * g.to(t.dtype) for t in saved]
        return grads[0], grads[1], grads[2], None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items: int | float | torch.Tensor | None = None,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    *,
    chunk_multiplier: float = 1.0,
    vocab_chunk: int | None = None,
    backend: Backend = "auto",
    return_token_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, TokenStats]:
    """Cross entropy of ``softcap(logit_scale * (hidden @ weight.T + bias))`` against ``labels``.

    Args:
        hidden: ``[..., H]`` final hidden states.  ``weight``: ``[V, H]``.  ``bias``: optional ``[V]``.
        labels: ``[...]`` already aligned with ``hidden`` (no shifting here); ``ignore_index`` rows
            are skipped entirely (never projected).
        reduction: ``"mean"`` (sum / ``num_items`` or / number of labelled tokens), ``"sum"``, or
            ``"none"`` (per-token float32 losses shaped like ``labels``, 0 where ignored).
        num_items: global labelled-token count (python number or 0-d tensor) for gradient
            accumulation / data parallel: each micro-batch's loss is ``sum / num_items`` so that the
            summed micro-batch losses equal the loss of one big batch.  Only with ``"mean"``.
        logit_softcap, logit_scale: see :class:`~swiftune.losses.blocks.LogitTransform`
            (order: bias, then scale, then softcap).
        chunk_tokens: labelled rows per chunk (``None``: automatic from free memory, times
            ``chunk_multiplier``).  ``vocab_chunk``: widest vocabulary block (default 2^18).
        backend: ``"auto"`` (Triton block kernels on CUDA / under the interpreter, else PyTorch),
            ``"reference"`` (PyTorch block math, still chunked) or ``"triton"``.
        return_token_stats: also return :class:`TokenStats` (each token's entropy and arg-max hit,
            no gradient) from the same chunk loop: ``(loss, stats)``. With ``reduction="none"``
            (whose loss recomputes in backward) they take one more no-grad pass over the chunks.

    Mean over zero labelled tokens is 0 with zero gradients, never NaN.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    check_head_shapes(hidden, weight, bias, labels, "labels")
    if num_items is not None and reduction != "mean":
        raise ValueError("num_items only applies to reduction='mean'")
    flat = labels.reshape(-1).long()
    rows = (flat != ignore_index).nonzero().squeeze(1)  # host sync: the chunk loop needs the count
    sel = flat.index_select(0, rows)
    check_labels(sel, weight.shape[0], "labels")
    cd, acc = compute_dtypes(hidden, weight)
    tf = LogitTransform(logit_scale, logit_softcap, 1.0)
    fused = use_fused(backend, hidden, weight, acc)
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))

    def with_stats(loss: torch.Tensor, ent: torch.Tensor, hit: torch.Tensor):
        if not return_token_stats:
            return loss
        full_ent = torch.zeros(flat.shape, dtype=acc, device=hidden.device).index_put((rows,), ent)
        full_hit = torch.zeros(flat.shape, dtype=torch.bool, device=hidden.device).index_put((rows,), hit)
        return loss, TokenStats(full_ent.view(labels.shape), full_hit.view(labels.shape))

    if reduction == "none":
        cfg = LogProbConfig(tf, chunk_tokens, chunk_multiplier, vocab_chunk, False, False, cd, acc, fused)
        logp = ChunkedLogProb.apply(hidden, weight, bias, sel, rows, cfg)
        out = torch.zeros(flat.shape, dtype=acc, device=hidden.device).index_put((rows,), -logp)
        if not return_token_stats:
            return out.view(labels.shape)
        with torch.no_grad():  # the statistics pass: the cross-entropy loop without gradients
            ones = torch.ones((), dtype=acc, device=hidden.device)
            cfg_s = _CECfg(tf, chunk_tokens, chunk_multiplier, vocab_chunk, False, cd, acc, (False, False, False),
                           fused, True)
            _, ent, hit = FusedLinearCrossEntropy.apply(hidden.detach(), weight.detach(), None if bias is None
                                                        else bias.detach(), sel, rows, ones, cfg_s)
        return with_stats(out.view(labels.shape), ent, hit)

    if reduction == "sum":
        denom = torch.ones((), dtype=acc, device=hidden.device)
    elif num_items is None:
        denom = torch.tensor(float(max(rows.numel(), 1)), dtype=acc, device=hidden.device)
    else:
        # clamp: a global count of 0 means every micro-batch is empty, so the sum is 0 too
        denom = torch.as_tensor(num_items, device=hidden.device).to(acc).clamp_min(1.0)
    cfg_ce = _CECfg(tf, chunk_tokens, chunk_multiplier, vocab_chunk, reduction == "mean", cd, acc, need, fused,  # type: ignore[arg-type]
                    return_token_stats)
    return with_stats(*FusedLinearCrossEntropy.apply(hidden, weight, bias, sel, rows, denom, cfg_ce))


def _entropy_of(logq: torch.Tensor) -> torch.Tensor:
    """Row entropies ``-sum_j q_j log q_j`` of a log-softmax block (one transient block for ``q``)."""
    q = logq.exp()
    return -torch.bmm(q.unsqueeze(1), logq.unsqueeze(2)).view(-1)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items: int | float | torch.Tensor | None = None,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: materialises the logits (float32, or float64 for float64 inputs)."""
    y = materialised_logits(hidden, weight, bias, logit_scale, logit_softcap)
    losses = F.cross_entropy(
        y.reshape(-1, y.shape[-1]), labels.reshape(-1).long(), ignore_index=ignore_index, reduction="none"
    )
    if reduction == "none":
        return losses.view(labels.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    if num_items is None:
        count = (labels != ignore_index).sum()
    else:
        count = torch.as_tensor(num_items, device=total.device)
    return total / count.to(total.dtype).clamp_min(1.0)
