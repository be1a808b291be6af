"""The per-block math shared by swiftune's losses, in two interchangeable forms.

* fused Triton kernels (CUDA; CPU under ``TRITON_INTERPRET=1``; in :mod:`swiftune.kernels.logit_stats`
  and :mod:`swiftune.kernels.logit_grad`): one pass over the raw matmul output ``z`` for the
  statistics, one pass that writes ``dL/dz`` over ``z`` in place.  A block costs
  ``vocab_chunk * dtype_bytes`` per token and the elementwise work is ~2 reads + 1 write;
* plain PyTorch ("reference" backend, and float64): an upcast float32 copy, ``log_softmax`` and
  in-place ops, about ``vocab_chunk * (4 + 4 + dtype_bytes)`` bytes per token.

Block sizes come from :mod:`swiftune.losses.chunking`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.logit_grad import logit_block_grad_
from ..kernels.logit_stats import logit_block_stats, logit_stats_kernel

# ----------------------------------------------------------------------------------------------
# Per-block math.  Notation (per token row, vocabulary column j):
#   z_j  = h . W_j (+ b_j)                    matmul in the compute dtype (bf16 on GPU)
#   u_j  = s * z_j                            logit_scale s (1 if unset)
#   y_j  = c * tanh(u_j / c)                  logit_softcap c (y = u if unset)
#   y'_j = y_j / T                            temperature T (1 for cross entropy)
#   lse = log sum_j exp(y'_j),  logp_j = y'_j - lse,  p_j = exp(logp_j),  H = -sum_j p_j logp_j
# Chain rule back to z:  dL/dz_j = dL/dy'_j * (1 - (y_j/c)^2) * s / T,  with y_j / c = y'_j T / c.
# Every [rows, block] float32 temporary counts against the chunk budget, so the code below works
# in place wherever it can and names each new block it allocates.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitTransform:
    """``y' = softcap(z * scale) / temperature`` applied in place to a float32 block."""

    scale: float | None = None
    softcap: float | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.softcap}")

    def apply_(self, y: torch.Tensor) -> torch.Tensor:
        s = 1.0 if self.scale is None else float(self.scale)
        inv_t = 1.0 / self.temperature
        if self.softcap is not None:
            c = float(self.softcap)
            y.mul_(s / c).tanh_().mul_(c * inv_t)
        elif s * inv_t != 1.0:
            y.mul_(s * inv_t)
        return y

    def chain_const(self) -> float:
        """The constant part of ``dy'/dz``: ``s / T``."""
        return (1.0 if self.scale is None else float(self.scale)) / self.temperature

    def softcap_factor(self, y: torch.Tensor, inplace: bool) -> torch.Tensor | None:
        """``1 - (y/c)^2`` from the transformed ``y'`` (in ``y``'s storage if ``inplace``)."""
        if self.softcap is None:
            return None
        k = self.temperature / float(self.softcap)
        d = y.mul_(k) if inplace else torch.mul(y, k)  # new block unless inplace
        return d.square_().neg_().add_(1.0)


def project(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    v0: int,
    v1: int,
    tf: LogitTransform,
    acc_dtype: torch.dtype,
) -> torch.Tensor:
    """Transformed logits ``y'`` of rows ``h`` against vocabulary rows ``[v0, v1)``, in ``acc_dtype``.

    The matmul runs in the inputs' dtype (tensor cores, float32 accumulation inside the GEMM,
    exactly as ``F.linear`` would); its result is upcast once and transformed in place.
    """
    return tf.apply_(matmul_block(h, w, b, v0, v1).to(acc_dtype))


