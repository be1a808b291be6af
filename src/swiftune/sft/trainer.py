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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from ..data import (
    BATCH_STAT_KEYS,
    IGNORE_INDEX,
    PackedCollator,
    PaddedCollator,
    PaddingFreeCollator,
    TokenBudgetBatchSampler,
    TokenizedDataset,
    each_named,
    make_collator,
    pack_dataset,
    pop_batch_stats,
    prepare_dataset,
    text_tokenizer_of,
)
from ..data.multimodal import (
    MULTIMODAL_SHAPE,
    make_multimodal_collator,
    multimodal_processor,
    prepare_multimodal_dataset,
)
from ..errors import ConfigError
from ..losses import linear_cross_entropy
from ..losses.cross_entropy import TokenStats
from ..models.heads import hidden_states_and_head
from ..models.support import batch_layout_for
from ..models.qwen3_vl import rope_index_of
from ..training import (
    MetricsCallback,
    StepFlops,
    SwiftuneTrainer,
    TokenMeter,
    enable_gradient_checkpointing,
    enable_graphed_layers,
)
from ..training.neftune import LayoutFreeNEFTune
from ..training.router_aux import RouterAuxLoss, real_token_mask
from ..training.safety import COMMON_SETTINGS_KEYS
from .config import SFTConfig
from .eval_outputs import full_logits
from .trl_fields import apply_tokenizer_fields, model_load_kwargs, warn_once

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
        compute_metrics / preprocess_logits_for_metrics: transformers' ``Trainer`` arguments, on
            evaluation; the logits they get are built per evaluation batch only (training never holds
            them): :mod:`swiftune.sft.eval_outputs`.
        formatting_func: TRL's: a function of one row returning the text to train on (or the older
            batched form); the rows become plain text.

    Pre-tokenized rows (``input_ids``, optional ``labels`` / ``assistant_masks`` / ``completion_mask``)
    follow TRL 1.16's rules (:mod:`swiftune.data.row_formats`); TRL's other ``SFTConfig`` fields are in
    :mod:`swiftune.sft.trl_fields` and docs/trl_compat.md. Logs carry TRL's ``num_tokens``,
    ``entropy`` and ``mean_token_accuracy`` (and their ``eval_`` forms), the last two from the fused
    loss's chunk loop (:class:`swiftune.losses.cross_entropy.TokenStats`), never from full logits.
    """

    trainer_kind = "sft"
    config_class = SFTConfig
    default_output_dir = "swiftune_output/sft"
    settings_keys = COMMON_SETTINGS_KEYS + (
        "max_length", "packing", "padding_free", "completion_only_loss", "assistant_only_loss",
        "max_tokens_per_batch", "dataset_text_field", "truncation", "truncation_mode", "loss_type",
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
        compute_metrics: Callable | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        formatting_func: Callable | None = None,
        **kwargs: Any,
    ):
        args = self.resolve_args(args)
        processing_class = self.processing_class_of(processing_class, kwargs)
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigError(
                "SFTTrainer: compute_loss_func needs the full logits, which swiftune's fused loss never builds (TRL "
                "1.16 deprecates it too); subclass SFTTrainer and override compute_loss, or use loss_type='nll' / "
                "'dft'"
            )
        kwargs.pop("compute_loss_func", None)
        quantization_config = kwargs.pop("quantization_config", None)  # TRL's: for a model given as a path
        if formatting_func is not None and args.completion_only_loss:
            raise ConfigError(
                "SFTTrainer: formatting_func turns every row into plain text (TRL's language-modelling data), which "
                "has no completion to train on alone, but completion_only_loss=True; apply the formatting to the "
                "dataset yourself (keeping prompt/completion columns), or leave completion_only_loss unset"
            )
        if isinstance(model, str):
            load_kwargs = model_load_kwargs(args)
            if quantization_config is not None:
                if "quantization_config" in load_kwargs:
                    raise ConfigError("SFTTrainer: quantization_config is given both as an argument and in "
                                      "SFTConfig.model_init_kwargs; give it once")
                load_kwargs["quantization_config"] = quantization_config
        else:
            if quantization_config is not None:
                warn_once("quantization_config", "ignored: the model is already loaded (as in TRL); load it with "
                          "FastModel.from_pretrained(..., load_in_4bit=True) instead", owner="SFTTrainer")
            load_kwargs = {}
            for name in ("model_init_kwargs", "trust_remote_code"):
                if getattr(args, name):
                    warn_once(name, "ignored: the model is already loaded (it applies when the model is given as a "
                              "path, as in TRL)")
        model, processing_class = self.prepare_model(
            model, args, processing_class, train_dataset, peft_config, max_seq_length=args.max_length,
            missing_tokenizer="SFTTrainer needs the tokenizer: pass processing_class=tokenizer",
            missing_dataset="SFTTrainer needs a train_dataset", **load_kwargs,
        )
        apply_tokenizer_fields(args, processing_class, model)
        if args.cuda_graph_layers:  # with TRL's activation_offloading: the graphs' layer inputs on the host
            enable_graphed_layers(model, offload_inputs=args.activation_offloading)
        elif args.activation_offloading:  # TRL's offloaded activations: swiftune's offloaded checkpointing
            enable_gradient_checkpointing(model, "offload")
        batch_mode = batch_layout_for(model, args.batch_mode)  # padded where swiftune's attention does not run
        self.batch_layout = batch_mode  # what the training batches are (args.batch_mode is what was asked)
        vision = multimodal_processor(processing_class, train_dataset)  # image-text rows: docs/vision.md
        if vision is None:  # text rows on a vision-language model: its processor's tokenizer tokenizes them
            processing_class = text_tokenizer_of(processing_class)
        else:
            processing_class = vision.tokenizer

            def prepare_images(d: Any) -> Any:
                if d is None or isinstance(d, TokenizedDataset):
                    return d
                return prepare_multimodal_dataset(d, vision, max_length=args.max_length, completion_only_loss=not (
                    args.completion_only_loss is False and not args.assistant_only_loss))

            train_dataset, eval_dataset = prepare_images(train_dataset), each_named(eval_dataset, prepare_images)
            if data_collator is None:
                data_collator = make_multimodal_collator(batch_mode, rope_index_of(model), vision,
                                                         max_length=args.max_length)

        self._formatting_func = formatting_func
        self._eval_packing = args.packing if args.eval_packing is None else args.eval_packing
        train_dataset = self._tokenize(train_dataset, processing_class, args, "train", formatting_func, args.packing)
        eval_packing = self._eval_packing
        if eval_dataset is not None:  # one dataset, or transformers' named ones ({"name": rows}: eval_name_loss)
            eval_dataset = each_named(eval_dataset, lambda d: self._prepare_eval(d, processing_class, args))
        if args.packing:
            train_dataset = self._pack(train_dataset, args)
        collate = dict(max_length=args.max_length, pad_token_id=processing_class.pad_token_id,
                       pad_to_multiple_of=args.pad_to_multiple_of)
        self._eval_collator = None
        if data_collator is not None and vision is None and not isinstance(data_collator, SWIFTUNE_COLLATORS):
            data_collator = TrlExampleCollator(data_collator)  # a TRL script's collator reads TRL's columns
        if data_collator is None:
            data_collator = make_collator(batch_mode, **collate)
            if eval_packing and batch_mode != "packed":  # packed eval rows: one row each, padded to the longest
                # (a model swiftune's attention does not run gets padded batches, which refuse packed rows)
                self._eval_collator = make_collator(batch_layout_for(model, "packed"), **collate)
            elif not eval_packing and args.packing:  # unpacked eval examples beside packed training rows
                self._eval_collator = make_collator(batch_layout_for(model, "padding_free"), **collate)
        self.router_aux = RouterAuxLoss(model, args.router_aux_loss_coef)
        self._aux_losses: list[torch.Tensor] = []  # TRL's aux_loss metric: the unweighted term per micro-batch
        self.token_meter = TokenMeter()
        self.step_flops = StepFlops()
        # TRL's entropy / mean_token_accuracy: per micro-batch [entropy sum, arg-max hits, labelled tokens],
        # kept on the device until the next log (no host sync per micro-batch)
        self._token_sums: dict[str, list[torch.Tensor]] = {"train": [], "eval": []}
        super().__init__(
            model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, data_collator=data_collator, callbacks=callbacks,
            compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics, **kwargs,
        )
        # NEFTune sized by the longest document, not by the whole padding-free row (training.neftune);
        # the Trainer's own hook is kept off
        self._neftune_alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        self._neftune: LayoutFreeNEFTune | None = None
        # compute_loss normalises by num_items_in_batch itself: tell the Trainer not to divide
        # by the accumulation steps again, and to count the trained tokens of every micro-batch.
        self.model_accepts_loss_kwargs = True
        self.use_swiftune_callbacks(MetricsCallback(self.token_meter, args))

    # ------------------------------------------------------------------------ data

    @staticmethod
    def _pack(data: TokenizedDataset, args: SFTConfig) -> TokenizedDataset:
        if data.stats.data_shape == MULTIMODAL_SHAPE:  # image-text rows are packed by their collator
            return data
        examples = data.examples
        if args.packing_strategy == "bfd_split":
            examples = split_long_examples(examples, args.max_length)
        rows = pack_dataset(examples, args.max_length)
        if args.shuffle_dataset:  # TRL shuffles the packed rows again
            shuffle_as_datasets(rows, args.seed)
        return TokenizedDataset(rows, data.stats)

    @staticmethod
    def _tokenize(data: Any, tokenizer: Any, args: SFTConfig, split: str,
                  formatting_func: Callable | None = None, packed: bool = False) -> TokenizedDataset:
        if isinstance(data, TokenizedDataset):
            return data
        # bfd_split keeps long examples whole here; _pack cuts them into max_length documents
        max_length = None if packed and args.packing_strategy == "bfd_split" else args.max_length
        if args.batch_mode == "padded" and tokenizer.pad_token_id is None:
            raise ValueError("padded batches need a pad token: the tokenizer has none; set tokenizer.pad_token "
                             "(FastModel.from_pretrained does) or keep padding_free=True")
        tokenized = prepare_dataset(
            data, tokenizer, max_length=max_length, completion_only_loss=args.completion_only_loss,
            assistant_only_loss=args.assistant_only_loss, truncation=args.truncation,
            text_field=args.dataset_text_field, truncation_mode=args.truncation_mode,
            chat_template_kwargs=args.chat_template_kwargs, formatting_func=formatting_func,
            skip_prepare=bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False)),
        )
        if args.shuffle_dataset:  # TRL shuffles the prepared rows (before packing) with the run's seed
            shuffle_as_datasets(tokenized.examples, args.seed)
        stats = tokenized.stats
        if args.process_index == 0:  # once under torchrun (every process prepares the same rows)
            logger.info("%s data: %d rows -> %d examples (%s), %d tokens, %d trained, %d truncated", split,
                        stats.num_rows, stats.num_examples, stats.data_shape, stats.num_tokens,
                        stats.num_trained_tokens, stats.num_truncated)
        return tokenized

    def _prepare_eval(self, data: Any, processing_class: Any, args: SFTConfig) -> Any:
        """Evaluation rows tokenized (and packed) as the construction's ``eval_dataset`` is."""
        if isinstance(data, TokenizedDataset):
            return data
        prepared = self._tokenize(data, processing_class, args, "eval", self._formatting_func, self._eval_packing)
        return self._pack(prepared, args) if self._eval_packing else prepared

    def _with_eval_collator(self, make_loader: Callable[[], torch.utils.data.DataLoader]) -> torch.utils.data.DataLoader:
        if self._eval_collator is None:
            return make_loader()
        train_collator, self.data_collator = self.data_collator, self._eval_collator
        try:  # the loader keeps the collator it was built with
            return make_loader()
        finally:
            self.data_collator = train_collator

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        # a name (a key of the named eval datasets) or None is the Trainer's to resolve; a dataset handed to
        # evaluate() is prepared as at construction (TRL does the same)
        prepared = eval_dataset if isinstance(eval_dataset, str) or eval_dataset is None else \
            self._prepare_eval(eval_dataset, self.processing_class, self.args)
        return self._with_eval_collator(lambda: super(SFTTrainer, self).get_eval_dataloader(prepared))

    def get_test_dataloader(self, test_dataset: Any) -> torch.utils.data.DataLoader:
        # predict(rows): the rows prepared as evaluation rows (it read a raw row's missing input_ids)
        prepared = self._prepare_eval(test_dataset, self.processing_class, self.args)
        return self._with_eval_collator(lambda: super(SFTTrainer, self).get_test_dataloader(prepared))

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

    def train(self, *args: Any, **kwargs: Any):
        if self._neftune_alpha is None:
            return super().train(*args, **kwargs)
        self._neftune = LayoutFreeNEFTune(self.model, self._neftune_alpha)
        try:  # as transformers: the noise only while training, the hook removed afterwards
            return super().train(*args, **kwargs)
        finally:
            self._neftune.remove()
            self._neftune = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._neftune is not None:
            self._neftune.set_batch(inputs)
        token_mask = real_token_mask(inputs) if self.router_aux.enabled else None
        inputs.pop("row_tokens", None)
        if all(key in inputs for key in BATCH_STAT_KEYS):
            stats = pop_batch_stats(inputs)
            if model.training:
                self.token_meter.add(stats)
        labels = inputs.pop("labels")
        with self.router_aux.recording(model) as router_logits:
            hidden, lm_head, softcap = hidden_states_and_head(model, **inputs)
        targets = shift_labels(labels)
        logged = self.args.logging_strategy != "no" or not model.training  # TRL's entropy / token accuracy
        out = head_loss(hidden, lm_head, softcap, targets, num_items_in_batch, self.args.logit_chunk_tokens,
                        self.args.loss_type, token_stats=logged, backend=self.args.kernel_backend)
        loss, stats = out if logged else (out, None)
        if stats is not None:
            counted = (targets != IGNORE_INDEX).sum()
            self._token_sums["train" if model.training else "eval"].append(torch.stack(
                [stats.entropy.sum().double(), stats.is_top1.sum().double(), counted.double()]))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch is the global count; DDP averages gradients over processes.
            loss = loss * self.accelerator.num_processes
        # TRL's MoE term: a per-micro-batch mean, so averaged over the accumulation steps when the
        # loss above is normalised by the whole accumulated batch
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        aux = self.router_aux.term(router_logits, token_mask, steps)
        if aux is not None:
            loss = loss + aux.to(loss.dtype)
            if model.training:  # kept on the device: read at the next log, not synchronised every micro-batch
                self._aux_losses.append(aux.detach() * steps / self.router_aux.coef)
        if not return_outputs:
            return loss
        outputs = {"last_hidden_state": hidden, "labels": labels}
        if self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None:
            outputs["logits"] = full_logits(hidden, lm_head, softcap)  # evaluation only: see eval_outputs
        return loss, outputs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        wants_logits = not prediction_loss_only and (
            self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None)
        with torch.no_grad():
            if not wants_logits:
                return self.compute_loss(model, dict(inputs)).detach(), None, None
            loss, outputs = self.compute_loss(model, dict(inputs), return_outputs=True)
        return loss.detach(), outputs["logits"], outputs["labels"]

    # ------------------------------------------------------------------------ logs

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        self._token_sums["eval"] = []  # this evaluation's batches only (predict() logs nothing, so reset here)
        return super().evaluation_loop(*args, **kwargs)

    def _summed(self, values: list[int]) -> list[int]:
        if self.accelerator.num_processes == 1:
            return values
        total = self.accelerator.reduce(torch.tensor(values, device=self.accelerator.device), reduction="sum")
        return [int(v) for v in total.tolist()]

    def _token_metrics(self, mode: str) -> dict[str, float]:
        """TRL 1.16's ``entropy`` and ``mean_token_accuracy`` since the last log: per micro-batch, the
        sums over every process's labelled tokens divided by their count (0 for a batch without any),
        then the mean over the micro-batches."""
        rows, self._token_sums[mode] = self._token_sums[mode], []
        if not rows:
            return {}
        sums = torch.stack(rows)
        if self.accelerator.num_processes > 1:  # every process runs the same number of micro-batches
            sums = self.accelerator.reduce(sums, reduction="sum")
        entropy, hits, count = sums.unbind(1)
        share = lambda x: float(torch.where(count > 0, x / count.clamp_min(1), 0.0).mean())  # noqa: E731
        return {"entropy": share(entropy), "mean_token_accuracy": share(hits)}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # TRL's names: num_tokens (tokens trained on so far, padding excluded), entropy and
        # mean_token_accuracy (_token_metrics), with eval_ in front in evaluation.
        if "loss" in logs:
            logs["num_tokens"] = float(self._summed([self.token_meter.total_tokens])[0])
            logs.update(self._token_metrics("train"))
            if self._aux_losses:  # TRL's aux_loss: the unweighted load-balancing term, mean over micro-batches
                logs["aux_loss"] = float(torch.stack(self._aux_losses).mean())
                self._aux_losses = []
        elif any(key.startswith("eval_") for key in logs) and self._token_sums["eval"]:
            logs.update({f"eval_{k}": v for k, v in self._token_metrics("eval").items()})
            logs["eval_num_tokens"] = float(self._summed([self.token_meter.total_tokens])[0])
        super().log(logs, *args, **kwargs)


