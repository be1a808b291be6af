"""Deprecated alias of swiftune.training.checkpointing; removed after the next release."""

from ..training.checkpointing import (  # noqa: F401
    ATTENTION_KERNEL_ATTR,
    MAX_DOC_TOKENS_ATTR,
    MLP_OUTPUT_FEEDS_ONLY_THE_RESIDUAL,
    PAGE_BYTES,
    CheckpointBudgetError,
    LayerInput,
    OffloadPlan,
    OffloadState,
    choose_page_bytes,
    decoder_layers,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    host_available_bytes,
    is_offloaded_checkpointing,
    offload_stats,
    release_host_memory,
    split_layers,
)
