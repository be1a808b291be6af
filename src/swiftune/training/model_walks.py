"""The trainers' per-step walks over the model, done over lists found once.

transformers' ``Trainer`` walks the whole module tree several times a step: ``model.train()`` at
the start of every ``training_step`` (a recursive call per module), gradient clipping over
``model.parameters()`` and ``model.zero_grad()`` after the optimizer step (a recursive generator
per module each). With LoRA on every linear layer of an 8B model that is ~3,000 modules and ~80,000
Python calls a step, all host time while the GPU waits. None of it changes a number:

* the training flags are already what ``train()`` would set on every step after the first;
* the parameters without a gradient are skipped by clipping and ``zero_grad`` anyway.

:class:`ModelWalkIndex` keeps the model's modules and parameters (in ``modules()`` /
``parameters()`` order), found again when a different model object is asked for or the model's
set of PEFT adapter names changes (``add_adapter`` / ``load_adapter`` / ``delete_adapter``); the
trainable ones are read from the kept list at each call, so a ``requires_grad`` change is followed
at once. :func:`listed_module_walks` gives the model, for one ``trainer.train()`` call, a ``train``
that returns at once when every module is already in the asked mode and a ``zero_grad`` that sets
the kept parameters' gradients to ``None``; both fall back to ``nn.Module``'s own otherwise.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from types import MethodType
from typing import Any, TypeVar

from torch import nn
from transformers import PreTrainedModel

from ..models.patching import attention_is_plain, causal_lm_of
from ..models.state import model_patch
from ..models.tiled_mlp import is_tiled, tiling_token

T = TypeVar("T")

#: ``train`` implementations that only set ``training`` flags (transformers' also re-applies hub
#: kernels, but only when the mode changes): a tree of modules using only these is left as it is when
#: every flag already has the asked value. Any other (PEFT's DoRA layer, a user's module) walks.
_FLAG_ONLY_TRAIN = (nn.Module.train, PreTrainedModel.train)


def peft_adapter_names(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s PEFT adapters (a DDP-style ``.module`` wrapper unwrapped). PEFT sets
    the same ``peft_config`` dict on the transformers model it wraps, so its names are read there too."""
    configs = getattr(model, "peft_config", None)
    if configs is None:
        configs = getattr(getattr(model, "module", None), "peft_config", None)
    return tuple(configs) if isinstance(configs, dict) else ()


class ModelKey:
    """Which model a walk of the module tree was made on: the model object (held weakly) and its set
    of PEFT adapter names, the ways the trainers' models gain or lose modules (``get_peft_model``,
    ``add_adapter`` / ``load_adapter`` / ``delete_adapter``). Checking it costs a dict read, not a walk.

    Modules swapped in or out by hand without PEFT's adapter API do not change it: whoever keeps a
    walk says so and offers a ``clear``."""

    __slots__ = ("_model", "_adapters")

    def __init__(self) -> None:
        self._model: weakref.ref | None = None
        self._adapters: tuple[str, ...] = ()

    def changed(self, model: nn.Module) -> bool:
        """Whether ``model`` is another object than the one recorded, or its adapter names differ
        (always True the first time); records ``model``'s either way."""
        adapters = peft_adapter_names(model)
        if self._model is not None and self._model() is model and adapters == self._adapters:
            return False
        self._model, self._adapters = weakref.ref(model), adapters
        return True

    def clear(self) -> None:
        self._model, self._adapters = None, ()


