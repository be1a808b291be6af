"""Offloaded gradient checkpointing and the tiled MLP, on CPU (the offload path copies into CPU pages).

Against the model without any checkpointing: loss and every gradient (LoRA and full fine-tuning,
Qwen3 and Gemma 2, plain and patched/packed), budget splits as a pure function, the clear error
when both budgets are short, and the tiled MLP against the untiled one.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from swiftune.data import tiny_model_config
from swiftune.training.checkpointing import (
    CheckpointBudgetError,
    choose_page_bytes,
    decoder_layers,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_stats,
    split_layers,
)
from swiftune.models.tiled_mlp import (
    disable_tiled_mlp,
    enable_tiled_mlp,
    is_tiled,
    tile_bounds,
    tiled_apply,
    tiled_mlp_forward,
)
from tests.helpers import rel_err

# ------------------------------------------------------------------------------ pure budgets


def test_split_layers_keeps_what_fits_and_offloads_the_first_layers():
    plan = split_layers(36, 1000, gpu_budget_bytes=20_500, host_budget_bytes=10**9, page_bytes=256)
    assert plan.keep == tuple(range(16, 36)) and plan.offload == tuple(range(16))
    assert plan.gpu_bytes == 20_000
    assert plan.host_bytes == 16 * 4 * 256  # ceil(1000 / 256) = 4 pages per layer


def test_split_layers_edges():
    everything = split_layers(4, 100, gpu_budget_bytes=400, host_budget_bytes=0)
    assert everything.offload == () and everything.keep == (0, 1, 2, 3) and everything.host_bytes == 0
    nothing = split_layers(4, 100, gpu_budget_bytes=0, host_budget_bytes=4 * 128, page_bytes=128)
    assert nothing.offload == (0, 1, 2, 3) and nothing.keep == ()
    negative = split_layers(3, 100, gpu_budget_bytes=-5, host_budget_bytes=10**6)
    assert negative.keep == ()
    assert split_layers(3, 0, 0, 0).keep == (0, 1, 2)


def test_split_layers_clear_error_when_both_budgets_are_short():
    # Qwen3-8B at 400K tokens: 36 x 3.28 GB; 60 GB of GPU budget and 40 GB of host cannot hold it.
    layer = 400_000 * 4096 * 2
    with pytest.raises(CheckpointBudgetError, match=r"holds 18 of them.*other 18 need"):
        split_layers(36, layer, gpu_budget_bytes=60 * 10**9, host_budget_bytes=40 * 10**9, allow_derived=False)
    ok = split_layers(36, layer, gpu_budget_bytes=60 * 10**9, host_budget_bytes=80 * 10**9)
    assert len(ok.keep) == 18 and len(ok.offload) == 18 and ok.derived == ()
    # even with every second layer input recomputed (18 derived), 0 + 0 bytes hold nothing
    with pytest.raises(CheckpointBudgetError, match="every second layer"):
        split_layers(36, layer, gpu_budget_bytes=0, host_budget_bytes=0)
    assert isinstance(CheckpointBudgetError("x"), MemoryError)


def test_split_layers_derives_every_second_input_when_the_host_is_short():
    """40 GB of host holds 12 of the 18 offloaded inputs (3.28 GB each): the 6 missing ones are
    derived, layers 1, 3, ..., 11, each right after a stored layer; the rest split as before."""
    layer = 400_000 * 4096 * 2
    plan = split_layers(36, layer, gpu_budget_bytes=60 * 10**9, host_budget_bytes=40 * 10**9)
    assert plan.derived == (1, 3, 5, 7, 9, 11)
    assert len(plan.keep) == 18 and len(plan.offload) == 12
    assert sorted(plan.keep + plan.offload + plan.derived) == list(range(36))
    assert plan.offload == (0, 2, 4, 6, 8, 10, 12, 13, 14, 15, 16, 17) and plan.keep == tuple(range(18, 36))
    assert all(i - 1 not in plan.derived for i in plan.derived)  # a derived input's source is stored
    assert plan.host_bytes <= 40 * 10**9
    # the most it derives: every second layer (here 18 of 36, nothing else stored off the GPU)
    most = split_layers(36, layer, gpu_budget_bytes=18 * layer, host_budget_bytes=0)
    assert most.derived == tuple(range(1, 36, 2)) and most.offload == () and len(most.keep) == 18


def test_page_bytes_are_powers_of_two_no_larger_than_needed():
    assert choose_page_bytes(1000) == 1024
    assert choose_page_bytes(3 * 2**30) == 64 * 2**20
    assert choose_page_bytes(4096, page_bytes=1024) == 1024


# ------------------------------------------------------------------------------- models

STEPS_TOKENS = 50  # not a multiple of the page: the last page of each layer is partial


def _model(family: str, lora: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_model_config(family, vocab_size=320, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return model


def _step(model: nn.Module, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, got, tol=1e-6):
    (l0, g0), (l1, g1) = ref, got
    assert rel_err(l1, l0) < tol
    assert g0.keys() == g1.keys() and len(g0) > 0
    worst = max(rel_err(g1[k], g0[k]) for k in g0)
    assert worst < tol, worst


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_offloaded_checkpointing_equals_no_checkpointing(family, lora):
    model = _model(family, lora)
    ids = torch.randint(0, 320, (2, STEPS_TOKENS))
    ref = _step(model, ids)
    layer_bytes = ids.numel() * model.config.hidden_size * 4
    # one layer kept, one offloaded, in 4 KiB pages (7 pages, the last one partial)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=layer_bytes, page_bytes=4096)
    got = _step(model, ids)
    stats = offload_stats(model)
    assert stats["offload"] == (0,) and stats["keep"] == (1,)
    assert stats["restored"] == 1 and stats["host_in_use_bytes"] == 0  # pages back in the pool
    _assert_same(ref, got)
    # everything offloaded, a second step reusing the pool's pages
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, page_bytes=4096)
    held = offload_stats(model)["host_pinned_bytes"]
    _assert_same(ref, _step(model, ids))
    assert offload_stats(model)["offload"] == (0, 1)
    assert offload_stats(model)["host_pinned_bytes"] == 2 * held  # grew once for the 2nd layer, no more
    _assert_same(ref, _step(model, ids))
    assert offload_stats(model)["host_pinned_bytes"] == 2 * held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offloaded_inputs_go_through_pinned_pages_on_the_side_stream():
    """On CUDA the layer inputs go to pinned pages on the side stream and come back one layer ahead: the loss
    and every gradient equal the step without checkpointing (float32, the same kernels), in a second step
    reusing the pool's pages too, with every input offloaded and restored."""
    model = _model("qwen3", True).cuda()
    ids = torch.randint(0, 320, (2, STEPS_TOKENS), device="cuda")
    ref = _step(model, ids)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, page_bytes=4096)
    _assert_same(ref, _step(model, ids), tol=1e-5)
    held = offload_stats(model)["host_pinned_bytes"]
    _assert_same(ref, _step(model, ids), tol=1e-5)
    stats = offload_stats(model)
    assert stats["offload"] == (0, 1) and stats["host_pinned_bytes"] == held > 0 and stats["host_in_use_bytes"] == 0
    assert stats["restored"] == 4  # two layers a step, two steps


