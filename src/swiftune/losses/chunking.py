"""Chunk sizes of swiftune's losses.

Both losses (:func:`~swiftune.losses.linear_cross_entropy` and
:func:`~swiftune.losses.selective_log_softmax`) walk the flattened token axis in chunks of
``chunk_tokens`` rows, and the vocabulary in blocks of at most ``vocab_chunk`` columns, so the
only ``[tokens, vocab]``-shaped memory alive at any time is one ``[chunk_tokens, vocab_chunk]``
block.  This module chooses those sizes; :mod:`swiftune.losses.blocks` holds the per-block math.

Chunk size
----------
:func:`choose_chunk_tokens` gives one block ``memory_fraction`` (1/4) of the free GPU memory
times ``multiplier``, at ``vocab_chunk * logit_bytes + hidden_size * (dtype_bytes + 4)`` bytes per
token (the block, plus the chunk's hidden rows and their gradient), clamps to
``[min_chunk, max_chunk]``, rounds down to a multiple of 64 (tensor-core friendly), and balances
the chunks so the last one is not a sliver (``ceil(num_tokens / ceil(num_tokens / chunk))``,
rounded up to 64, never above the unbalanced size).  The result is monotone in ``free_bytes``,
at least 1 and at most ``num_tokens``.
"""
from __future__ import annotations

import math

import torch


#: Vocabularies up to this many columns are projected in one block per token chunk; larger ones
#: are split into balanced blocks of at most this width.  2^18 keeps every current LLM vocabulary
#: (Qwen 151,936; Gemma-3 262,144; Llama-3 128,256) in one block: splitting costs an extra logits
#: matmul in :func:`linear_cross_entropy` (two passes: log-sum-exp, then gradients).
MAX_VOCAB_CHUNK = 2**18

#: Budget used when the tensors live on the CPU (there is no free-memory query worth trusting).
CPU_BUDGET_BYTES = 4 * 2**30

#: Most tokens in one chunk by default: the logits matmul of this many rows still fills a GPU, and
#: a larger chunk only makes the ``[chunk_tokens, vocab]`` block bigger, which raises the step's
#: peak without making it faster (docs/benchmarks.md has the measurement).
MAX_CHUNK_TOKENS = 1024

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
    max_chunk: int = MAX_CHUNK_TOKENS,
    memory_fraction: float = MEMORY_FRACTION,
    logit_bytes: float | None = None,
) -> int:
    """Token-chunk size for the chunked losses (a pure function of its arguments).

    ``vocab_size`` is the width of one vocabulary block (``min(V, vocab_chunk)``).  The block of
    float32 logits, its float32 gradient and their ``dtype_bytes`` copy get
    ``free_bytes * memory_fraction * multiplier`` bytes; the chunk is clamped to
    ``[min_chunk, max_chunk * multiplier]`` and to ``[1, num_tokens]``.  ``multiplier`` is the
    ``logit_chunk_multiplier`` knob: 2.0 means chunks twice as large (faster, more memory).
    ``logit_bytes`` is the memory of one logit of the block: ``8 + dtype_bytes`` (default, the
    plain-PyTorch block math) or ``dtype_bytes`` (the fused Triton path, which works in place).
    """
    if num_tokens <= 0:
        return 1
    if multiplier <= 0:
        raise ValueError(f"multiplier must be positive, got {multiplier}")
    per_logit = 8 + dtype_bytes if logit_bytes is None else logit_bytes
    per_token = vocab_size * per_logit + hidden_size * (dtype_bytes + 4)
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


def gpu_capacity_bytes(device: torch.device | str) -> int:
    """GPU memory this process may reserve on ``device``: the device's total memory times the
    per-process fraction (``torch.cuda.set_per_process_memory_fraction``: a shared GPU, or a smaller
    GPU emulated), which the caching allocator enforces but ``mem_get_info`` does not report."""
    dev = torch.device(device)
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(dev) if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else 1.0
    return int(total * min(1.0, fraction))


def free_gpu_bytes(device: torch.device | str | None = None) -> int:
    """Bytes a new allocation can use on ``device``.

    CUDA: the driver's free memory plus what PyTorch's caching allocator has reserved but not
    handed out (that memory is reusable by us but invisible to ``mem_get_info``), capped by the
    process's own limit (:func:`gpu_capacity_bytes` minus what the allocator has reserved).  CPU
    (or no CUDA): the fixed :data:`CPU_BUDGET_BYTES`.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return CPU_BUDGET_BYTES
    free, _total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    cached = reserved - torch.cuda.memory_allocated(dev)
    free = min(free, gpu_capacity_bytes(dev) - reserved)
    return int(max(free, 0) + max(cached, 0))


def resolve_chunk_tokens(
    chunk_tokens: int | None,
    num_tokens: int,
    hidden_size: int,
    vocab_block: int,
    device: torch.device,
    dtype_bytes: int,
    multiplier: float = 1.0,
    fused: bool = False,
) -> int:
    """An explicit ``chunk_tokens`` (clamped to ``[1, num_tokens]``) or the automatic choice."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return max(1, min(int(chunk_tokens), max(num_tokens, 1)))
    return choose_chunk_tokens(
        num_tokens, hidden_size, vocab_block, free_gpu_bytes(device), dtype_bytes, multiplier,
        logit_bytes=dtype_bytes if fused else None,
    )


def vocab_blocks(vocab_size: int, vocab_chunk: int | None) -> list[tuple[int, int]]:
    """Balanced ``[v0, v1)`` column ranges, each at most ``vocab_chunk`` (default 2^18) wide."""
    limit = MAX_VOCAB_CHUNK if vocab_chunk is None else int(vocab_chunk)
    if limit < 1:
        raise ValueError(f"vocab_chunk must be >= 1, got {vocab_chunk}")
    n = max(1, math.ceil(vocab_size / limit))
    width = math.ceil(vocab_size / n)
    return [(v0, min(v0 + width, vocab_size)) for v0 in range(0, vocab_size, width)]
