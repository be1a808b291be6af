"""Document layout of a packed batch: where each document starts, computed once per forward.

A *packed* (padding-free) row is several documents concatenated, with ``position_ids`` that
restart at every document. A *padded* batch has an explicit 2-D ``attention_mask``. Both are
reduced here to one flat token axis of ``T`` real tokens plus ``cu_seqlens`` (the offsets of the
documents on that axis), the layout of every variable-length attention kernel.

Rule for document starts (the one transformers uses to detect packed rows): a token starts a
document when it is the first real token of its row, or when its position is not the previous
real token's position plus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .kernel_choice import layout_attention_kernel


def _doc_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S]``: True where a token starts a document (row start or position jump)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _cu_seqlens_from_starts(flat_starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Offsets of the documents of a flat token axis, from a bool mask of document starts."""
    total = flat_starts.numel()
    begins = flat_starts.nonzero().squeeze(1)  # one device->host sync (nonzero), once per forward
    cu_seqlens = torch.cat([begins, begins.new_tensor([total])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if total else 0
    return cu_seqlens, max_seqlen


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document offsets of packed rows from their ``position_ids``.

    Args:
        position_ids: ``[S]`` or ``[B, S]``; positions restart at every document. Rows are
            flattened in order, so row ``b`` starts at flat offset ``b * S``.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 ``[N + 1]`` offsets of the ``N`` documents on the
        flattened ``B * S`` axis (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == B * S``), and the
        longest document's length (a Python int: the one host sync of a forward).
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [S] or [B, S], got shape {tuple(position_ids.shape)}")
    return _cu_seqlens_from_starts(_doc_starts(position_ids).flatten())


@dataclass
class PackedBatch:
    """The document layout of one forward pass, shared by every attention layer.

    Attributes:
        cu_seqlens: int32 ``[N + 1]`` document offsets on the flat axis of real tokens.
        max_seqlen: longest document, in tokens.
        batch_size, seq_len: the padded ``[B, S]`` shape the model sees.
        indices: int64 ``[T]`` positions of the real tokens in the flattened ``B * S`` axis, or
            ``None`` when every token is real (no padding: the flat axis is ``B * S`` itself).
        backend: attention backend name requested for this model (``"auto"`` picks per call).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch_size: int
    seq_len: int
    indices: torch.Tensor | None = None
    backend: str = "auto"
    # Per-forward caches filled lazily by the backends (flex block masks per sliding window),
    # so a mask built by the first layer is reused by the others and by checkpoint recomputation.
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.seq_len if self.indices is None else int(self.indices.numel())

    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def attention_kernel(self) -> str | None:
        """The kernel this layout's attention runs, as far as the layout decides it: ``"sdpa"``
        for long documents on CUDA under ``auto`` (:func:`~swiftune.attention.kernel_choice.prefers_sdpa`)
        or when asked for, ``"flex"`` when asked for, else ``None``. Read by offloaded
        checkpointing (``checkpointing.ATTENTION_KERNEL_ATTR``, from the layers' keyword
        arguments) to size its reserve for the layer being recomputed; layers with a sliding
        window or soft-cap run another kernel, which the checkpointing checks on the model."""
        return layout_attention_kernel(self.backend, self.cu_seqlens.is_cuda, self.num_tokens, self.num_docs)

    def doc_ids(self) -> torch.Tensor:
        """int32 ``[T]``: the document index of every real token (built once, then cached)."""
        if "doc_ids" not in self.cache:
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
            ids = torch.arange(self.num_docs, device=self.cu_seqlens.device, dtype=torch.int32)
            self.cache["doc_ids"] = torch.repeat_interleave(ids, lengths, output_size=self.num_tokens)
        return self.cache["doc_ids"]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[T, ...]``: the real tokens in flat order (a view when unpadded)."""
        flat = x.reshape(self.batch_size * self.seq_len, *x.shape[2:])
        return flat if self.indices is None else flat.index_select(0, self.indices)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[B, S, ...]``; padding positions get zeros."""
        if self.indices is not None:
            out = x.new_zeros(self.batch_size * self.seq_len, *x.shape[1:])
            x = out.index_copy(0, self.indices, x)
        return x.view(self.batch_size, self.seq_len, *x.shape[1:])


def packed_batch_from_document_ids(
    document_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, backend: str = "auto",
) -> PackedBatch:
    """The layout of a batch whose documents are given explicitly: ``document_ids [B, S]`` holds
    each token's document (any integer label, equal within a document; a new document starts at
    every change of label and at every row start), ``attention_mask [B, S]`` optionally hides
    padding. For multimodal rows, whose 3-D (M-RoPE) positions do not restart at documents and
    are not monotone inside one (image tokens), so no position rule can find the boundaries."""
    if document_ids.dim() == 1:
        document_ids = document_ids.unsqueeze(0)
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [S] or [B, S], got shape {tuple(document_ids.shape)}")
    batch_size, seq_len = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if attention_mask is None or bool((attention_mask != 0).all()):
        cu, max_len = _cu_seqlens_from_starts(starts.flatten())
        return PackedBatch(cu, max_len, batch_size, seq_len, None, backend)
    if attention_mask.shape != document_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and document_ids "
                         f"{tuple(document_ids.shape)} must have the same [B, S] shape")
    indices = (attention_mask != 0).flatten().nonzero().squeeze(1)
    rows = torch.div(indices, seq_len, rounding_mode="floor")
    ids = document_ids.reshape(-1).index_select(0, indices)
    real_starts = torch.ones_like(indices, dtype=torch.bool)
    real_starts[1:] = (rows[1:] != rows[:-1]) | (ids[1:] != ids[:-1])
    cu, max_len = _cu_seqlens_from_starts(real_starts)
    return PackedBatch(cu, max_len, batch_size, seq_len, indices, backend)


def build_packed_batch(
    batch_size: int,
    seq_len: int,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    backend: str = "auto",
) -> PackedBatch:
    """Reduce a forward's ``position_ids`` and optional 2-D padding mask to a :class:`PackedBatch`.

    Args:
        batch_size, seq_len: the ``[B, S]`` shape of the input ids.
        position_ids: ``[B, S]`` or ``[1, S]`` (broadcast over rows); ``None`` means ``0..S-1``
            in every row.
        attention_mask: optional ``[B, S]`` mask, nonzero for real tokens. Its real tokens are
            unpadded; within a row, documents still split where the positions jump.
        device: where to build the tensors when neither input is a tensor.
        backend: attention backend name carried to every layer.
    """
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids is not None and position_ids.shape[0] != batch_size:
        position_ids = position_ids.expand(batch_size, -1)
    ref = position_ids if position_ids is not None else attention_mask
    device = ref.device if ref is not None else torch.device(device or "cpu")

    keep = None
    if attention_mask is not None:
        if attention_mask.shape != (batch_size, seq_len):
            raise ValueError(
                f"attention_mask must be 2-D [B, S] = [{batch_size}, {seq_len}], got {tuple(attention_mask.shape)}"
            )
        keep = attention_mask.to(device=device) != 0
        if bool(keep.all()):  # one sync: the common no-padding case then costs no gather at all
            keep = None

    if keep is None:
        if position_ids is None:  # one full document per row: no sync at all
            cu = torch.arange(0, (batch_size + 1) * seq_len, seq_len, device=device, dtype=torch.int32)
            return PackedBatch(cu, seq_len, batch_size, seq_len, None, backend)
        cu, max_len = cu_seqlens_from_position_ids(position_ids)
        return PackedBatch(cu, max_len, batch_size, seq_len, None, backend)

    indices = keep.flatten().nonzero().squeeze(1)
    rows = torch.div(indices, seq_len, rounding_mode="floor")
    starts = torch.ones_like(indices, dtype=torch.bool)
    starts[1:] = rows[1:] != rows[:-1]
    if position_ids is not None:
        pos = position_ids.reshape(-1).index_select(0, indices)
        starts[1:] |= pos[1:] != pos[:-1] + 1
    cu, max_len = _cu_seqlens_from_starts(starts)
    return PackedBatch(cu, max_len, batch_size, seq_len, indices, backend)