def test_offload_with_patched_packed_model_and_tiled_mlp():
    """swiftune's patched forwards + packed attention kwargs (position_ids restarting) + tiled MLP."""
    import swiftune

    model = _model("qwen3", lora=False, seed=1)
    swiftune.patch_model(model, attention="reference", kernel_backend="reference")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 320, (1, 60))
    pos = torch.cat([torch.arange(25), torch.arange(35)])[None]
    ref = _step(model, ids, position_ids=pos)
    enable_tiled_mlp(model, tile_tokens=16)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    _assert_same(ref, _step(model, ids, position_ids=pos), tol=1e-5)
    disable_tiled_mlp(model)
    disable_offloaded_checkpointing(model)
    assert not is_tiled(model)
    _assert_same(ref, _step(model, ids, position_ids=pos))


def test_layers_are_recomputed_and_offloaded_inputs_freed_after_forward():
    model = _model("qwen3", lora=True)
    layers = decoder_layers(model)
    calls = [0]
    layers[0].self_attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    inputs: list[weakref.ref] = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args, kw: inputs.append(weakref.ref(args[0] if args else kw["hidden_states"])), with_kwargs=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=2 * 32 * 128 * 4 - 1)  # one layer fits
    ids = torch.randint(0, 320, (1, 32))
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert offload_stats(model)["offload"] == (0,)
    assert inputs[0]() is None, "the offloaded layer input is still referenced on the device"
    assert calls[0] == 1
    loss.backward()
    assert calls[0] == 2  # recomputed in backward