def _target_mask(labels: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    inside = (labels >= v0) & (labels < v0 + width)
    return inside, (labels - v0).clamp_(0, width - 1)


@dataclass
class BlockStats:
    """Softmax statistics of one or more vocabulary blocks: ``lse``, entropy ``H``, target ``y'``.

    Blocks merge exactly: ``lse = logaddexp(lse1, lse2)`` and, with ``w_k = exp(lse_k - lse)``,
    ``H = sum_k w_k (H_k - log w_k)`` (the entropy of a mixture of disjoint supports).
    """

    lse: torch.Tensor
    ent: torch.Tensor | None
    target: torch.Tensor

    @staticmethod
    def of(y: torch.Tensor, labels: torch.Tensor, v0: int, want_entropy: bool) -> tuple["BlockStats", torch.Tensor]:
        """Statistics of block ``y'`` and its ``log_softmax`` (a new block).

        With ``want_entropy`` the storage of ``y`` is reused for ``exp(logq)``; otherwise ``y``
        is left intact (cross entropy reuses it for the softcap factor).
        """
        inside, col = _target_mask(labels, v0, y.shape[1])
        target = torch.where(inside, y.gather(1, col[:, None]).squeeze(1), 0.0)
        logq = torch.log_softmax(y, dim=1)  # one fused kernel; new block
        # lse of the block from any column: y'_0 - log q_0 (both finite: logits are finite)
        lse = y[:, 0] - logq[:, 0]
        ent = None
        if want_entropy:
            q = torch.exp(logq, out=y)  # y is no longer needed: reuse its storage
            ent = -torch.bmm(q.unsqueeze(1), logq.unsqueeze(2)).view(-1)  # no product block
        return BlockStats(lse, ent, target), logq

    def merge(self, other: "BlockStats") -> "BlockStats":
        lse = torch.logaddexp(self.lse, other.lse)
        ent = None
        if self.ent is not None and other.ent is not None:
            la, lb = self.lse - lse, other.lse - lse  # log w_k
            ent = la.exp() * (self.ent - la) + lb.exp() * (other.ent - lb)
        return BlockStats(lse, ent, self.target + other.target)


def grad_from_logp_(
    logp: torch.Tensor,
    d: torch.Tensor | None,
    labels: torch.Tensor,
    v0: int,
    g_ce: torch.Tensor,
    g_ent: torch.Tensor | None,
    ent: torch.Tensor | None,
    tf: LogitTransform,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dL/dz`` for one block from its log-probabilities (consumed), cast to ``out_dtype``.

    ``L = sum_rows g_ce * (lse - y'_label) + g_ent * H`` with ``g_ce`` per row (cross entropy:
    ``1/num_items``; selective log-softmax: ``-dL/dlogp``), so::

        dL/dy'_j = g_ce * (p_j - [j == label]) - g_ent * p_j * (logp_j + H)
        dL/dz_j  = dL/dy'_j * d_j * s / T,      d_j = 1 - (y_j / c)^2 (1 without softcap)

    The final per-row scaling and the cast to the matmul dtype are one fused ``mul(out=)``.
    """
    inside, col = _target_mask(labels, v0, logp.shape[1])
    k = tf.chain_const()
    if g_ent is not None:
        assert ent is not None
        coef = torch.add(logp, ent[:, None]).mul_(-g_ent[:, None]).add_(g_ce[:, None])  # new block
        g = logp.exp_().mul_(coef)
        del coef
        g.scatter_add_(1, col[:, None], torch.where(inside, -g_ce, 0.0).to(g.dtype)[:, None])
        row = torch.full_like(g_ce, k)
    else:
        g = logp.exp_()
        g.scatter_add_(1, col[:, None], torch.where(inside, -1.0, 0.0).to(g.dtype)[:, None])
        row = g_ce * k
    if d is not None:
        g.mul_(d)
    if out_dtype == g.dtype:
        return g.mul_(row[:, None].to(g.dtype))
    return torch.mul(g, row[:, None].to(g.dtype), out=torch.empty(g.shape, dtype=out_dtype, device=g.device))


def grad_logits_(
    y: torch.Tensor,
    v0: int,
    labels: torch.Tensor,
    lse: torch.Tensor,
    g_ce: torch.Tensor,
    g_ent: torch.Tensor | None,
    ent: torch.Tensor | None,
    tf: LogitTransform,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`grad_from_logp_` for a recomputed block ``y'`` whose row ``lse`` is known (y consumed)."""
    d = tf.softcap_factor(y, inplace=False)  # new block (softcap only)
    return grad_from_logp_(y.sub_(lse[:, None]), d, labels, v0, g_ce, g_ent, ent, tf, out_dtype)


def backprop_block(
    gc: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    v0: int,
    v1: int,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    need_h: bool,
) -> torch.Tensor | None:
    """Accumulate ``gc^T h`` into ``grad_w[v0:v1]`` and ``sum(gc)`` into ``grad_b``; return ``gc @ W``.

    ``gc`` is already in the matmul dtype (bf16 GEMMs on GPU); the accumulators are float32, so
    summing many token chunks does not round in bf16 at every step.
    """
    if grad_b is not None:
        grad_b[v0:v1].add_(gc.sum(dim=0, dtype=grad_b.dtype))
    if grad_w is not None:
        if grad_w.dtype == gc.dtype:
            grad_w[v0:v1].addmm_(gc.t(), h)
        else:
            grad_w[v0:v1].add_(torch.mm(gc.t(), h))
    return torch.mm(gc, w[v0:v1]) if need_h else None


def finish_head_grads(
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    hidden_shape: torch.Size,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loops' gradients as autograd returns them: the flat ``[rows, H]`` hidden gradient
    shaped like ``hidden``, the float32 (float64) weight and bias accumulators cast to their dtypes."""
    if grad_h is not None:
        grad_h = grad_h.view(hidden_shape)
    if grad_w is not None:
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None:
        assert bias is not None
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


# ----------------------------------------------------------------------------------------------
# Fused path: the same per-block math as Triton kernels over the raw matmul output ``z`` (in its
# own dtype): one pass for the statistics (swiftune.kernels.logit_stats), one that writes dL/dz
# over z in place (swiftune.kernels.logit_grad), so the block needs no float32 copy at all.
# ----------------------------------------------------------------------------------------------


def fused_block_stats(
    z: torch.Tensor, labels: torch.Tensor, v0: int, tf: LogitTransform, want_entropy: bool
) -> BlockStats:
    """:class:`BlockStats` of raw block ``z`` (matmul dtype, row-contiguous) in one Triton pass."""
    lse, tgt, ent = logit_block_stats(z, labels, v0, tf.scale, tf.softcap, tf.temperature, want_entropy)
    return BlockStats(lse, ent, tgt)


def fused_block_grad_(
    z: torch.Tensor,
    labels: torch.Tensor,
    v0: int,
    lse: torch.Tensor,
    g_ce: torch.Tensor,
    g_ent: torch.Tensor | None,
    ent: torch.Tensor | None,
    tf: LogitTransform,
) -> torch.Tensor:
    """``dL/dz`` (formula of :func:`grad_from_logp_`) written over ``z`` in place; returns ``z``."""
    return logit_block_grad_(z, labels, v0, lse, g_ce, g_ent, ent, tf.scale, tf.softcap, tf.temperature)


def matmul_block(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, v0: int, v1: int) -> torch.Tensor:
    """Raw ``z = h W[v0:v1]^T (+ b)`` in the matmul dtype, row-contiguous."""
    wt = w[v0:v1].t()
    return torch.mm(h, wt) if b is None else torch.addmm(b[v0:v1], h, wt)


def fused_kernel() -> object:
    """The kernel object :func:`swiftune.kernels.launch.choose_backend` inspects."""
    return logit_stats_kernel


def block_stats(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, v0: int, v1: int, labels: torch.Tensor,
    tf: LogitTransform, acc: torch.dtype, want_entropy: bool, fused: bool,
) -> BlockStats:
    """Project rows ``h`` on vocabulary rows ``[v0, v1)`` and reduce to :class:`BlockStats`."""
    if fused:
        return fused_block_stats(matmul_block(h, w, b, v0, v1), labels, v0, tf, want_entropy)
    return BlockStats.of(project(h, w, b, v0, v1, tf, acc), labels, v0, want_entropy)[0]


def block_grad(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, v0: int, v1: int, labels: torch.Tensor,
    lse: torch.Tensor, g_ce: torch.Tensor, g_ent: torch.Tensor | None, ent: torch.Tensor | None,
    tf: LogitTransform, acc: torch.dtype, fused: bool,
) -> torch.Tensor:
    """Recompute block ``[v0, v1)`` and return ``dL/dz`` in the matmul dtype."""
    if fused:
        return fused_block_grad_(matmul_block(h, w, b, v0, v1), labels, v0, lse, g_ce, g_ent, ent, tf)
    y = project(h, w, b, v0, v1, tf, acc)
    return grad_logits_(y, v0, labels, lse, g_ce, g_ent, ent, tf, h.dtype)


def compute_dtypes(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, statistics dtype).

    Matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), otherwise in the
    promoted dtype of ``hidden`` and ``weight``; statistics and gradients of the logits run in
    float32, or float64 when the matmul does (so the function doubles as a float64 reference).
    """
    dev = hidden.device.type
    try:
        autocast = torch.is_autocast_enabled(dev)
    except TypeError:  # pragma: no cover - very old signature
        autocast = False
    cd = torch.get_autocast_dtype(dev) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    acc = torch.float64 if cd == torch.float64 else torch.float32
    return cd, acc
