"""Answers found by walking the module tree, kept across forwards (training.model_walks, the LoRA
layer index, the tiled forward's subtree in models.tiled_mlp), follow every change of the model:
each is compared with the plain walk before and after a change that alters it (adapters added or
deleted, a module swapped in by hand, tiling switched on and off, patching), so a stale answer fails.
With everything found once, the per-forward path (forward, backward, offloaded checkpointing's GPU
budget setup) calls ``named_modules`` no more, and its loss and gradients are transformers + PEFT's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.helpers import assert_gradients_match

peft = pytest.importorskip("peft")

MLP = ["gate_proj", "up_proj", "down_proj"]


def _qwen3(layers: int = 2) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def _lora(model: nn.Module, targets: list[str], name: str | None = None):
    config = peft.LoraConfig(r=2, target_modules=targets, lora_dropout=0.0)
    if name is None:
        model = peft.get_peft_model(model, config)
        name = "default"
    else:
        model.add_adapter(name, config)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if f"lora_B.{name}." in n:  # PEFT starts B at zero: the gradients of A would be zero
            nn.init.normal_(p, std=0.5)
    return model


def _ids(modules) -> list[int]:
    return [id(m) for m in modules]


class _CountedWalks:
    """Counts calls of ``nn.Module.named_modules``, which ``modules()``, ``parameters()`` and
    ``named_parameters()`` all go through (each recursion level counts once)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        plain = nn.Module.named_modules

        def counted(module, *args, **kwargs):
            self.calls += 1
            return plain(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, "named_modules", counted)


def test_model_key_and_lora_layer_index_follow_adapters():
    from swiftune.training.lora_casting import LoraLayerIndex
    from swiftune.training.model_walks import ModelKey

    model = _lora(_qwen3(), ["q_proj", "v_proj"])
    key = ModelKey()
    assert key.changed(model) and not key.changed(model)
    index = LoraLayerIndex()

    def plain():
        return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "cast_input_dtype_enabled")]

    before = index.layers(model)
    assert _ids(before) == _ids(plain()) and len(before) == 4
    assert index.layers(model) is before  # kept, not walked again
    _lora(model, ["q_proj", "v_proj", "o_proj"], name="second")  # two more LoRA layers (o_proj)
    assert key.changed(model) and not key.changed(model)
    after = index.layers(model)
    assert _ids(after) == _ids(plain()) and len(after) == 6
    model.delete_adapter("second")
    assert key.changed(model)
    assert _ids(index.layers(model)) == _ids(plain())
    other = _lora(_qwen3(), ["q_proj"])
    assert key.changed(other) and _ids(index.layers(other)) == _ids(
        m for m in other.modules() if hasattr(m, "lora_A") and hasattr(m, "cast_input_dtype_enabled"))


def test_kept_lora_input_cast_follows_new_adapters_and_the_flag():
    from swiftune.training.lora_casting import lora_input_casting, lora_inputs_cast
    from swiftune.training.model_walks import ModelWalkIndex

    hf = _qwen3()
    walks = ModelWalkIndex()
    assert lora_inputs_cast(hf, walks) is lora_inputs_cast(hf) is True  # no LoRA layer: nothing to skip
    model = _lora(hf, ["q_proj"])  # the same transformers object gains LoRA layers (and PEFT's adapter names)
    with lora_input_casting(model, enabled=False):
        assert lora_inputs_cast(hf, walks) is lora_inputs_cast(hf) is False
    assert lora_inputs_cast(hf, walks) is lora_inputs_cast(hf) is True


def test_kept_is_tiled_follows_tiling():
    from swiftune.models.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, is_tiled
    from swiftune.training.model_walks import ModelWalkIndex

    model = _lora(_qwen3(), ["q_proj", "v_proj", *MLP])
    hf = model.get_base_model()
    walks = ModelWalkIndex()

    def check(mlp: bool, projections: bool):
        assert (walks.is_tiled(hf), walks.is_tiled(hf, projections=True)) == (mlp, projections)
        assert (is_tiled(hf), is_tiled(hf, projections=True)) == (mlp, projections)

    check(False, False)
    enable_tiled_mlp(model)
    check(True, False)
    enable_tiled_mlp(model, projections=True)
    check(True, True)
    disable_tiled_mlp(model)
    check(False, False)


def test_kept_attention_is_plain_follows_patching():
    import swiftune
    from swiftune.models.patching import attention_is_plain
    from swiftune.training.model_walks import ModelWalkIndex

    model = _lora(_qwen3(), ["q_proj"])
    hf = model.get_base_model()
    walks = ModelWalkIndex()
    assert walks.attention_is_plain(hf) is attention_is_plain(hf) is False  # nothing patched: nothing known
    swiftune.patch_model(model, attention=None, kernel_backend="reference")
    assert walks.attention_is_plain(hf) is attention_is_plain(hf) is True
    hf.model.layers[1].self_attn.sliding_window = 4  # a windowed layer, seen when patching again
    swiftune.patch_model(model, attention=None, kernel_backend="reference")
    assert walks.attention_is_plain(hf) is attention_is_plain(hf) is False


def test_attention_with_sinks_is_not_plain():
    """gpt-oss with every layer on full attention (no window) still has sinks, which per-document sdpa
    cannot take: not plain, so the checkpointing budget plans its attention as another kernel's."""
    import swiftune
    from swiftune.models.patching import attention_is_plain
    from tests.test_moe_parity import tiny_gpt_oss

    model = tiny_gpt_oss(layer_types=["full_attention", "full_attention"])
    swiftune.patch_model(model, attention=None, kernel_backend="reference")
    assert all(layer.self_attn.sliding_window is None for layer in model.model.layers)
    assert attention_is_plain(model) is False
    for layer in model.model.layers:  # the same layers without sinks are plain
        layer.self_attn.sinks = None
    assert attention_is_plain(model) is True