@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_get_peft_model_lets_the_offloaded_first_input_go(patched):
    """transformers' and PEFT's checkpointing set-up make the embeddings' output a leaf that requires
    grad (for reentrant checkpointing); autograd then holds it for the whole step, so the first layer's
    input stays on the device though it was offloaded. FastModel.get_peft_model removes that hook: the
    output is freed after the forward, and every LoRA gradient still equals PEFT's own model run
    without checkpointing."""
    import peft
    from swiftune import FastModel, patch_model

    torch.manual_seed(0)
    cfg = tiny_model_config("qwen3", vocab_size=320, attn_implementation="eager")
    base = AutoModelForCausalLM.from_config(cfg).train()
    reference = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg).train(),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    if patched:
        patch_model(base)
    model = FastModel.get_peft_model(base, r=4, lora_alpha=8, use_gradient_checkpointing="offload",
                                     offload_gpu_budget_bytes=0)
    # every weight copied into the reference, the adapters drawn first with a non-zero B (so that every A
    # gets a gradient too)
    with torch.no_grad():
        for (name, p), (ref_name, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
            assert name == ref_name
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
            ref_p.copy_(p)
    outputs: list[weakref.ref] = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    ids = torch.randint(0, 320, (1, 48))
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert offload_stats(model)["offload"] == (0, 1)
    assert outputs[0]() is None, "the embeddings' output (the offloaded first layer input) is still held"
    loss.backward()
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-5
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * cfg.num_hidden_layers
    for name, ref in ref_grads.items():
        assert grads[name] is not None and ref.abs().max() > 0 and grads[name].abs().max() > 0, name
        assert rel_err(grads[name], ref) < 1e-4, name


def test_retain_graph_restores_again():
    model = _model("qwen3", lora=True)
    ids = torch.randint(0, 320, (1, 40))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()
    assert offload_stats(model)["restored"] == 4  # each layer brought back once per backward
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(p.grad, 2 * once[n]) < 1e-6


def test_host_budget_and_gpu_reserve_helpers():
    from swiftune.training.checkpointing import OffloadState, host_available_bytes

    assert host_available_bytes(margin_bytes=0) >= host_available_bytes() >= 0
    model = _model("qwen3", lora=True)
    hf = model.get_base_model()
    state = OffloadState(hf, decoder_layers(hf), None, None, 2**26, None)
    small, large = (state._reserve(torch.zeros(1, t, 128)) for t in (1000, 100_000))
    assert 0 < small < large
    assert state.gpu_budget(torch.zeros(1, 8, 128)) >= 2**60  # CPU, no budget: everything stays
    assert state.host_budget() <= host_available_bytes() + state.pool.free_bytes


def test_reserve_follows_the_attention_kernel_of_the_forward(monkeypatch):
    """A forward whose attention runs flex reserves less GPU memory for the layer being
    recomputed: no K/V expanded to the query heads (torch 2.11's varlen) and no float32 dq
    accumulator (flash). Checked against those two terms written out here, on a shape whose
    attention phase is the larger one (8 query heads, 2 K/V heads, a narrow MLP)."""
    from peft import LoraConfig, get_peft_model

    import swiftune.attention.backends as backends
    from swiftune.training.checkpointing import OffloadState, _setup_of

    cfg = tiny_model_config("qwen3", vocab_size=320, intermediate_size=32, num_attention_heads=8)
    hf = AutoModelForCausalLM.from_config(cfg)
    get_peft_model(hf, LoraConfig(r=4, target_modules="all-linear"))  # float32 adapters
    state = OffloadState(hf, decoder_layers(hf), None, None, 2**26, None)
    T = 50_000
    x = torch.zeros(1, T, 128, dtype=torch.bfloat16)
    dq, dkv, b = 8 * 32, 2 * 32, 2
    expand_kv = 2 * (dq - dkv) * b * 2  # K and V widened to dq: saved once, and their gradients
    dq_accumulator = dq * 4
    monkeypatch.setattr(backends, "varlen_expands_kv", lambda: True)
    default, flex = state._reserve(x), state._reserve(x, attention_kernel="flex")
    base, lean = _setup_of(hf, x), _setup_of(hf, x, attention_kernel="flex")
    assert base.kv_expanded and base.float32_dq and not lean.kv_expanded and not lean.float32_dq
    assert state._reserve(x, attention_kernel="varlen") == default
    assert default - flex == pytest.approx(1.05 * T * (expand_kv + dq_accumulator), rel=1e-4)  # 1.05: reserve
    monkeypatch.setattr(backends, "varlen_expands_kv", lambda: False)  # a torch whose varlen has GQA
    assert default - state._reserve(x) == pytest.approx(1.05 * T * expand_kv, rel=1e-4)
    assert state._reserve(x) - flex == pytest.approx(1.05 * T * dq_accumulator, rel=1e-4)


def test_reserve_for_per_document_sdpa_keeps_kv_heads_where_every_layer_runs_it(monkeypatch):
    """A packed layout of long documents (on CUDA) runs one sdpa call per document, GQA in the
    kernel: the reserve drops the expanded K/V terms (saved, and their gradients) and keeps the
    float32 dq, but only when every layer runs sdpa: a patched model without sliding windows or
    soft-caps, in half precision (directly or under autocast). Otherwise: the defaults."""
    import swiftune
    import swiftune.attention.backends as backends
    from swiftune.training.checkpointing import OffloadState, _setup_of

    monkeypatch.setattr(backends, "varlen_expands_kv", lambda: True)
    cfg = tiny_model_config("qwen3", vocab_size=320, intermediate_size=32, num_attention_heads=8)
    hf = AutoModelForCausalLM.from_config(cfg)
    state = OffloadState(hf, decoder_layers(hf), None, None, 2**26, None)
    T = 50_000
    x = torch.zeros(1, T, 128, dtype=torch.bfloat16)
    assert state._reserve(x, attention_kernel="sdpa") == state._reserve(x)  # unpatched: its layers unknown
    swiftune.patch_model(hf)
    default = state._reserve(x)
    dq, dkv, b = 8 * 32, 2 * 32, 2
    expand_kv = 2 * (dq - dkv) * b * 2  # K and V widened to dq: saved once, and their gradients
    out_copy = dq * b  # the documents' outputs concatenated, saved by the output projection
    assert default - state._reserve(x, attention_kernel="sdpa") == pytest.approx(
        1.05 * T * (expand_kv - out_copy), rel=1e-4)
    lean = _setup_of(hf, x, attention_kernel="sdpa")
    assert not lean.kv_expanded and lean.float32_dq and lean.attention_out_copy and lean.float32_dq_tokens is None
    # documents of at most 8,192 tokens: the float32 dq of one document at a time
    docs = state._reserve(x, attention_kernel="sdpa", max_doc_tokens=8192)
    assert state._reserve(x, attention_kernel="sdpa") - docs == pytest.approx(1.05 * (T - 8192) * dq * 4, rel=1e-4)
    assert state._reserve(x, attention_kernel="sdpa", max_doc_tokens=10 * T) == state._reserve(x, attention_kernel="sdpa")
    x32 = x.float()
    assert state._reserve(x32, attention_kernel="sdpa") == state._reserve(x32)  # float32: may retry expanded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert state._reserve(x32, attention_kernel="sdpa") < state._reserve(x32)
    for family in ("gemma2", "gemma3"):  # sliding-window layers (and Gemma 2's soft-cap): another kernel
        other = AutoModelForCausalLM.from_config(tiny_model_config(family, vocab_size=320))
        swiftune.patch_model(other)
        other_state = OffloadState(other, decoder_layers(other), None, None, 2**26, None)
        xo = torch.zeros(1, T, other.config.hidden_size, dtype=torch.bfloat16)
        assert other_state._reserve(xo, attention_kernel="sdpa") == other_state._reserve(xo)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_long_documents_tell_the_reserve_sdpa_and_their_longest(monkeypatch):
    """On CUDA a patched bf16 model's row of long documents runs per-document sdpa under ``auto``
    and its packed layout says so to offloaded checkpointing, with its longest document; the
    setup its reserve is planned with takes both (K/V with their own heads, the float32 dq of
    one document)."""
    import swiftune
    from swiftune.training.checkpointing import OffloadState, _setup_of

    seen, setups = [], []
    real = OffloadState.layer_input

    def spy(self, index, x, attention_kernel=None, max_doc_tokens=None):
        seen.append((attention_kernel, max_doc_tokens))
        if index == 0:
            setups.append(_setup_of(self.model_ref(), x, attention_kernel, max_doc_tokens))
        return real(self, index, x, attention_kernel, max_doc_tokens)

    monkeypatch.setattr(OffloadState, "layer_input", spy)
    torch.manual_seed(0)
    cfg = tiny_model_config("qwen3", vocab_size=320, num_attention_heads=8)
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    swiftune.patch_model(model)
    enable_offloaded_checkpointing(model)
    n = 4096
    ids = torch.randint(0, 320, (1, 2 * n), device="cuda")
    pos = torch.cat([torch.arange(n), torch.arange(n)]).to("cuda")[None]
    loss = model(input_ids=ids, labels=ids, position_ids=pos).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert seen == [("sdpa", n)] * len(decoder_layers(model))
    (setup,) = setups
    assert (setup.kv_expanded, setup.attention_out_copy, setup.float32_dq_tokens) == (False, True, n)


def test_reserve_drops_the_lora_input_copies_the_trainers_switch_off():
    """Under bf16 autocast with PEFT's input casts switched off (what the trainers do), the reserve
    for the layer being recomputed has no float32 copies of LoRA inputs: the setup the runtime
    reads from the model says so, and the difference is the planner's terms for those copies."""
    from peft import LoraConfig, get_peft_model

    from swiftune.memory.planner import TrainSetup, layer_working_set, model_shape
    from swiftune.training.checkpointing import OffloadState, _setup_of
    from swiftune.training.lora_casting import lora_input_casting

    cfg = tiny_model_config("qwen3", vocab_size=320)
    hf = AutoModelForCausalLM.from_config(cfg)
    peft_model = get_peft_model(hf, LoraConfig(r=4, target_modules="all-linear"))  # float32 adapters
    state = OffloadState(hf, decoder_layers(hf), None, None, 2**26, None)
    x = torch.zeros(1, 20_000, cfg.hidden_size, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with_casts, setup_casts = state._reserve(x), _setup_of(hf, x)
        with lora_input_casting(peft_model, False):
            without, setup_none = state._reserve(x), _setup_of(hf, x)
    assert setup_casts.lora_input_casts and setup_casts.lora_copies_input and setup_casts.autocast
    assert not setup_none.lora_input_casts and not setup_none.lora_copies_input
    assert setup_none == TrainSetup(**{**setup_casts.__dict__, "lora_input_casts": False})
    shape, T = model_shape(cfg), x.shape[1]
    terms = layer_working_set(shape, T, setup_casts) - layer_working_set(shape, T, setup_none)
    assert terms > 0 and with_casts - without == pytest.approx(1.05 * terms, rel=1e-4)


def test_layers_see_the_forwards_attention_kernel(monkeypatch):
    """The kernel travels from a keyword argument of the model's forward (GRPO's RowLayout) to the
    plan of every layer input; without it the plan uses the defaults."""
    from swiftune.training.checkpointing import ATTENTION_KERNEL_ATTR, OffloadState

    seen = []
    real = OffloadState.layer_input

    def spy(self, index, x, attention_kernel=None, max_doc_tokens=None):
        seen.append(attention_kernel if max_doc_tokens is None else (attention_kernel, max_doc_tokens))
        return real(self, index, x, attention_kernel, max_doc_tokens)

    monkeypatch.setattr(OffloadState, "layer_input", spy)

    class Hint:
        pass

    hint = Hint()
    setattr(hint, ATTENTION_KERNEL_ATTR, "flex")
    model = _model("qwen3", lora=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    ids = torch.randint(0, 320, (1, 16))
    model(input_ids=ids, labels=ids, row_hint=hint).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    layers = len(decoder_layers(model))
    assert seen == ["flex"] * layers + [None] * layers
    # a patched model's packed layout says it too (PackedBatch.attention_kernel): here sdpa, asked for
    import swiftune

    seen.clear()
    swiftune.patch_model(model, attention="sdpa")
    model(input_ids=ids, labels=ids, position_ids=torch.cat([torch.arange(9), torch.arange(7)])[None]).loss.backward()
    assert seen == [("sdpa", 9)] * layers  # and its longest document


def test_clear_error_when_budgets_are_short():
    model = _model("qwen3", lora=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, host_budget_bytes=1000)
    ids = torch.randint(0, 320, (1, 32))
    with pytest.raises(CheckpointBudgetError, match="pinned host memory"):
        model(input_ids=ids, labels=ids)
    assert offload_stats(model)["host_pinned_bytes"] == 0  # raised before allocating anything


def test_no_checkpointing_without_grad_or_in_eval():
    model = _model("qwen3", lora=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    ids = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)
    assert offload_stats(model)["offloaded"] == 0
    model.train()


def test_disable_restores_layers_and_flags():
    model = _model("qwen3", lora=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    assert layers[0].gradient_checkpointing
    enable_offloaded_checkpointing(model)
    assert not layers[0].gradient_checkpointing and "forward" in layers[0].__dict__
    disable_offloaded_checkpointing(model)
    assert layers[0].gradient_checkpointing and "forward" not in layers[0].__dict__
    assert offload_stats(model) == {}


# ------------------------------------------------------------------------------- tiled MLP


def test_tile_bounds_are_balanced():
    assert tile_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tile_bounds(9, 4) == [(0, 3), (3, 6), (6, 9)]
    assert tile_bounds(5, 100) == [(0, 5)]
    assert tile_bounds(0, 4) == []


def _mlp_grads(mlp: nn.Module, x: torch.Tensor, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = fn(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    params = [p.grad.clone() for p in mlp.parameters() if p.requires_grad]
    return y.detach(), [x.grad.clone(), *params]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
def test_tiled_mlp_equals_untiled(lora, tile):
    model = _model("qwen3", lora=lora)
    mlp = decoder_layers(model)[0].mlp
    x = torch.randn(2, 33, model.config.hidden_size)
    y0, g0 = _mlp_grads(mlp, x, mlp)
    y1, g1 = _mlp_grads(mlp, x, lambda t: tiled_mlp_forward(mlp, t, tile))
    assert rel_err(y1, y0) < 1e-6
    assert len(g0) == len(g1) == (1 + (6 if lora else 3))
    for a, b in zip(g1, g0):
        assert rel_err(a, b) < 1e-5


def test_tiled_mlp_saves_only_its_input():
    model = _model("qwen3", lora=True)
    mlp = decoder_layers(model)[0].mlp
    x = torch.randn(1, 40, model.config.hidden_size, requires_grad=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tiled_mlp_forward(mlp, x * 1.0, 8)
    assert len(saved) == 1 and saved[0].shape == x.shape
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x * 1.0)
    assert sum(t.numel() for t in saved) > 5 * x.numel()  # untiled: gate, up, act, LoRA copies...


def test_tiled_mlp_replays_dropout_masks():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_model_config("qwen3", vocab_size=320))
    model = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.5, target_modules=["gate_proj", "up_proj", "down_proj"],
                                            init_lora_weights=False)).train()
    mlp = decoder_layers(model)[0].mlp
    x = torch.randn(1, 30, model.config.hidden_size)

    def per_tile(t):  # what the tiled function must equal: the same tiles, the same RNG stream
        return torch.cat([mlp(t[:, a:b]) for a, b in tile_bounds(t.shape[1], 10)], dim=1)

    torch.manual_seed(123)
    y0, g0 = _mlp_grads(mlp, x, per_tile)
    torch.manual_seed(123)
    y1, g1 = _mlp_grads(mlp, x, lambda t: tiled_mlp_forward(mlp, t, 10))
    assert rel_err(y1, y0) < 1e-6
    for a, b in zip(g1, g0):
        assert rel_err(a, b) < 1e-5


def test_enable_tiled_mlp_on_model_with_projections():
    model = _model("gemma2", lora=True)
    ids = torch.randint(0, 320, (1, 40))
    ref = _step(model, ids)
    enable_tiled_mlp(model, tile_tokens=9, projections=True)
    layer = decoder_layers(model)[0]
    assert "forward" in layer.mlp.__dict__ and "forward" in layer.self_attn.q_proj.__dict__
    _assert_same(ref, _step(model, ids), tol=1e-5)
    with torch.no_grad():  # inference path: plain tiles, no autograd function
        out = model(input_ids=ids).logits
    disable_tiled_mlp(model)
    with torch.no_grad():
        assert rel_err(out, model(input_ids=ids).logits) < 1e-5
    assert not is_tiled(model)


def test_tiled_apply_rejects_bad_tile():
    with pytest.raises(ValueError):
        tiled_apply(lambda t: t, torch.zeros(1, 2, 3), 0)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_derived_layer_inputs_equal_no_checkpointing(family, lora, device):
    """A host budget for only some of the offloaded inputs: every second layer's input is derived
    (stored nowhere, recomputed from the layer before in backward). Loss and every gradient equal
    the step without checkpointing, LoRA dropout masks included (the replayed RNG state), and the
    layers before the derived ones run once more. On CUDA: pinned pages, side-stream copies."""
    torch.manual_seed(0)
    cfg = tiny_model_config(family, vocab_size=320, attn_implementation="eager", num_hidden_layers=6)
    model = AutoModelForCausalLM.from_config(cfg).to(device).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.2,
                                                 init_lora_weights=False))
    ids = torch.randint(0, 320, (2, STEPS_TOKENS), device=device)
    torch.manual_seed(1)
    ref = _step(model, ids)
    layer_bytes = ids.numel() * cfg.hidden_size * 4
    page = 4096
    per_layer_host = -(-layer_bytes // page) * page
    # GPU: none; host: 4 of the 6 inputs -> layers 1 and 3 derived, 0 2 4 5 offloaded
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, host_budget_bytes=4 * per_layer_host, page_bytes=page)
    torch.manual_seed(1)
    got = _step(model, ids)
    stats = offload_stats(model)
    assert stats["derived"] == (1, 3) and stats["offload"] == (0, 2, 4, 5) and stats["keep"] == ()
    assert stats["derived_recomputed"] == 2
    _assert_same(ref, got, tol=1e-5 if lora or device == "cuda" else 1e-6)
    # negative control: a different dropout draw changes the gradients (so the check above can fail)
    if lora:
        torch.manual_seed(2)
        other = _step(model, ids)
        assert max(rel_err(other[1][k], ref[1][k]) for k in ref[1]) > 1e-3


def test_derived_input_needs_its_graph_for_a_second_backward():
    model = _model("qwen3", lora=False)
    ids = torch.randint(0, 320, (1, 20))
    layer_bytes = ids.numel() * model.config.hidden_size * 4
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, host_budget_bytes=layer_bytes, page_bytes=256)
    loss = model(input_ids=ids, labels=ids).loss
    assert offload_stats(model)["derived"] == (1,)
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss.backward()  # the handles live as long as the graph: the derived input is recomputed again
    for n, p in model.named_parameters():
        assert rel_err(p.grad, first[n]) < 1e-6, n


