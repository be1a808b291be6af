"""Chunk sizes and the chunked-logits primitives shared by swiftune's losses.

Both losses (:func:`~swiftune.losses.linear_cross_entropy` and
:func:`~swiftune.losses.selective_log_softmax`) walk the flattened token axis in chunks of
``chunk_tokens`` rows, and the vocabulary in chunks of at most ``vocab_chunk`` columns, so the
only ``[tokens, vocab]``-shaped memory alive at any time is one ``[chunk_tokens, vocab_chunk]``
block.  This module chooses those sizes and holds the per-block math.

Chunk size
----------
One block costs, per token row, about::

    bytes_per_token = vocab_chunk * (4 + 4 + dtype_bytes) + hidden_size * (dtype_bytes + 4)

(float32 logits, one float32 temporary that becomes the logits' gradient, the low-precision
copy of that gradient fed to the backward matmuls, and the chunk's hidden rows plus their
float32 gradient).  :func:`choose_chunk_tokens` gives the block ``memory_fraction`` (1/4) of the
free GPU memory times ``multiplier``, clamps to ``[min_chunk, max_chunk]``, rounds down to a
multiple of 64 (tensor-core friendly), and finally balances the chunks so the last one is not a
sliver (``ceil(num_tokens / ceil(num_tokens / chunk))``, rounded up to 64, never above the
unbalanced size).  The result is monotone in ``free_bytes``, at least 1 and at most
``num_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Vocabularies up to this many columns are projected in one block per token chunk; larger ones
#: are split into balanced blocks of at most this width.  2^18 keeps every current LLM vocabulary
#: (Qwen 151,936; Gemma-3 262,144; Llama-3 128,256) in one block: splitting costs an extra logits
#: matmul in :func:`linear_cross_entropy` (two passes: log-sum-exp, then gradients).
MAX_VOCAB_CHUNK = 2**18

#: Budget used when the tensors live on the CPU (there is no free-memory query worth trusting).
CPU_BUDGET_BYTES = 4 * 2**30

#: Fraction of free GPU memory one ``[chunk_tokens, vocab_chunk]`` block may use.
MEMORY_FRACTION = 0.25

_ALIGN = 64


def choose_chunk_tokens(
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    free_bytes: int,
    dtype_bytes: int = 2,
    multiplier: float = 1.0,
    min_chunk: int = 16,
    max_chunk: int = 4096,
    memory_fraction: float = MEMORY_FRACTION,
) -> int:
    """Token-chunk size for the chunked losses (a pure function of its arguments).

    ``vocab_size`` is the width of one vocabulary block (``min(V, vocab_chunk)``).  The block of
    float32 logits, its float32 gradient and their ``dtype_bytes`` copy get
    ``free_bytes * memory_fraction * multiplier`` bytes; the chunk is clamped to
    ``[min_chunk, max_chunk * multiplier]`` and to ``[1, num_tokens]``.  ``multiplier`` is the
    ``logit_chunk_multiplier`` knob: 2.0 means chunks twice as large (faster, more memory).
    """
    if num_tokens <= 0:
        return 1
    if multiplier <= 0:
        raise ValueError(f"multiplier must be positive, got {multiplier}")
    per_token = vocab_size * (8 + dtype_bytes) + hidden_size * (dtype_bytes + 4)
    budget = max(0.0, float(free_bytes)) * memory_fraction * multiplier
    chunk = int(budget // max(per_token, 1))
    chunk = min(max(chunk, min_chunk), max(int(max_chunk * multiplier), min_chunk))
    if chunk >= _ALIGN:
        chunk -= chunk % _ALIGN
    chunk = max(1, min(chunk, num_tokens))
    # Balance: same number of chunks, equal sizes (monotone: fewer chunks -> larger sizes).
    n_chunks = math.ceil(num_tokens / chunk)
    balanced = math.ceil(num_tokens / n_chunks)
    if chunk >= _ALIGN:
        balanced = min(chunk, -(-balanced // _ALIGN) * _ALIGN)
    return max(1, min(balanced, num_tokens))


def free_gpu_bytes(device: torch.device | str | None = None) -> int:
    """Bytes a new allocation can use on ``device``.

    CUDA: the driver's free memory plus what PyTorch's caching allocator has reserved but not
    handed out (that memory is reusable by us but invisible to ``mem_get_info``).  CPU (or no
    CUDA): the fixed :data:`CPU_BUDGET_BYTES`.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return CPU_BUDGET_BYTES
    free, _total = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int(free + max(cached, 0))