class ModelWalkIndex:
    """The modules and parameters of one model, found once and reused while the model object and
    its PEFT adapter names stay the same.

    Modules or parameters added by hand without PEFT's adapter API are not seen until :meth:`clear`
    (the trainers start a new index at every ``train()`` call, so changes between calls are seen).
    """

    def __init__(self) -> None:
        self._key = ModelKey()
        # weak: the model holds what holds this index (offloaded checkpointing's state, the trainers), so a
        # strong list of its modules, the model among them, would be a reference cycle that keeps the model,
        # GPU memory and all, alive after its last reference goes, until Python's cycle collector runs
        self._modules: list[weakref.ref] = []
        self._parameters: list[nn.Parameter] = []
        self._named_parameters: list[tuple[str, nn.Parameter]] = []
        self._flag_only_train = False
        self._answers: dict[tuple, tuple[object, Any]] = {}

    def _current(self, model: nn.Module) -> None:
        if self._key.changed(model):
            self._answers = {}
            modules = list(model.modules())
            self._modules = [weakref.ref(m) for m in modules]
            self._named_parameters = list(model.named_parameters())
            self._parameters = [p for _, p in self._named_parameters]
            self._flag_only_train = all(type(m).train in _FLAG_ONLY_TRAIN for m in modules)

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """``list(model.modules())``, kept."""
        self._current(model)
        return [m for m in (r() for r in self._modules) if m is not None]

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """``list(model.parameters())``, kept."""
        self._current(model)
        return self._parameters

    def named_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``list(model.named_parameters())``, kept."""
        self._current(model)
        return self._named_parameters

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters that require grad now, in ``parameters()`` order (read at every call)."""
        return [p for p in self.parameters(model) if p.requires_grad]

    def in_mode(self, model: nn.Module, mode: bool) -> bool:
        """Whether ``model.train(mode)`` would change nothing: every module's flag is ``mode`` and
        no module's ``train`` does more than set it."""
        modules = self.modules(model)  # walks again (and sets the flag below) when the model changed
        return self._flag_only_train and all(m.training is mode for m in modules)

    def answer(self, model: nn.Module, compute: Callable[..., T], *args: Any, token: object = None) -> T:
        """``compute(model, *args)``, kept: computed again when the model object or its adapter names
        change (as the lists) or when ``token`` is not the object given with the kept answer.
        ``token``: an object its owner replaces whenever something ``compute`` reads beside the
        module tree changes (:func:`~swiftune.models.tiled_mlp.tiling_token`, the model's patch
        record); compared by identity. An answer that must follow a value changing every step (a
        flag) keeps the module to read it from, not the value."""
        self._current(model)
        key = (compute, args)
        kept = self._answers.get(key)
        if kept is not None and kept[0] is token:
            return kept[1]
        value = compute(model, *args)
        self._answers[key] = (token, value)
        return value

    def is_tiled(self, model: nn.Module, projections: bool = False) -> bool:
        """:func:`~swiftune.models.tiled_mlp.is_tiled`, kept while the model, its adapters and the
        tiling (:func:`~swiftune.models.tiled_mlp.tiling_token`) stay the same."""
        return self.answer(model, is_tiled, projections, token=tiling_token())

    def attention_is_plain(self, model: nn.Module) -> bool:
        """:func:`~swiftune.models.patching.attention_is_plain`, kept while the model, its adapters and
        its patch record stay the same (:func:`~swiftune.patch_model` records a new one at every call,
        which is what sets the attention modules' specs)."""
        return self.answer(model, attention_is_plain, token=model_patch(causal_lm_of(model)))

    def clear(self) -> None:
        self.__init__()


def _train_unless_in_mode(index: ModelWalkIndex, model: nn.Module, mode: bool = True) -> nn.Module:
    if isinstance(mode, bool) and index.in_mode(model, mode):
        return model
    return type(model).train(model, mode)  # the class's own (it raises on a non-bool mode)


def _zero_grad_listed(index: ModelWalkIndex, model: nn.Module, set_to_none: bool = True) -> None:
    if not set_to_none or getattr(model, "_is_replica", False):
        return type(model).zero_grad(model, set_to_none)  # the class's own (zeroing in place, DataParallel's warning)
    for p in index.parameters(model):
        if p.grad is not None:
            p.grad = None


_INSTALLED = ("train", "zero_grad")


@contextlib.contextmanager
def listed_module_walks(model: nn.Module, index: ModelWalkIndex) -> Iterator[None]:
    """Within the block, ``model.train(mode)`` / ``model.eval()`` return at once when nothing would
    change and ``model.zero_grad()`` walks ``index``'s kept parameters (see the module doc); the
    model's own methods come back after. A model that already has its own instance attribute of
    either name is left alone."""
    if any(name in model.__dict__ for name in _INSTALLED):
        yield
        return
    model.__dict__["train"] = MethodType(partial(_train_unless_in_mode, index), model)
    model.__dict__["zero_grad"] = MethodType(partial(_zero_grad_listed, index), model)
    try:
        yield
    finally:
        for name in _INSTALLED:
            model.__dict__.pop(name, None)


__all__ = ["ModelKey", "ModelWalkIndex", "listed_module_walks", "peft_adapter_names"]
