"""Forward phase of the chunked LM-head losses: softmax statistics of one logits block.

One program per token row reads the raw matmul output ``z`` of a vocabulary block (columns
``[v0, v0 + n_cols)``, in the matmul dtype) once, in tiles of ``BLOCK`` columns, and writes three
float32 numbers per row. With logit scale ``s``, soft-cap ``c`` and temperature ``T``::

    y'_j = c tanh(s z_j / c) / T        (without soft-cap: y'_j = s z_j / T)
    lse  = log sum_j exp(y'_j)          (online: running max m, running sum d rescaled by exp(m - m'))
    H    = lse - sum_j exp(y'_j - lse) y'_j       (entropy, only with ``want_entropy``)
    tgt  = y'_label if v0 <= label < v0 + n_cols else 0

Statistics of several blocks merge exactly (``logaddexp`` of the ``lse``); the losses do that.
The backward phase, ``dL/dz`` written over ``z``, is :mod:`swiftune.kernels.logit_grad`; the
plain-PyTorch reference of both is :func:`logit_block_stats_reference` and
:func:`~swiftune.kernels.logit_grad.logit_block_grad_reference`.

``tanh`` is written as ``2 sigmoid(2x) - 1``: it is portable across Triton versions and the
interpreter.
"""

from __future__ import annotations

import torch

from .launch import next_pow2, tl, triton

if triton is not None:

    @triton.jit
    def logit_stats_kernel(
        z_ptr, lab_ptr, lse_ptr, tgt_ptr, ent_ptr, n_cols, stride_z, v0, a, b,
        SOFTCAP: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # rows x columns of one block can pass 2^31
        base = z_ptr + row * stride_z
        label = tl.load(lab_ptr + row) - v0
        m = float("-inf")
        d = 0.0
        t = 0.0
        tgt = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                y = (2.0 * tl.sigmoid(2.0 * a * z) - 1.0) * b
            else:
                y = z * a
            y = tl.where(mask, y, float("-inf"))
            m_new = tl.maximum(m, tl.max(y, axis=0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(y - m_new)
            d = d * alpha + tl.sum(e, axis=0)
            if WANT_ENT:
                t = t * alpha + tl.sum(e * tl.where(mask, y, 0.0), axis=0)  # 0 * -inf would be NaN
            tgt += tl.sum(tl.where((cols == label) & mask, y, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(d)
        tl.store(lse_ptr + row, lse)
        tl.store(tgt_ptr + row, tgt)
        if WANT_ENT:
            tl.store(ent_ptr + row, lse - t / d)

else:  # pragma: no cover
    logit_stats_kernel = None


INTERPRETER_BLOCK = 512  # columns of a tile under the Triton interpreter (CPU)


def logit_launch_args(z: torch.Tensor, scale: float | None, softcap: float | None,
                      temperature: float) -> tuple[float, float, dict]:
    """``(a, b, meta)`` of both logit kernels: ``y' = b tanh(a z)`` with a soft-cap (``a = s / c``,
    ``b = c / T``), else ``y' = a z`` (``a = s / T``); ``meta`` the tile width and warps."""
    s = 1.0 if scale is None else float(scale)
    if softcap is not None:
        a, b = s / float(softcap), float(softcap) / temperature
    else:
        a, b = s / temperature, 1.0
    if z.is_cuda:
        block = min(4096, next_pow2(z.shape[1]))
        meta = {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}
    else:  # interpreter: it runs a tile's operations as numpy calls, each of about the same cost at 32 or 512
        # columns, so wide tiles make a CPU test's loss fast (the unit tests give wider blocks: several tiles)
        meta = {"BLOCK": min(INTERPRETER_BLOCK, next_pow2(z.shape[1]))}
    return a, b, meta


def row_vector(t: torch.Tensor) -> torch.Tensor:
    """A per-row input as the kernels read it: float32, contiguous (callers may pass expanded,
    stride-0 views)."""
    return t.to(torch.float32).contiguous()


def logit_block_stats(
    z: torch.Tensor, labels: torch.Tensor, v0: int, scale: float | None, softcap: float | None,
    temperature: float, want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, tgt, H or None)`` of raw block ``z`` (matmul dtype, row-contiguous) in one Triton
    pass; float32, one entry per row (the module doc's math)."""
    rows = z.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    tgt = torch.empty_like(lse)
    ent = torch.empty_like(lse) if want_entropy else None
    if rows:
        a, b, meta = logit_launch_args(z, scale, softcap, temperature)
        logit_stats_kernel[(rows,)](
            z, labels.contiguous(), lse, tgt, lse if ent is None else ent, z.shape[1], z.stride(0), v0, a, b,
            SOFTCAP=softcap is not None, WANT_ENT=want_entropy, **meta,
        )
    return lse, tgt, ent


def transformed_logits(z: torch.Tensor, scale: float | None, softcap: float | None,
                       temperature: float) -> torch.Tensor:
    """``y'`` of the module doc in float32 (the references' first step)."""
    y = z.float() * (1.0 if scale is None else float(scale))
    if softcap is not None:
        y = float(softcap) * torch.tanh(y / float(softcap))
    return y / temperature


def logit_block_stats_reference(
    z: torch.Tensor, labels: torch.Tensor, v0: int, scale: float | None, softcap: float | None,
    temperature: float, want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch :func:`logit_block_stats`: materialises ``y'`` and its ``log_softmax``."""
    y = transformed_logits(z, scale, softcap, temperature)
    logp = torch.log_softmax(y, dim=1)
    lse = torch.logsumexp(y, dim=1)
    col = labels.long() - v0
    inside = (col >= 0) & (col < y.shape[1])
    tgt = torch.where(inside, y.gather(1, col.clamp(0, y.shape[1] - 1)[:, None]).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(1) if want_entropy else None
    return lse, tgt, ent


__all__ = ["logit_block_stats", "logit_block_stats_reference", "logit_launch_args", "logit_stats_kernel",
           "row_vector", "transformed_logits"]