def split_long_examples(examples: list[dict], max_length: int) -> list[dict]:
    """TRL's ``packing_strategy="bfd_split"``: an example longer than ``max_length`` becomes pieces
    of ``max_length`` tokens (the last one shorter), each packed as its own document (positions
    restart, its first token is not a target). Pieces with no trained token are dropped."""
    out = []
    for example in examples:
        ids, mask = example["input_ids"], example.get("completion_mask") or [1] * len(example["input_ids"])
        for start in range(0, len(ids), max_length):
            piece_mask = mask[start:start + max_length]
            if sum(piece_mask[1:]):
                out.append({"input_ids": ids[start:start + max_length], "completion_mask": piece_mask})
    return out


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the hidden states: position t predicts labels[t + 1]; the last predicts nothing."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def head_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    softcap: float | None,
    targets: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    loss_type: str = "nll",
    token_stats: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, TokenStats]:
    """The SFT loss of ``hidden`` against the (shifted) ``targets`` through the fused LM head.

    ``loss_type="nll"``: the cross entropy, summed over trained tokens and divided by
    ``num_items_in_batch`` (else their count). ``"dft"`` (TRL's Dynamic Fine-Tuning,
    arXiv:2508.05629): each token's loss ``l_t = -log p_t`` weighted by its probability taken as
    a constant, ``sum_t l_t * stop_grad(p_t) / D``, so ``d/dz = p_t * dl_t/dz``; computed from the
    fused per-token losses (``reduction="none"``, recomputed chunk by chunk in backward), never
    from the full logits.

    ``token_stats=True`` returns ``(loss, TokenStats)``: each flattened target's entropy and arg-max
    hit, without gradient, from the loss's own chunk loop (``"dft"``: one more no-grad pass).
    ``backend``: the loss's (``"auto"``, ``"triton"``, ``"reference"``: the config's ``kernel_backend``).
    """
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if loss_type == "nll":
        return linear_cross_entropy(flat_h, lm_head.weight, flat_y, reduction="mean", num_items=num_items_in_batch,
                                    logit_softcap=softcap, bias=lm_head.bias, chunk_tokens=chunk_tokens,
                                    return_token_stats=token_stats, backend=backend)
    if loss_type != "dft":
        raise ValueError(f"loss_type must be 'nll' or 'dft', got {loss_type!r}")
    per_token = linear_cross_entropy(flat_h, lm_head.weight, flat_y, reduction="none", logit_softcap=softcap,
                                     bias=lm_head.bias, chunk_tokens=chunk_tokens, return_token_stats=token_stats,
                                     backend=backend)
    per_token, stats = per_token if token_stats else (per_token, None)
    weighted = per_token * torch.exp(-per_token).detach()  # ignored positions: loss 0, weight 1, term 0
    count = (flat_y != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    denom = torch.as_tensor(count, device=weighted.device).to(weighted.dtype).clamp_min(1.0)
    loss = weighted.sum() / denom
    return (loss, stats) if token_stats else loss


def sft_loss(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    loss_type: str = "nll",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-LM loss of ``model`` on ``inputs`` without materialising the logits.

    The last hidden states come from :func:`swiftune.models.heads.hidden_states_and_head` (the
    model's own forward, ``logits_to_keep=1``), and the loss is :func:`head_loss` of those states
    against the LM head. Labels are unshifted (transformers' convention); the shift happens here,
    on the labels only.

    Returns ``(loss, last_hidden_state)``. With ``num_items_in_batch`` the loss is the sum over
    trained tokens divided by it (gradient accumulation / multi-GPU); else the mean.
    """
    hidden, lm_head, softcap = hidden_states_and_head(model, **inputs)
    loss = head_loss(hidden, lm_head, softcap, shift_labels(labels), num_items_in_batch, chunk_tokens, loss_type)
    return loss, hidden


def shuffle_as_datasets(items: list, seed: int) -> None:
    """Reorder ``items`` in place as ``datasets.Dataset.shuffle(seed=seed)`` reorders rows (NumPy's
    ``default_rng(seed).permutation``), so that TRL's ``shuffle_dataset`` order, and with it the
    Trainer's sampled batches, is the same."""
    order = np.random.default_rng(seed).permutation(len(items))
    items[:] = [items[i] for i in order]


SWIFTUNE_COLLATORS = (PaddingFreeCollator, PackedCollator, PaddedCollator)  # read completion_mask themselves


class TrlExampleCollator:
    """A ``data_collator`` given to the trainer, fed the columns TRL 1.16's prepared examples have:
    ``input_ids``, ``labels`` (the token where it trains, ``-100`` elsewhere, unshifted) and, packed,
    ``seq_lengths``, beside swiftune's ``completion_mask``. A collator written for TRL (its own
    ``DataCollatorForLanguageModeling`` reads ``labels``, falling back to ``input_ids``) then trains
    the tokens TRL trains: given the mask alone, it trained every token, prompts included. The mask
    stays, for a script's collator that wraps one of swiftune's (which read it, not ``labels``)."""

    def __init__(self, collate: Callable[[list[dict]], dict]):
        self.collate = collate

    def __call__(self, examples: list[dict]) -> dict:
        return self.collate([trl_example(e) for e in examples])


def trl_example(example: dict) -> dict:
    """``example`` with TRL's ``labels`` column beside its ``completion_mask`` (``None``: every token trains)."""
    if "completion_mask" not in example or "labels" in example:
        return example
    mask = example["completion_mask"]
    ids = example["input_ids"]
    labels = list(ids) if mask is None else [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    return {**example, "labels": labels}