def _mlp_grads(mlp: nn.Module, forward, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in mlp.parameters():
        p.grad = None
    out = forward(x)
    weight = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}


def test_tiled_forward_kept_subtree_follows_adapters_and_swaps(monkeypatch):
    """The tiled MLP's gradients against the MLP's own (transformers + PEFT) forward after each change
    of its subtree: a stale parameter list would leave a new adapter without gradient, or give a
    deleted one a zero gradient."""
    from swiftune.models.tiled_mlp import enable_tiled_mlp

    model = _lora(_qwen3(layers=1), MLP)
    mlp = model.get_base_model().model.layers[0].mlp
    enable_tiled_mlp(model, tile_tokens=4)
    x = torch.randn(1, 12, 16)

    def check(mlp=mlp):
        plain = type(mlp).forward.__get__(mlp)  # the class forward: untiled, PEFT's layers underneath
        trainable = [n for n, p in mlp.named_parameters() if p.requires_grad]
        ref_out, ref = _mlp_grads(mlp, plain, x)
        out, grads = _mlp_grads(mlp, mlp, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        assert_gradients_match(ref, grads, trainable, 1e-5)
        return grads

    assert all("default" in n for n in check())
    twin = copy.deepcopy(model)  # a copy made after a tiled forward (a reference model) tiles its own tensors
    twin_mlp = twin.get_base_model().model.layers[0].mlp
    for p in mlp.parameters():
        p.grad = None
    assert check(twin_mlp) and all(p.grad is None for p in mlp.parameters())
    counter = _CountedWalks(monkeypatch)
    mlp(x).sum().backward()  # the tiled forward and backward, the subtree kept: no walk
    assert counter.calls == 0
    _lora(model, MLP, name="second")
    model.set_adapter("second")  # the new adapter's layers are the trainable ones now
    second = [p for n, p in mlp.named_parameters() if "second" in n]
    assert len(second) == 6 and any("second" in n for n in check())
    mlp.down_proj = nn.Linear(32, 16, bias=False)  # swapped in by hand, trainable
    assert "down_proj.weight" in check()
    model.set_adapter("default")
    model.delete_adapter("second")
    for p in second:
        p.grad = None
    assert not any("second" in n for n in check())
    assert all(p.grad is None for p in second)  # the deleted adapter is no longer among the tiled tensors


def test_offloaded_tiled_lora_forward_walks_nothing_after_the_first(monkeypatch):
    """Three forward + backward passes of a patched LoRA model with tiled MLPs and projections under
    offloaded checkpointing, each followed by the GPU budget's setup (what every forward on CUDA
    asks, with the sdpa hint): the loss and every gradient are plain transformers + PEFT's, the kept
    setup is the walked one, and after the first pass nothing calls ``named_modules``."""
    import swiftune
    from swiftune.models.tiled_mlp import enable_tiled_mlp
    from swiftune.training.checkpointing import _setup_of, enable_offloaded_checkpointing

    model = _lora(_qwen3(), ["q_proj", "k_proj", "v_proj", "o_proj", *MLP])
    reference = copy.deepcopy(model)
    swiftune.patch_model(model, attention=None, kernel_backend="reference")
    enable_tiled_mlp(model, tile_tokens=4, projections=True)
    hf = model.get_base_model()
    enable_offloaded_checkpointing(hf, host_budget_bytes=1 << 20)
    state = hf._swiftune_offload_state
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (1, 24))
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    trainable = [n for n, p in params.items() if p.requires_grad]
    model.train()
    reference.train()
    counter = _CountedWalks(monkeypatch)
    calls = []
    for _ in range(3):
        for p in params.values():
            p.grad = None
        before = counter.calls
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        x = torch.randn(1, 24, 16, dtype=torch.bfloat16)
        kept = _setup_of(hf, x, "sdpa", 24, state.walks)
        calls.append(counter.calls - before)
        assert kept == _setup_of(hf, x, "sdpa", 24)  # the plain walks' setup
        assert kept.tiled_mlp and kept.tiled_projections and kept.lora_rank == 2
        for p in ref_params.values():
            p.grad = None
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        assert_gradients_match({n: p.grad for n, p in ref_params.items() if p.grad is not None}, grads, trainable,
                               1e-4)
    assert calls[0] > 0 and calls[1:] == [0, 0], calls


def test_a_deleted_offloaded_model_is_freed_without_the_cycle_collector():
    """After a step under offloaded checkpointing, dropping the last reference to the model frees it at
    once: the state the model holds keeps its walk of the module tree without holding the model (or
    a module that holds the state) strongly. A reference cycle would keep its tensors, GPU memory
    included, until Python's cycle collector runs (``del model; torch.cuda.empty_cache()`` freeing
    nothing)."""
    import gc
    import weakref

    import swiftune
    from swiftune.training.checkpointing import enable_offloaded_checkpointing

    model = _lora(_qwen3(), ["q_proj", "v_proj", *MLP])
    swiftune.patch_model(model, attention=None, kernel_backend="reference")
    hf = model.get_base_model()
    enable_offloaded_checkpointing(hf, host_budget_bytes=1 << 20)
    ids = torch.randint(0, 64, (1, 12))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert hf._swiftune_offload_state.walks.parameters(hf)  # the walk is kept
    refs = [weakref.ref(model), weakref.ref(hf)]
    gc.collect()  # the garbage of the step and of earlier tests, before the collector is held off
    gc.disable()
    try:
        del model, hf  # only reference counting may free them now
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()