def resolve_chunk_tokens(
    chunk_tokens: int | None,
    num_tokens: int,
    hidden_size: int,
    vocab_block: int,
    device: torch.device,
    dtype_bytes: int,
    multiplier: float = 1.0,
) -> int:
    """An explicit ``chunk_tokens`` (clamped to ``[1, num_tokens]``) or the automatic choice."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return max(1, min(int(chunk_tokens), max(num_tokens, 1)))
    return choose_chunk_tokens(
        num_tokens, hidden_size, vocab_block, free_gpu_bytes(device), dtype_bytes, multiplier
    )


def vocab_blocks(vocab_size: int, vocab_chunk: int | None) -> list[tuple[int, int]]:
    """Balanced ``[v0, v1)`` column ranges, each at most ``vocab_chunk`` (default 2^18) wide."""
    limit = MAX_VOCAB_CHUNK if vocab_chunk is None else int(vocab_chunk)
    if limit < 1:
        raise ValueError(f"vocab_chunk must be >= 1, got {vocab_chunk}")
    n = max(1, math.ceil(vocab_size / limit))
    width = math.ceil(vocab_size / n)
    return [(v0, min(v0 + width, vocab_size)) for v0 in range(0, vocab_size, width)]


# ----------------------------------------------------------------------------------------------
# Per-block math.  Notation (per token row, vocabulary column j):
#   z_j  = h . W_j (+ b_j)                    matmul in the compute dtype (bf16 on GPU)
#   u_j  = s * z_j                            logit_scale s (1 if unset)
#   y_j  = c * tanh(u_j / c)                  logit_softcap c (y = u if unset)
#   y'_j = y_j / T                            temperature T (1 for cross entropy)
#   lse  = log sum_j exp(y'_j),  p_j = exp(y'_j - lse),  E = sum_j p_j y'_j,  H = lse - E
# Chain rule back to z:  dL/dz_j = dL/dy'_j * (1/T) * (1 - (y_j/c)^2) * s,  y_j / c = y'_j T / c.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitTransform:
    """``y' = softcap(z * scale) / temperature`` applied in place to a float32 block."""

    scale: float | None = None
    softcap: float | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.softcap is not None and self.softcap <= 0:
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

    def softcap_factor(self, y: torch.Tensor) -> torch.Tensor | None:
        """``1 - (y/c)^2`` (a new block) from the transformed ``y'``, or None without softcap."""
        if self.softcap is None:
            return None
        return torch.mul(y, self.temperature / float(self.softcap)).square_().neg_().add_(1.0)


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

    The matmul runs in the inputs' dtype (tensor cores, float32 accumulation inside the GEMM);
    its result is upcast once and transformed in place.
    """
    wt = w[v0:v1].t()
    z = torch.mm(h, wt) if b is None else torch.addmm(b[v0:v1], h, wt)
    return tf.apply_(z.to(acc_dtype))


@dataclass
class BlockStats:
    """Running softmax statistics over vocabulary blocks: ``lse = m + log(s)``, ``E = t / s``."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor | None
    target: torch.Tensor

    @staticmethod
    def of(y: torch.Tensor, labels: torch.Tensor, v0: int, want_mean: bool) -> "BlockStats":
        m = y.amax(dim=1)
        e = torch.sub(y, m[:, None]).exp_()  # the one temporary block of the statistics pass
        s = e.sum(dim=1)
        t = e.mul_(y).sum(dim=1) if want_mean else None
        del e
        inside = (labels >= v0) & (labels < v0 + y.shape[1])
        col = (labels - v0).clamp_(0, y.shape[1] - 1)
        target = torch.where(inside, y.gather(1, col[:, None]).squeeze(1), 0.0)
        return BlockStats(m, s, t, target)

    def merge(self, other: "BlockStats") -> "BlockStats":
        m = torch.maximum(self.m, other.m)
        a, b = torch.exp(self.m - m), torch.exp(other.m - m)
        t = None if self.t is None else self.t * a + other.t * b  # type: ignore[operator]
        return BlockStats(m, self.s * a + other.s * b, t, self.target + other.target)

    def lse(self) -> torch.Tensor:
        return self.m + torch.log(self.s)

    def mean(self) -> torch.Tensor:
        assert self.t is not None
        return self.t / self.s


def grad_logits_(
    y: torch.Tensor,
    v0: int,
    labels: torch.Tensor,
    lse: torch.Tensor,
    g_ce: torch.Tensor,
    g_ent: torch.Tensor | None,
    mean_y: torch.Tensor | None,
    tf: LogitTransform,
) -> torch.Tensor:
    """``dL/dz`` for one block, reusing ``y``'s storage where possible.

    ``L = sum_rows g_ce * (lse - y'_label) + g_ent * H`` (``g_ce`` per row; selective log-softmax
    passes ``-dL/dlogp``), so::

        dL/dy'_j = p_j * (g_ce - g_ent * (y'_j - E)) - g_ce * [j == label]
        dL/dz_j  = dL/dy'_j * (1 - (y'_j T / c)^2) * s / T

    Temporaries: one extra block with softcap or with an entropy gradient, two with both.
    """
    d = tf.softcap_factor(y)
    if g_ent is not None:
        assert mean_y is not None
        g = torch.sub(y, lse[:, None]).exp_()
        g.mul_(y.sub_(mean_y[:, None]).mul_(-g_ent[:, None]).add_(g_ce[:, None]))
        del y
    else:
        g = y.sub_(lse[:, None]).exp_().mul_(g_ce[:, None])
    inside = (labels >= v0) & (labels < v0 + g.shape[1])
    col = (labels - v0).clamp_(0, g.shape[1] - 1)
    g.scatter_add_(1, col[:, None], torch.where(inside, -g_ce, 0.0).to(g.dtype)[:, None])
    if d is not None:
        g.mul_(d)
    k = tf.chain_const()
    if k != 1.0:
        g.mul_(k)
    return g


def backprop_block(
    g: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    v0: int,
    v1: int,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    need_h: bool,
) -> torch.Tensor | None:
    """Accumulate ``g^T h`` into ``grad_w[v0:v1]`` and ``sum(g)`` into ``grad_b``; return ``g @ W``.

    ``g`` is cast once to the matmul dtype (bf16 GEMMs on GPU); accumulators are float32, so
    summing many token chunks does not round in bf16 at every step.
    """
    gc = g.to(h.dtype)
    if grad_b is not None:
        grad_b[v0:v1].add_(g.sum(dim=0).to(grad_b.dtype))
    if grad_w is not None:
        if grad_w.dtype == gc.dtype:
            grad_w[v0:v1].addmm_(gc.t(), h)
        else:
            grad_w[v0:v1].add_(torch.mm(gc.t(), h))
    return torch.mm(gc, w[v0:v1]) if need_h else None


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
