"""The trainers' per-step walks over kept lists (training.model_walks) do what torch's and
transformers' own walks do: the same parameters and modes, the same clipped gradients, the same
trained weights as transformers' Trainer methods, and they follow new adapters and requires_grad."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from tests.helpers import builtin_qwen3

peft = pytest.importorskip("peft")


def _tiny_peft_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(Qwen3ForCausalLM(config), lora)


def _ids(tensors) -> list[int]:
    return [id(t) for t in tensors]


def test_index_follows_adapters_and_requires_grad():
    from swiftune.training.model_walks import ModelWalkIndex

    model = _tiny_peft_model()
    index = ModelWalkIndex()
    assert _ids(index.parameters(model)) == _ids(model.parameters())
    assert _ids(index.modules(model)) == _ids(model.modules())
    assert _ids(index.trainable(model)) == _ids(p for p in model.parameters() if p.requires_grad)
    assert index.parameters(model) is index.parameters(model)  # kept, not walked again
    # requires_grad changed: followed at once
    first_lora = next(p for n, p in model.named_parameters() if "lora_A" in n)
    first_lora.requires_grad_(False)
    model.base_model.model.lm_head.weight.requires_grad_(True)
    assert _ids(index.trainable(model)) == _ids(p for p in model.parameters() if p.requires_grad)
    # a new adapter on more modules: its parameters and modules are found (the adapter names changed)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "o_proj"]))
    model.set_adapter("second")
    assert _ids(index.parameters(model)) == _ids(model.parameters())
    assert _ids(index.modules(model)) == _ids(model.modules())
    assert _ids(index.trainable(model)) == _ids(p for p in model.parameters() if p.requires_grad)
    assert any("second" in n for n, p in model.named_parameters() if p.requires_grad)


def test_listed_train_and_zero_grad_match_torch():
    from swiftune.training.model_walks import ModelWalkIndex, listed_module_walks

    model = _tiny_peft_model()
    index = ModelWalkIndex()
    with listed_module_walks(model, index):
        assert "train" in model.__dict__ and "zero_grad" in model.__dict__
        model.eval()
        assert not any(m.training for m in model.modules())
        model.train()
        assert all(m.training for m in model.modules())
        # one submodule switched by hand: the next train() must still reach it
        model.base_model.model.model.layers[1].self_attn.eval()
        model.train()
        assert all(m.training for m in model.modules())
        with pytest.raises(ValueError):
            model.train("yes")  # nn.Module's own error for a non-bool mode
        # gradients on trainable and frozen parameters: all set to None, as nn.Module.zero_grad does
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model.zero_grad(set_to_none=False)  # nn.Module's own in-place zeroing
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert "train" not in model.__dict__ and "zero_grad" not in model.__dict__


class _SeesListedWalks(TrainerCallback):
    def __init__(self):
        self.seen: list[bool] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append("zero_grad" in model.__dict__ and "train" in model.__dict__)


def _train_two_clipped_steps(trainer_class, tmp_path):
    import swiftune
    from swiftune.data import build_tokenizer

    model = builtin_qwen3(lora=True)
    rows = [{"prompt": f"Reverse: {w}\n", "completion": w[::-1]} for w in ("abc", "garden", "river", "stone")]
    args = swiftune.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                              logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                              max_grad_norm=1e-3,  # small: the gradients are clipped on both steps
                              kernel_backend="reference")  # the walks are the subject; the kernels have their own tests
    trainer = trainer_class(model=model, args=args, train_dataset=rows, processing_class=build_tokenizer())
    seen = _SeesListedWalks()
    trainer.add_callback(seen)
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logs, weights, seen.seen, model


def test_sft_steps_equal_transformers_own_walks(tmp_path):
    import swiftune
    from swiftune.training.safety import RunSafetyMixin

    class TransformersWalks(swiftune.SFTTrainer):
        """The reference: transformers' Trainer clipping over model.parameters(), nn.Module's train()
        and zero_grad() walks (the listed walks not installed)."""

        _clip_grad_norm = Trainer._clip_grad_norm

        def train(self, *args, **kwargs):
            return RunSafetyMixin.train(self, *args, **kwargs)

    ref_logs, ref_weights, ref_seen, _ = _train_two_clipped_steps(TransformersWalks, tmp_path / "ref")
    logs, weights, seen, model = _train_two_clipped_steps(swiftune.SFTTrainer, tmp_path / "listed")
    assert ref_seen == [False, False] and seen == [True, True]  # the listed walks ran, the reference's did not
    assert "train" not in model.__dict__ and "zero_grad" not in model.__dict__  # removed after train()
    assert len(logs) == 2 and all(g > 1e-3 for _, g in ref_logs)  # clipping was active
    assert logs == ref_logs
    assert weights.keys() == ref_weights.keys() and weights
    for name, ref in ref_weights.items():
        assert torch.equal(weights[name], ref), name
    # the adapters moved from their start (a step that changed nothing would pass the equalities above)
    start = {n: p for n, p in builtin_qwen3(lora=True).named_parameters() if p.requires_grad}
    assert all(not torch.equal(start[n], w) for n, w in weights.items() if "lora_A" in n)


def _plain_pending_grad_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)


def test_offload_reserve_follows_grads_adapters_and_requires_grad():
    from swiftune.memory import step_reserve
    from swiftune.training.checkpointing import _setup_of, enable_offloaded_checkpointing

    model = _tiny_peft_model()
    enable_offloaded_checkpointing(model, host_budget_bytes=1 << 20)
    hf = model.get_base_model()
    state = hf._swiftune_offload_state
    x = torch.randn(1, 8, hf.config.hidden_size)
    cpu = x.device

    def check():
        pending = _plain_pending_grad_bytes(hf)
        assert state.pending_grad_bytes(cpu) == pending > 0
        # the budget's reserve: the planner's formula on the walked model's setup and the plain pending bytes
        assert state._reserve(x) == step_reserve(state._shape, 8, _setup_of(hf, x), pending)

    check()
    lora = [p for n, p in hf.named_parameters() if "lora_" in n]
    lora[0].grad = torch.zeros_like(lora[0])  # a gradient allocated: no longer pending
    check()
    lora[1].requires_grad_(False)
    hf.lm_head.weight.requires_grad_(True)
    check()
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    model.set_adapter("second")
    check()
    assert any("second" in n for n, p in hf.named_parameters() if p.requires_grad)