@pytest.mark.parametrize("family,skips", [("qwen3", True), ("gemma2", False)])
def test_recompute_skips_the_tiled_mlp_output_only_where_nothing_reads_it(family, skips, device):
    """In the recompute of an offloaded layer whose MLP output only feeds the residual add (Qwen3),
    the tiled MLP saves its input and computes nothing: each tile's gate projection runs twice a
    step (forward, backward) instead of three times. Gemma 2 normalises the MLP output (a saved
    tensor), so there it runs in full. Gradients equal the untiled step without checkpointing."""
    model = _model(family, lora=True, seed=3).to(device)
    ids = torch.randint(0, 320, (1, 60), device=device)
    ref = _step(model, ids)
    enable_tiled_mlp(model, tile_tokens=16)  # 60 tokens: 4 tiles
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    calls = [0]
    gate = decoder_layers(model)[0].mlp.gate_proj
    hook = gate.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    got = _step(model, ids)
    hook.remove()
    assert calls[0] == (8 if skips else 12)
    _assert_same(ref, got, tol=1e-5)
    disable_tiled_mlp(model)
    disable_offloaded_checkpointing(model)


def test_lora_inputs_left_in_the_autocast_dtype_change_no_number():
    """bf16 weights, float32 LoRA adapters, bf16 autocast, offloaded checkpointing and tiled MLP
    (every recompute path): with PEFT's input casts switched off the loss and every gradient are
    the same as with them. Without autocast the switch is not allowed, and the mismatch shows
    (so the switch really reaches the layers)."""
    import argparse

    from peft import LoraConfig, get_peft_model

    from swiftune.training.lora_casting import can_skip_lora_input_casts, lora_input_casting

    torch.manual_seed(0)
    cfg = tiny_model_config("qwen3", vocab_size=320, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    enable_tiled_mlp(model, tile_tokens=16, projections=True)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    ids = torch.randint(0, 320, (1, 60))
    results = {}
    for cast in (True, False):
        with lora_input_casting(model, enabled=cast), torch.autocast("cpu", dtype=torch.bfloat16):
            results[cast] = _step(model, ids)
    (l0, g0), (l1, g1) = results[True], results[False]
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))
    with lora_input_casting(model, enabled=False), pytest.raises(RuntimeError):
        _step(model, ids)  # bf16 inputs into float32 adapters with no autocast
    args = argparse.Namespace(bf16=True, fp16=False)
    assert can_skip_lora_input_casts(model, args)
    assert not can_skip_lora_input_casts(model, argparse.Namespace(bf16=False, fp16=False))
    assert not can_skip_lora_input_casts(_model("qwen3", lora=False), args)
    model.peft_config["default"].use_dora = True
    assert not can_skip_lora_input_casts(model, args)


