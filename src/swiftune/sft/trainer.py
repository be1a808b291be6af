"""``SFTTrainer``: supervised fine-tuning on transformers' ``Trainer``.

What swiftune changes, and nothing else (checkpointing, resume, schedules, logging
integrations and ``torchrun``/``accelerate`` launch are transformers', guarded by
:class:`swiftune.training.RunSafetyMixin`: NaN/inf stops, complete checkpoints, one run per
output_dir, Ctrl-C saves; model loading, adapters and patching are the start-up both trainers
share, :class:`swiftune.training.SwiftuneTrainer`):

* data: any of the shapes of :func:`swiftune.data.prepare_dataset`, tokenized once, with
  completion-only labels;
* batches: padding-free rows by default, best-fit-decreasing packing or padding on request,
  micro-batches by example count or by token budget;
* loss: the fused, chunked ``linear_cross_entropy`` on the decoder's last hidden states, so the
  ``[tokens, vocab]`` logits never exist, normalised by the number of trained tokens of the whole
  accumulated batch (transformers' ``num_items_in_batch``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from ..data import (
    BATCH_STAT_KEYS,
    IGNORE_INDEX,
    TokenBudgetBatchSampler,
    TokenizedDataset,
    make_collator,
    pack_dataset,
    pop_batch_stats,
    prepare_dataset,
)
from ..losses import linear_cross_entropy
from ..models.heads import hidden_states_and_head
from ..models.support import batch_layout_for
from ..training import MetricsCallback, StepFlops, SwiftuneTrainer, TokenMeter
from ..training.safety import COMMON_SETTINGS_KEYS
from .config import SFTConfig

logger = logging.getLogger(__name__)


class SFTTrainer(SwiftuneTrainer):
    """Supervised fine-tuning with fused kernels, padding-free batches and a chunked loss.

    Args:
        model: a transformers causal LM, a PEFT model, or a path/hub name (loaded with
            :meth:`swiftune.FastModel.from_pretrained`).
        args: an :class:`SFTConfig`.
        train_dataset / eval_dataset: rows of ``text``, ``prompt``/``completion`` or ``messages``
            (an HF ``Dataset``, a list of dicts or a JSONL/Parquet path), or an already
            tokenized :class:`swiftune.data.TokenizedDataset`.
        processing_class: the tokenizer (loaded with the model when ``model`` is a path).
        peft_config: a ``peft.LoraConfig`` to wrap a plain model with adapters.
    """

    trainer_kind = "sft"
    config_class = SFTConfig
    default_output_dir = "swiftune_output/sft"
    settings_keys = COMMON_SETTINGS_KEYS + (
        "max_length", "packing", "padding_free", "completion_only_loss", "assistant_only_loss",
        "max_tokens_per_batch", "dataset_text_field", "truncation",
    )

    def __init__(
        self,
        model: nn.Module | str,
        args: SFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        data_collator: Any = None,
        callbacks: list | None = None,
        **kwargs: Any,
    ):
        args = self.resolve_args(args)
        model, processing_class = self.prepare_model(
            model, args, processing_class, train_dataset, peft_config, max_seq_length=args.max_length,
            missing_tokenizer="SFTTrainer needs the tokenizer: pass processing_class=tokenizer",
            missing_dataset="SFTTrainer needs a train_dataset",
        )
        batch_mode = batch_layout_for(model, args.batch_mode)  # padded where swiftune's attention does not run

        train_dataset = self._tokenize(train_dataset, processing_class, args, "train")
        if eval_dataset is not None:
            eval_dataset = self._tokenize(eval_dataset, processing_class, args, "eval")
        if args.packing:
            train_dataset = TokenizedDataset(pack_dataset(train_dataset.examples, args.max_length),
                                             train_dataset.stats)
        if data_collator is None:
            data_collator = make_collator(batch_mode, max_length=args.max_length,
                                          pad_token_id=processing_class.pad_token_id)
        self.token_meter = TokenMeter()
        self.step_flops = StepFlops()
        super().__init__(
            model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, data_collator=data_collator, callbacks=callbacks, **kwargs,
        )
        # compute_loss normalises by num_items_in_batch itself: tell the Trainer not to divide
        # by the accumulation steps again, and to count the trained tokens of every micro-batch.
        self.model_accepts_loss_kwargs = True
        self.use_metrics_callback(MetricsCallback(self.token_meter, args))

    # ------------------------------------------------------------------------ data

    @staticmethod
    def _tokenize(data: Any, tokenizer: Any, args: SFTConfig, split: str) -> TokenizedDataset:
        if isinstance(data, TokenizedDataset):
            return data
        if args.batch_mode == "padded" and tokenizer.pad_token_id is None:
            raise ValueError("padded batches need a pad token: the tokenizer has none; set tokenizer.pad_token "
                             "(FastModel.from_pretrained does) or keep padding_free=True")
        tokenized = prepare_dataset(
            data, tokenizer, max_length=args.max_length, completion_only_loss=args.completion_only_loss,
            assistant_only_loss=args.assistant_only_loss, truncation=args.truncation,
            text_field=args.dataset_text_field,
        )
        stats = tokenized.stats
        logger.info("%s data: %d rows -> %d examples (%s), %d tokens, %d trained, %d truncated", split,
                    stats.num_rows, stats.num_examples, stats.data_shape, stats.num_tokens,
                    stats.num_trained_tokens, stats.num_truncated)
        return tokenized

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.args.max_tokens_per_batch is None:
            return super().get_train_dataloader()
        sampler = TokenBudgetBatchSampler(
            self.train_dataset.lengths, self.args.max_tokens_per_batch, shuffle=True, seed=self.args.seed
        )
        loader = torch.utils.data.DataLoader(
            self.train_dataset, batch_sampler=sampler, collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    # ------------------------------------------------------------------------ loss

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        return self.step_flops(self.model, inputs)  # the Trainer's estimate, parameters counted once

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if all(key in inputs for key in BATCH_STAT_KEYS):
            stats = pop_batch_stats(inputs)
            if model.training:
                self.token_meter.add(stats)
        labels = inputs.pop("labels")
        loss, hidden = sft_loss(
            model, inputs, labels, num_items_in_batch=num_items_in_batch,
            chunk_tokens=self.args.logit_chunk_tokens,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch is the global count; DDP averages gradients over processes.
            loss = loss * self.accelerator.num_processes
        return (loss, {"last_hidden_state": hidden}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, dict(inputs))
        return loss.detach(), None, None


def sft_loss(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-LM cross entropy of ``model`` on ``inputs`` without materialising the logits.

    The last hidden states come from :func:`swiftune.models.heads.hidden_states_and_head` (the
    model's own forward, ``logits_to_keep=1``), and the loss is the fused
    ``linear_cross_entropy`` of those states against the LM head. Labels are
    unshifted (transformers' convention); the shift happens here, on the labels only.

    Returns ``(loss, last_hidden_state)``. With ``num_items_in_batch`` the loss is the sum over
    trained tokens divided by it (gradient accumulation / multi-GPU); else the mean.
    """
    hidden, lm_head, softcap = hidden_states_and_head(model, **inputs)
    # position t predicts labels[t + 1]; the last position predicts nothing
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    loss = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, shift_labels.reshape(-1),
        reduction="mean", num_items=num_items_in_batch,
        logit_softcap=softcap, bias=lm_head.bias, chunk_tokens=chunk_tokens,
    )
    return loss, hidden
