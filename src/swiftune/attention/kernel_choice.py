"""Which attention kernel ``auto`` takes for a packed layout, as far as the layout alone decides it.

A leaf of the attention package (it imports nothing from swiftune): the backends consult it
when they resolve ``auto``, and the layouts (:class:`~swiftune.attention.packing.PackedBatch`,
:class:`~swiftune.attention.shared_prompt.RowLayout`) consult it to name the kernel their forward
runs, which offloaded checkpointing reads to size its reserve.
"""

from __future__ import annotations

# ``auto`` runs documents through ``sdpa`` one call each when they average at least this many
# tokens: a call's fixed launch overhead is then small next to a document's attention.
SDPA_MIN_MEAN_DOC_TOKENS = 4096


def prefers_sdpa(num_tokens: int, num_docs: int) -> bool:
    """Whether ``auto`` runs this layout as one dense causal sdpa call per document: on average
    long documents (GRPO's long completions, long-context SFT), where the fastest dense kernel
    (cuDNN's on Hopper) beats the varlen kernels and the per-call overhead does not matter."""
    return num_docs > 0 and num_tokens >= SDPA_MIN_MEAN_DOC_TOKENS * num_docs


def layout_attention_kernel(backend: str, on_cuda: bool, num_tokens: int, num_docs: int) -> str | None:
    """The kernel a packed layout's attention runs, as far as the layout decides it (for the
    memory reserve of offloaded checkpointing): ``"sdpa"`` or ``"flex"`` when asked for; under
    ``auto`` on CUDA ``"sdpa"`` for long documents (the first choice of
    :func:`~swiftune.attention.backends.resolve_backend` there, taken unless a layer's sliding
    window or soft-cap rules it out); ``None`` otherwise (not known, or a varlen-style kernel)."""
    if backend in ("sdpa", "flex"):
        return backend
    if backend == "auto" and on_cuda and prefers_sdpa(num_tokens, num_docs):
        return "sdpa"
    return None
