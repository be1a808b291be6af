"""Losses that never hold the ``[tokens, vocab]`` logits (see docs/losses.md).

* :func:`linear_cross_entropy` - fused LM head + cross entropy for SFT (grads computed in forward).
* :func:`selective_log_softmax` - fused LM head + log-probability of the sampled tokens for RL
  (recomputes in backward; optional entropy; optional CPU offload of the saved hidden states).
* :func:`choose_chunk_tokens` / :func:`free_gpu_bytes` / :func:`gpu_capacity_bytes` - automatic chunk sizes
  and the GPU memory this process may use.

Each has a plain-PyTorch reference that materialises the logits (``*_reference``).
"""

from .blocks import LogitTransform
from .chunking import MAX_VOCAB_CHUNK, choose_chunk_tokens, free_gpu_bytes, gpu_capacity_bytes
from .cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .selective_log_softmax import selective_log_softmax, selective_log_softmax_reference

__all__ = [
    "MAX_VOCAB_CHUNK",
    "LogitTransform",
    "choose_chunk_tokens",
    "free_gpu_bytes",
    "gpu_capacity_bytes",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "selective_log_softmax",
    "selective_log_softmax_reference",
]
