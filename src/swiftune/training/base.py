"""What both trainers do the same way on transformers' ``Trainer`` (:class:`SwiftuneTrainer`).

:class:`~swiftune.sft.SFTTrainer` and :class:`~swiftune.rl.GRPOTrainer` are siblings: neither
imports the other, so the start-up they share lives here, one layer below them:

* the arguments: ``None`` becomes the trainer's config with its default ``output_dir``, anything
  but that config class is refused (:meth:`SwiftuneTrainer.resolve_args`);
* the model: a path or hub name is loaded with :meth:`FastModel.from_pretrained`, its tokenizer
  taken when none is given; a ``peft_config`` wraps the model with adapters; a model that is not
  patched yet is (:meth:`SwiftuneTrainer.prepare_model`);
* the progress display: transformers' progress bar and printer give way to the trainer's
  :class:`~swiftune.training.metrics.MetricsCallback` (:meth:`SwiftuneTrainer.use_swiftune_callbacks`);
* the input embeddings' require-grad hook, which ``gradient_checkpointing=True`` puts back at ``train()``, is
  removed again where checkpointing runs without reentrance (:class:`DropInputRequireGrads`);
* every training step runs with PEFT's LoRA input casts switched off where autocast makes them
  no-ops (:func:`~swiftune.training.lora_casting.training_step_lora_casting`);
* the Trainer's per-step walks over the model (``model.train()``, ``model.zero_grad()``, gradient
  clipping) go over lists found once per ``train()`` call (:mod:`~swiftune.training.model_walks`).

The NaN/inf guards, complete checkpoints, the run lock and Ctrl-C handling come with
:class:`~swiftune.training.safety.RunSafetyMixin`, which this class mixes in before ``Trainer``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from accelerate.utils import DistributedType
import torch
from torch import nn
from transformers import Trainer, set_seed
from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.utils import is_sagemaker_mp_enabled

from ..errors import ConfigError
from ..models import is_patched, patch_model
from ..models.patching import fuse_lora_if_patched
from .loading import FastModel, checkpoints_reentrantly, drop_input_require_grads
from .lora_casting import LoraLayerIndex, training_step_lora_casting
from .metrics import MetricsCallback
from .model_walks import ModelWalkIndex, listed_module_walks
from .quantization import refuse_full_finetuning_of_4bit
from .safety import RunSafetyMixin


class DropInputRequireGrads(TrainerCallback):
    """At the start of training, the input embeddings' require-grad hook removed again where no layer checkpoints
    with reentrance (:func:`~swiftune.training.loading.drop_input_require_grads` says what it costs).

    ``Trainer.train`` with ``gradient_checkpointing=True`` enables transformers' checkpointing once more, and with
    it that hook, after :meth:`FastModel.get_peft_model` had removed it; ``on_train_begin`` runs after that."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any):
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if hf_model is not None and not checkpoints_reentrantly(hf_model):
            drop_input_require_grads(hf_model)