def test_recompute_skip_keeps_lora_dropout_masks(monkeypatch):
    """With LoRA dropout, the skipped recompute leaves the RNG where the tiles' backward expects it:
    the same gradients as the full recompute (the skip switched off), same seed."""
    import swiftune.training.checkpointing as ckpt
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = tiny_model_config("qwen3", vocab_size=320, attn_implementation="eager")
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg).train(),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.3,
                                      init_lora_weights=False))
    enable_tiled_mlp(model, tile_tokens=16)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    ids = torch.randint(0, 320, (1, 60))
    torch.manual_seed(5)
    skipped = _step(model, ids)
    monkeypatch.setattr(ckpt, "MLP_OUTPUT_FEEDS_ONLY_THE_RESIDUAL", frozenset())
    torch.manual_seed(5)
    full = _step(model, ids)
    _assert_same(full, skipped, tol=1e-6)
    torch.manual_seed(6)  # negative control: another dropout draw
    other = _step(model, ids)
    assert max(rel_err(other[1][k], full[1][k]) for k in full[1]) > 1e-3


def test_patching_after_tiling_keeps_the_tiling_with_the_fused_forward_underneath():
    """The trainers patch a model they are given unpatched, after FastModel.get_peft_model tiled its
    MLPs: the patch goes underneath the tiling (each tile runs the fused MLP); unpatching leaves the
    tiles on the class forward. Saved tensors say which forward runs: the tiled MLP saves only its
    input; gradients equal the untiled, unpatched model's."""
    import swiftune
    from swiftune.models.forwards import fused_mlp_forward

    model = _model("qwen3", lora=True, seed=2)
    ids = torch.randint(0, 320, (1, 48))
    ref = _step(model, ids)
    enable_tiled_mlp(model, tile_tokens=16, projections=True)
    swiftune.patch_model(model, attention="reference", kernel_backend="reference")
    mlp = decoder_layers(model)[0].mlp
    untiled = mlp.__dict__["_swiftune_untiled_forward"]
    assert mlp.forward.__func__.__name__ == "_tiled_forward" and untiled.__func__ is fused_mlp_forward
    x = torch.randn(1, 48, model.config.hidden_size, requires_grad=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mlp(x * 1.0)
    assert [t.shape for t in saved if t.data_ptr() not in params] == [x.shape]
    _assert_same(ref, _step(model, ids), tol=1e-5)
    swiftune.unpatch_model(model)
    assert is_tiled(model) and mlp.__dict__["_swiftune_untiled_forward"] is None
    _assert_same(ref, _step(model, ids), tol=1e-5)
    disable_tiled_mlp(model)
    assert "forward" not in mlp.__dict__
    _assert_same(ref, _step(model, ids), tol=1e-5)


def test_sft_trainer_keeps_the_tiling_of_an_offloaded_peft_model(tmp_path):
    import swiftune
    from swiftune.data import FormattingStats, TokenizedDataset
    from swiftune.data import build_tokenizer
    from swiftune.models.forwards import fused_mlp_forward

    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3", vocab_size=320))
    model = swiftune.FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing="offload",
                                              offload_gpu_budget_bytes=0)
    rows = [{"input_ids": list(range(1, 40)), "completion_mask": None}] * 4
    trainer = swiftune.SFTTrainer(
        model=model, args=swiftune.SFTConfig(output_dir=str(tmp_path), max_length=64, report_to=[],
                                             max_steps=1, gradient_checkpointing=False),
        train_dataset=TokenizedDataset(rows, FormattingStats(data_shape="pretokenized")),
        processing_class=build_tokenizer())
    mlp = decoder_layers(trainer.model)[0].mlp
    assert mlp.forward.__func__.__name__ == "_tiled_forward"
    assert mlp.__dict__["_swiftune_untiled_forward"].__func__ is fused_mlp_forward


