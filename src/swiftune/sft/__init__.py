"""Supervised fine-tuning: :class:`SFTConfig` and :class:`SFTTrainer`."""

from .config import SFTConfig
from .trainer import SFTTrainer, sft_loss

__all__ = ["SFTConfig", "SFTTrainer", "sft_loss"]