class SwiftuneTrainer(RunSafetyMixin, Trainer):
    """A ``transformers.Trainer`` with swiftune's run safety and the start-up of the module doc.

    A subclass sets :attr:`config_class` and :attr:`default_output_dir`, and calls
    :meth:`resolve_args` and :meth:`prepare_model` before ``Trainer.__init__``, then
    :meth:`use_swiftune_callbacks` after it.
    """

    config_class: ClassVar[type]
    default_output_dir: ClassVar[str]

    @classmethod
    def resolve_args(cls, args: Any) -> Any:
        """``args``, or the trainer's config with its default ``output_dir`` when ``None``; a
        ``TypeError`` for any other class (a plain ``TrainingArguments`` lacks swiftune's fields)."""
        args = args or cls.config_class(output_dir=cls.default_output_dir)
        if not isinstance(args, cls.config_class):
            raise TypeError(f"args must be a swiftune.{cls.config_class.__name__}, got {type(args).__name__}")
        return args

    @classmethod
    def processing_class_of(cls, processing_class: Any, kwargs: dict[str, Any]) -> Any:
        """``processing_class``, or the ``tokenizer=`` keyword Unsloth's notebooks pass (their patched
        trainers take it; TRL 1.16 and transformers 5 do not), popped from ``kwargs``. Both given and
        different: a ``ConfigError`` (which one would train is not clear)."""
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is None:
            return processing_class
        if processing_class is not None and processing_class is not tokenizer:
            raise ConfigError(f"{cls.__name__}: tokenizer= and processing_class= name different objects; pass the "
                              "tokenizer once, as processing_class=tokenizer (TRL's name)")
        return tokenizer

    @staticmethod
    def prepare_model(
        model: nn.Module | str, args: Any, processing_class: Any, train_dataset: Any, peft_config: Any, *,
        missing_tokenizer: str, missing_dataset: str, **load_kwargs: Any,
    ) -> tuple[nn.Module, Any]:
        """``(model, tokenizer)`` ready for training, in this order: a path or hub name loaded
        (``load_kwargs`` go to :meth:`FastModel.from_pretrained`, with the config's attention and
        kernel backends), the tokenizer and the dataset required (``ValueError`` with the given
        messages), adapters added from ``peft_config``, the model patched if it is not.

        The global RNG is seeded from ``args.seed`` first, as TRL's trainers do: PEFT draws the
        adapters' initial weights from it, so the same script starts from the same adapters."""
        set_seed(args.seed)
        if isinstance(model, str):
            model, loaded_tokenizer = FastModel.from_pretrained(
                model, attn_implementation=args.attention_backend, kernel_backend=args.kernel_backend,
                **load_kwargs,
            )
            processing_class = processing_class or loaded_tokenizer
        if processing_class is None:
            raise ValueError(missing_tokenizer)
        if train_dataset is None:
            raise ValueError(missing_dataset)
        if peft_config is not None:
            import peft  # only when asked for: PEFT is slow to import

            model = peft.get_peft_model(model, peft_config)
        if getattr(model, "peft_config", None) is None:
            refuse_full_finetuning_of_4bit(model, "the trainer's model")
        if not is_patched(model):
            patch_model(model, attention=args.attention_backend, kernel_backend=args.kernel_backend)
        else:
            fuse_lora_if_patched(model)  # adapters added after patching, by the caller's own PEFT
        return model, processing_class

    def use_swiftune_callbacks(self, callback: MetricsCallback) -> None:
        """Replace transformers' progress bar and log printer with ``callback`` (which shows both); add
        :class:`DropInputRequireGrads`."""
        self.remove_callback(ProgressCallback)
        self.remove_callback(PrinterCallback)
        self.add_callback(callback)
        self.add_callback(DropInputRequireGrads)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # a training step's log carries the token counts and tokens/s since the last one, so that
        # tensorboard, wandb and the other integrations see them too, not only metrics.jsonl
        meter = getattr(self, "token_meter", None)
        if meter is not None and "loss" in logs:
            logs = {**logs, **meter.take(self._sum_over_processes)}
        if meter is not None and "train_runtime" in logs:  # the end of train(): the summary's token count
            meter.sum_total(self._sum_over_processes)
        super().log(logs, start_time)

    def _sum_over_processes(self, values: list[float]) -> list[float]:
        """``values`` summed over every process of the run (each process calls it at the same log)."""
        if self.accelerator.num_processes == 1:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.reduce(total, reduction="sum").tolist()

    def training_step(self, model, *args, **kwargs):
        # Under bf16/fp16 autocast PEFT's float32 copies of every LoRA input are cast straight
        # back: skip both copies in the forward and in every recompute of the backward (the same
        # numbers). GRPO's generation, which runs inside the step without autocast, switches the
        # casting back on around itself. The LoRA layers are looked up once, not walked every step.
        with training_step_lora_casting(model, self.args, self.lora_layer_index):
            return super().training_step(model, *args, **kwargs)

    @property
    def lora_layer_index(self) -> LoraLayerIndex:
        """The model's PEFT LoRA layers, found once and walked again only when the model or its
        adapters change (the casting switches above and GRPO's generation use it)."""
        index = self.__dict__.get("_lora_layer_index")
        if index is None:
            index = self.__dict__["_lora_layer_index"] = LoraLayerIndex()
        return index

    @property
    def model_walk_index(self) -> ModelWalkIndex:
        """The model's modules and parameters, found once per ``train()`` call (and again when the
        model or its adapters change): what the step's ``train()``, ``zero_grad()`` and clipping walk."""
        index = self.__dict__.get("_model_walk_index")
        if index is None:
            index = self.__dict__["_model_walk_index"] = ModelWalkIndex()
        return index

    def train(self, *args, **kwargs):
        # A fresh index per call: modules or parameters changed by hand between two train() calls are
        # seen. The model's train()/zero_grad() skip their module walks only within this call.
        self.model_walk_index.clear()
        with listed_module_walks(self.model, self.model_walk_index):
            return super().train(*args, **kwargs)

    def _clip_grad_norm(self, model):
        # The same clipping over the parameters that have a gradient (the trainable ones), in
        # parameters() order and read from the kept list: clip_grad_norm_ skips the others itself, so
        # the norm and the clipped gradients are the same numbers. Only where accelerate clips the list it is given (one process, DDP);
        # FSDP, DeepSpeed, XLA, SageMaker and mixed device meshes keep the Trainer's own path.
        plain = (self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                        DistributedType.MULTI_CPU)
                 and not (self.args.fp16 and is_sagemaker_mp_enabled()))
        if not plain or self._has_mixed_mesh_grads(model):
            return super()._clip_grad_norm(model)
        with_grads = [p for p in self.model_walk_index.parameters(model) if p.grad is not None]
        return self.accelerator.clip_grad_norm_(with_grads, self.args.max_grad_norm)


__all__ = ["DropInputRequireGrads", "SwiftuneTrainer"]
