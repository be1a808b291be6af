"""Backward phase of the chunked LM-head losses: ``dL/dz`` of one logits block, in place.

One program per token row reads the raw matmul output ``z`` of a vocabulary block (columns
``[v0, v0 + n_cols)``) in tiles of ``BLOCK`` columns and writes the gradient over it, in ``z``'s
dtype, so the block needs no float32 copy. With the row's ``lse`` (and entropy ``H``) from the
forward phase (:mod:`swiftune.kernels.logit_stats`), ``y'`` as defined there, and the loss
``L = sum_rows g_ce (lse - y'_label) + g_ent H``::

    logp_j   = y'_j - lse,      p_j = exp(logp_j)
    dL/dy'_j = g_ce (p_j - [j == label]) - g_ent p_j (logp_j + H)
    dL/dz_j  = dL/dy'_j * (1 - (y_j / c)^2) * s / T      (the soft-cap factor only with a soft-cap)

Cross entropy passes ``g_ce = 1 / num_items`` and no entropy; the selective log-softmax passes
``g_ce = -dL/dlogp`` and, when the entropy is used, ``g_ent = dL/dH``. The plain-PyTorch
reference is :func:`logit_block_grad_reference`.
"""

from __future__ import annotations

import torch

from .launch import tl, triton
from .logit_stats import logit_launch_args, row_vector, transformed_logits

if triton is not None:

    @triton.jit
    def logit_grad_kernel(
        z_ptr, lab_ptr, lse_ptr, gce_ptr, gent_ptr, ent_ptr, n_cols, stride_z, v0, a, b, k,
        SOFTCAP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride_z
        label = tl.load(lab_ptr + row) - v0
        lse = tl.load(lse_ptr + row)
        gce = tl.load(gce_ptr + row)
        gent = 0.0
        ent = 0.0
        if HAS_ENT:
            gent = tl.load(gent_ptr + row)
            ent = tl.load(ent_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                th = 2.0 * tl.sigmoid(2.0 * a * z) - 1.0
                y = th * b
            else:
                y = z * a
            logp = y - lse
            p = tl.exp(logp)
            g = gce * (p - tl.where(cols == label, 1.0, 0.0))
            if HAS_ENT:
                g -= gent * p * (logp + ent)
            if SOFTCAP:
                g = g * (1.0 - th * th)
            tl.store(base + cols, (g * k).to(z_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    logit_grad_kernel = None


def logit_block_grad_(
    z: torch.Tensor, labels: torch.Tensor, v0: int, lse: torch.Tensor, g_ce: torch.Tensor,
    g_ent: torch.Tensor | None, ent: torch.Tensor | None, scale: float | None, softcap: float | None,
    temperature: float,
) -> torch.Tensor:
    """``dL/dz`` (the module doc's formula) written over raw block ``z`` in place; returns ``z``.
    ``lse``, ``g_ce``, ``g_ent`` and ``ent`` hold one value per row."""
    if z.shape[0]:
        a, b, meta = logit_launch_args(z, scale, softcap, temperature)
        k = (1.0 if scale is None else float(scale)) / temperature
        gce = row_vector(g_ce)
        logit_grad_kernel[(z.shape[0],)](
            z, labels.contiguous(), row_vector(lse), gce,
            gce if g_ent is None else row_vector(g_ent), gce if ent is None else row_vector(ent),
            z.shape[1], z.stride(0), v0, a, b, k,
            SOFTCAP=softcap is not None, HAS_ENT=g_ent is not None, **meta,
        )
    return z


def logit_block_grad_reference(
    z: torch.Tensor, labels: torch.Tensor, v0: int, lse: torch.Tensor, g_ce: torch.Tensor,
    g_ent: torch.Tensor | None, ent: torch.Tensor | None, scale: float | None, softcap: float | None,
    temperature: float,
) -> torch.Tensor:
    """Plain PyTorch :func:`logit_block_grad_`, out of place, through autograd: the gradient of
    ``sum_rows g_ce (lse - y'_label) + g_ent H`` with ``lse`` and ``H`` recomputed from ``z``
    (they equal the given ones, which are only there to match the kernel's signature)."""
    zz = z.detach().float().requires_grad_(True)
    y = transformed_logits(zz, scale, softcap, temperature)
    logp = torch.log_softmax(y, dim=1)
    col = labels.long() - v0
    inside = (col >= 0) & (col < y.shape[1])
    picked = torch.where(inside, y.gather(1, col.clamp(0, y.shape[1] - 1)[:, None]).squeeze(1), 0.0)
    loss = (g_ce.float() * (torch.logsumexp(y, dim=1) - picked)).sum()
    if g_ent is not None:
        loss = loss + (g_ent.float() * -(logp.exp() * logp).sum(1)).sum()
    (grad,) = torch.autograd.grad(loss, zz)
    return grad.to(z.dtype)


__all__ = ["logit_block_grad_", "logit_block_grad_reference", "logit_grad_kernel"]
