"""Data layer: built-in tiny assets, dataset formatting, packing and batch collators.

Layer rule: ``data`` sits below the training runtime and the trainers and imports none of them
(today it needs no other part of swiftune at all). ``datasets`` is never imported (a ``datasets.Dataset`` is used through its own
methods; Parquet files are read with ``pyarrow``), so the library works where it is missing.
"""

from swiftune.data.builtin import (
    BUILTIN_MAX_LENGTH,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    TINY_MODEL_FAMILIES,
    build_tokenizer,
    builtin_instruction_dataset,
    tiny_model_config,
)
from swiftune.data.collators import (
    BATCH_STAT_KEYS,
    IGNORE_INDEX,
    BatchStats,
    PackedCollator,
    PaddedCollator,
    PaddingFreeCollator,
    make_collator,
    padding_fraction,
    pop_batch_stats,
)
from swiftune.data.formatting import (
    DataFormatError,
    FormattingStats,
    TokenizedDataset,
    detect_shape,
    load_rows,
    prepare_dataset,
)
from swiftune.data.row_files import each_named, is_named_datasets
from swiftune.data.multimodal import (
    MultimodalCollator,
    VisionProcessor,
    is_multimodal_rows,
    make_multimodal_collator,
    prepare_multimodal_dataset,
    text_tokenizer_of,
    tokenize_multimodal_row,
)
from swiftune.data.packing import (
    TokenBudgetBatchSampler,
    batch_by_token_budget,
    cu_seqlens_from_position_ids,
    pack_best_fit,
    pack_dataset,
    packing_efficiency,
    position_ids_from_seq_lengths,
)

__all__ = [
    "BATCH_STAT_KEYS",
    "BUILTIN_MAX_LENGTH",
    "EOS_TOKEN_ID",
    "IGNORE_INDEX",
    "IM_END_TOKEN_ID",
    "IM_START_TOKEN_ID",
    "PAD_TOKEN_ID",
    "TINY_MODEL_FAMILIES",
    "BatchStats",
    "DataFormatError",
    "FormattingStats",
    "MultimodalCollator",
    "PackedCollator",
    "PaddedCollator",
    "PaddingFreeCollator",
    "TokenBudgetBatchSampler",
    "TokenizedDataset",
    "VisionProcessor",
    "batch_by_token_budget",
    "build_tokenizer",
    "builtin_instruction_dataset",
    "cu_seqlens_from_position_ids",
    "detect_shape",
    "each_named",
    "is_multimodal_rows",
    "is_named_datasets",
    "load_rows",
    "make_collator",
    "make_multimodal_collator",
    "pack_best_fit",
    "pack_dataset",
    "packing_efficiency",
    "padding_fraction",
    "pop_batch_stats",
    "position_ids_from_seq_lengths",
    "prepare_dataset",
    "prepare_multimodal_dataset",
    "text_tokenizer_of",
    "tiny_model_config",
    "tokenize_multimodal_row",
]
