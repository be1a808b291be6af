"""The fused LoRA linear (one autograd node) against PEFT's own ``lora.Linear``, unfused.

Reference: the same PEFT model with PEFT's forward (a deep copy taken before fusing). Compared:
the output and the gradient of the input and of every trainable tensor, each non-zero where the
reference's is; and the cases PEFT computes differently (active dropout, DoRA, two adapters,
disabled or merged adapters) must run PEFT's forward, not the fused node.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from swiftune.models.lora_linear import LoRALinearFunction, fuse_lora_linears, is_fused_lora, unfuse_lora_linears
from swiftune.models.tiled_mlp import enable_tiled_mlp, has_tiled_forward
from tests.helpers import rel_err

peft = pytest.importorskip("peft")


class TwoLinears(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(12, 20, bias=bias)
        self.down = nn.Linear(20, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _peft_model(dtype: torch.dtype = torch.float32, **lora) -> nn.Module:
    torch.manual_seed(0)
    config = dict(r=4, lora_alpha=8, target_modules=["up", "down"], init_lora_weights=False)
    config.update(lora)
    return peft.get_peft_model(TwoLinears().to(dtype), peft.LoraConfig(**config))


def _run(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = model(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grads = {"input": x.grad, **{n: p.grad for n, p in model.named_parameters() if p.requires_grad}}
    return y.detach(), grads


def _assert_same(reference: tuple, got: tuple, tol: float) -> None:
    (y_ref, g_ref), (y, g) = reference, got
    assert y.dtype == y_ref.dtype and rel_err(y, y_ref) < tol, rel_err(y, y_ref)
    assert g.keys() == g_ref.keys()
    for name, want in g_ref.items():
        if want is None:  # e.g. merged adapters take no gradient
            assert g[name] is None, name
            continue
        assert g[name] is not None and g[name].dtype == want.dtype, name
        assert rel_err(g[name], want) < tol, (name, rel_err(g[name], want))
        assert (want.abs().sum() > 0) <= (g[name].abs().sum() > 0), f"{name}: zero gradient"


def _fused_copy(model: nn.Module) -> nn.Module:
    fused = copy.deepcopy(model)
    assert fuse_lora_linears(fused) == 2
    return fused


def _count_fused_calls(monkeypatch) -> list:
    calls = []
    apply = LoRALinearFunction.apply

    def counting(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(LoRALinearFunction, "apply", counting)
    return calls


def test_fused_lora_equals_peft_fp32(monkeypatch):
    model = _peft_model()
    fused = _fused_copy(model)
    calls = _count_fused_calls(monkeypatch)
    x = torch.randn(3, 5, 12)
    _assert_same(_run(model, x), _run(fused, x), 1e-6)
    assert len(calls) == 2  # both layers ran the fused node


def test_fused_lora_trains_the_base_weight_and_bias_too():
    model = _peft_model()
    for name, p in model.named_parameters():
        if "base_layer" in name:
            p.requires_grad_(True)
    x = torch.randn(7, 12)
    _assert_same(_run(model, x), _run(_fused_copy(model), x), 1e-6)


def test_fused_lora_equals_peft_under_bf16_autocast():
    model = _peft_model()  # float32 base and adapters; autocast computes in bf16 on both sides
    x = torch.randn(2, 9, 12)
    _assert_same(_run(model, x, torch.bfloat16), _run(_fused_copy(model), x, torch.bfloat16), 2e-2)


def test_fused_lora_equals_peft_with_bf16_base_and_float32_adapters(monkeypatch):
    torch.manual_seed(0)
    base = TwoLinears().to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)  # PEFT keeps the adapters in float32
    assert model.base_model.model.up.lora_A["default"].weight.dtype == torch.float32
    fused = _fused_copy(model)
    calls = _count_fused_calls(monkeypatch)
    x = torch.randn(4, 12).to(torch.bfloat16)
    _assert_same(_run(model, x), _run(fused, x), 1e-2)
    assert len(calls) == 2


@pytest.mark.parametrize("case", ["dropout", "dora", "two_adapters", "disabled", "merged", "lora_bias"])
def test_other_lora_setups_run_pefts_own_forward(case, monkeypatch):
    lora = {"dropout": dict(lora_dropout=0.5), "dora": dict(use_dora=True), "lora_bias": dict(lora_bias=True)}
    model = _peft_model(**lora.get(case, {}))
    if case == "two_adapters":
        model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["up", "down"], init_lora_weights=False))
        model.base_model.set_adapter(["default", "second"])
    fused = _fused_copy(model)
    calls = _count_fused_calls(monkeypatch)
    x = torch.randn(6, 12)
    if case == "merged":
        model.merge_adapter()
        fused.merge_adapter()
    if case == "disabled":
        with model.disable_adapter():
            reference = _run(model, x)
        with fused.disable_adapter():
            got = _run(fused, x)
    else:
        torch.manual_seed(3)  # the same dropout masks on both sides
        reference = _run(model, x)
        torch.manual_seed(3)
        got = _run(fused, x)
    _assert_same(reference, got, 1e-6)
    assert calls == []


def test_fused_lora_runs_under_the_projection_tiling():
    from tests.helpers import tiny_model

    base = tiny_model("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    enable_tiled_mlp(model, tile_tokens=3, projections=True)
    fused = copy.deepcopy(model)
    fuse_lora_linears(fused)
    q_proj = fused.base_model.model.model.layers[0].self_attn.q_proj
    assert has_tiled_forward(q_proj) and is_fused_lora(q_proj)
    ids = torch.randint(0, 64, (1, 10))
    losses, grads = [], []
    for m in (model, fused):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert rel_err(losses[1], losses[0]) < 1e-6
    for name, want in grads[0].items():
        assert rel_err(grads[1][name], want) < 1e-5, name


def test_unfuse_restores_pefts_forward():
    model = _peft_model()
    fused = _fused_copy(model)
    unfuse_lora_linears(fused)
    layer = fused.base_model.model.up
    assert not is_fused_lora(layer) and "forward" not in layer.__dict__


def test_patching_fuses_lora_except_on_the_reference_backend():
    import swiftune
    from tests.helpers import tiny_model

    def fused_count(model):
        return sum(is_fused_lora(m) for m in model.modules())

    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    # adapters first, then patch_model (the PEFT model a user built)
    model = swiftune.patch_model(peft.get_peft_model(tiny_model("qwen3"), lora))
    assert fused_count(model) == 4
    assert fused_count(swiftune.patch_model(model, kernel_backend="reference")) == 0
    swiftune.unpatch_model(swiftune.patch_model(model))
    assert fused_count(model) == 0
    # patch_model first, then FastModel's adapters
    patched = swiftune.patch_model(tiny_model("qwen3"))
    model = swiftune.FastModel.get_peft_model(patched, r=4, target_modules=["q_proj", "down_proj"],
                                              use_gradient_checkpointing=False)
    assert fused_count(model) == 4
    # unpatched family / model: PEFT's forwards stay
    plain = swiftune.FastModel.get_peft_model(tiny_model("qwen3"), r=4, target_modules=["q_proj"],
                                              use_gradient_checkpointing=False)
    assert fused_count(plain) == 0