def test_get_peft_model_offload_without_tiles_equals_peft():
    """``get_peft_model(use_gradient_checkpointing="offload", tiled_mlp=False)``: every layer input on the host and
    the MLP untiled, with the loss and every adapter's gradient equal to PEFT's own LoRA model (no checkpointing)
    on the same weights; the default tiles, ``True`` tiles plain checkpointing, anything else is refused."""
    import copy

    import peft
    import swiftune

    base = AutoModelForCausalLM.from_config(tiny_model_config("qwen3", vocab_size=320, attn_implementation="eager"))
    torch.manual_seed(3407)  # get_peft_model's random_state: the same adapters on both sides
    ref_model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                         init_lora_weights=False))
    model = swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=4, lora_alpha=8, init_lora_weights=False,
                                              use_gradient_checkpointing="offload", offload_gpu_budget_bytes=0,
                                              tiled_mlp=False)
    assert not is_tiled(model, projections=True)
    ids = torch.randint(0, 320, (2, 24))
    ref, got = _step(ref_model.train(), ids), _step(model.train(), ids)
    assert offload_stats(model)["offload"] == tuple(range(model.config.num_hidden_layers))
    assert all(k.count("lora_") for k in ref[1]) and all(ref[1][k].abs().sum() > 0 for k in ref[1])
    _assert_same(ref, got, tol=1e-5)
    assert is_tiled(swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=4, use_gradient_checkpointing="offload"))
    assert is_tiled(swiftune.FastModel.get_peft_model(copy.deepcopy(base), r=4, tiled_mlp=True))
    bad = copy.deepcopy(base)
    with pytest.raises(ValueError, match="tiled_mlp must be True, False or None"):
        swiftune.FastModel.get_peft_model(bad, r=4, tiled_mlp="no")
    assert not any(hasattr(m, "lora_A") for m in bad.modules())  # refused before PEFT adds adapters in place


@pytest.mark.parametrize("mode,reentrant", [(True, False), ("offload", False), (True, True)],
                         ids=["checkpointing", "offload", "reentrant"])
def test_trainer_checkpointing_removes_the_input_hook_again(mode, reentrant, tmp_path):
    """``SFTConfig(gradient_checkpointing=True)`` makes transformers' Trainer enable its checkpointing again at
    ``train()``, and with it the input embeddings' require-grad hook that FastModel.get_peft_model had removed;
    swiftune's trainer removes it again unless a layer checkpoints with reentrance (which needs it). The step's
    LoRA gradients, taken before the optimizer, equal PEFT's own model run without checkpointing on the same row,
    every one non-zero where the reference's is."""
    import peft
    from transformers import TrainerCallback
    import swiftune
    from swiftune.data import FormattingStats, TokenizedDataset, build_tokenizer

    torch.manual_seed(0)
    cfg = tiny_model_config("qwen3", vocab_size=320, attn_implementation="eager")
    base = AutoModelForCausalLM.from_config(cfg).train()
    reference = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg).train(),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    reference.get_base_model().load_state_dict(base.state_dict(), strict=False)
    model = swiftune.FastModel.get_peft_model(base, r=4, lora_alpha=8, use_gradient_checkpointing=mode,
                                              offload_gpu_budget_bytes=0 if mode == "offload" else None)
    with torch.no_grad():  # non-zero B, so that every A gets a gradient too; the same adapters in both
        for (name, p), (ref_name, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
            assert name == ref_name
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
            ref_p.copy_(p)
    ids = torch.randint(0, 320, (48,))

    class Grads(TrainerCallback):
        grads: dict[str, torch.Tensor] = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            Grads.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    rows = TokenizedDataset([{"input_ids": ids.tolist(), "completion_mask": None}],
                            FormattingStats(data_shape="pretokenized"))
    args = swiftune.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, learning_rate=0.0,
                              max_grad_norm=0.0, save_strategy="no", report_to="none", use_cpu=True,
                              gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                              kernel_backend="reference")  # the hook is the point, not the kernels (interpreted: slow)
    trainer = swiftune.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=build_tokenizer(),
                                  callbacks=[Grads()])
    trainer.train()
    hooks = getattr(model.get_base_model(), "_require_grads_hooks", None) or []
    assert len(hooks) == (1 if reentrant else 0)
    ref_loss = reference(input_ids=ids[None], labels=ids[None]).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert Grads.grads.keys() == ref_grads.keys() and len(ref_grads) == 2 * 7 * cfg.num_hidden_layers
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0 and Grads.grads[name].abs().max() > 0, name
        assert rel_err(Grads.grads[name], ref) < 1e-4, name
