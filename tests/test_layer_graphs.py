"""Graphed decoder layers (``swiftune.training.layer_graphs``) against the unpatched model.

The reference is transformers' eager model with PEFT's own LoRA, run on each document alone:
loss and every LoRA gradient, non-zero where the reference's is. Off CUDA the graphed path runs its
buffers, token buckets, padding document and autograd node with closures in place of graph replays
(the arithmetic of a replay); the CUDA case captures real graphs and compares in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from swiftune.data import make_collator
from swiftune.models import patch_model
from swiftune.sft.trainer import sft_loss
from swiftune.training import FastModel
from swiftune.training.layer_graphs import (
    doc_slots,
    enable_graphed_layers,
    graphed_layer_stats,
    token_bucket,
)
from tests.helpers import VOCAB, assert_gradients_match, rel_err, tiny_model

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD_ID = VOCAB - 1
TOL = 1e-5


def _examples(lengths=(10, 4, 7, 3, 6), seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (n - prompt)})
    return out


def _lora_reference(base: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(copy.deepcopy(base), config)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _trainable(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _reference_step(model: torch.nn.Module, examples: list[dict]) -> tuple[torch.Tensor, dict]:
    """Unpatched transformers + PEFT, one document at a time: summed next-token CE / trained tokens."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for e in examples:
        ids = torch.tensor(e["input_ids"])
        labels = torch.where(torch.tensor(e["completion_mask"], dtype=torch.bool), ids, torch.full_like(ids, -100))
        count += int((labels[1:] != -100).sum())
        logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0].float()
        total = total + torch.nn.functional.cross_entropy(logits[:-1].double(), labels[1:].to(device),
                                                          ignore_index=-100, reduction="sum")
    loss = total / count
    loss.backward()
    return loss.detach(), _grads(model)


def _swiftune_step(model: torch.nn.Module, examples: list[dict], layout: str = "padding_free",
                   zero_grad: bool = True) -> tuple[torch.Tensor, dict]:
    batch = make_collator(layout, max_length=64, pad_token_id=PAD_ID)(examples)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    if zero_grad:
        model.zero_grad(set_to_none=True)
    loss, _ = sft_loss(model, inputs, batch["labels"].to(device), num_items_in_batch=batch["num_trained_tokens"])
    loss.backward()
    return loss.detach(), _grads(model)


def _graphed_model(base: torch.nn.Module, reference: torch.nn.Module, kernel_backend: str = "reference",
                   dtype: torch.dtype | None = None, **graph_kwargs) -> torch.nn.Module:
    model = copy.deepcopy(base)
    model = patch_model(model.to(dtype) if dtype is not None else model, kernel_backend=kernel_backend)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=True, init_lora_weights=False)
    model.load_state_dict(reference.state_dict())
    enable_graphed_layers(model, **graph_kwargs)
    return model.train()


def _assert_parity(expected: tuple, got: tuple, trainable: list[str], tol: float = TOL) -> None:
    (ref_loss, ref_grads), (loss, grads) = expected, got
    assert torch.isfinite(loss)
    assert rel_err(loss, ref_loss) < tol, (float(loss), float(ref_loss))
    assert_gradients_match(ref_grads, grads, trainable, tol)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_models(request):
    base = tiny_model(request.param).train()
    reference = _lora_reference(base).train()
    return base, reference


def test_token_buckets_bound_the_padding_and_the_shapes():
    for t in (1, 7, 255, 256, 257, 1000, 4376, 5000, 16384, 16385, 100_000):
        b = token_bucket(t)
        assert t <= b < t + max(256, t / 8)
    assert len({token_bucket(t) for t in range(3000, 6000)}) <= 12  # few distinct shapes over a run's steps
    assert doc_slots(5) == 8 and doc_slots(7) == 8 and doc_slots(8) == 16 and doc_slots(16) == 32
    with pytest.raises(ValueError):
        token_bucket(0)
    # a smaller least step (enable_graphed_layers(min_bucket_tokens=...)) pads less, within the same bound
    for t in (1, 7, 30, 255, 1000):
        b = token_bucket(t, 16)
        assert t <= b < t + max(16, t / 8) and b % 16 == 0
    assert token_bucket(30, 16) == 32 and token_bucket(30) == 256
    for bad in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match="min_bucket_tokens must be a positive int"):
            enable_graphed_layers(torch.nn.Linear(2, 2), min_bucket_tokens=bad)


def test_graphed_layers_equal_the_unpatched_model_per_document(family_models):
    """The padding document, the padded offsets and the node's gradient routing change nothing."""
    base, reference = family_models
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    got = _swiftune_step(model, examples)
    _assert_parity(expected, got, _trainable(reference))
    stats = graphed_layer_stats(model)
    layers = base.config.num_hidden_layers
    assert stats["graphed_forwards"] == 1 and stats["fallback_forwards"] == 0, stats
    assert stats["captures"] == layers and stats["capacity_tokens"] == token_bucket(30)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma"])
def test_graphed_layers_equal_the_unpatched_model_in_the_other_plain_families(family):
    base = tiny_model(family).train()
    reference = _lora_reference(base).train()
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    _assert_parity(expected, _swiftune_step(model, examples), _trainable(reference))
    assert graphed_layer_stats(model)["graphed_forwards"] == 1, graphed_layer_stats(model)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_windowed_or_soft_capped_families_fall_back_and_stay_correct(family):
    base = tiny_model(family, window=True).train()
    reference = _lora_reference(base).train()
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    _assert_parity(expected, _swiftune_step(model, examples), _trainable(reference))
    stats = graphed_layer_stats(model)
    assert stats["graphed_forwards"] == 0 and "sliding window or soft-capped" in stats["last_fallback"], stats


def test_steps_reuse_graphs_across_token_counts_and_optimizer_updates(family_models):
    base, reference = family_models
    model = _graphed_model(base, reference)
    ref = copy.deepcopy(reference)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_params = dict(ref.named_parameters())
    for step, lengths in enumerate([(10, 4, 7, 3, 6), (9, 9, 2), (3, 3, 2, 4, 2, 3, 2, 5, 3)]):
        examples = _examples(lengths, seed=step)
        expected = _reference_step(ref, examples)
        _assert_parity(expected, _swiftune_step(model, examples), _trainable(ref))
        opt.step()  # in place: the captured parameter addresses stay valid
        with torch.no_grad():  # the reference gets the same updated adapters
            for name, p in model.named_parameters():
                if p.requires_grad:
                    ref_params[name].copy_(p)
    stats = graphed_layer_stats(model)
    # 30, 20 and 27 tokens share one bucket (256); 5 and 3 documents share 8 slots, 9 take 16
    assert stats["graphed_forwards"] == 3 and stats["fallback_forwards"] == 0
    assert stats["captures"] == 2 * base.config.num_hidden_layers, stats
    # two graph sets per layer, one set of static gradient buffers for all layers (of one shape): one layer's
    # trainable parameters once
    layers = model.get_base_model().model.layers
    trainable = sum(p.numel() * p.element_size() for p in layers[0].parameters() if p.requires_grad)
    assert len(layers) > 1 and stats["gradient_buffer_bytes"] == trainable > 0


def test_gradients_accumulate_into_grad_and_do_not_alias_the_static_buffers(family_models):
    base, reference = family_models
    examples = _examples()
    expected_loss, expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    _swiftune_step(model, examples)
    _, grads = _swiftune_step(model, examples, zero_grad=False)  # two backward passes: twice the gradient
    doubled = {n: 2 * g for n, g in expected.items()}
    assert_gradients_match(doubled, grads, _trainable(reference), TOL)


def test_a_second_forward_before_backward_raises_instead_of_wrong_gradients(family_models):
    base, reference = family_models
    model = _graphed_model(base, reference)
    batch = make_collator("padding_free", max_length=64, pad_token_id=PAD_ID)(_examples())
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
    first = model(**inputs).logits.float().sum()
    model(**inputs)  # overwrites the layer inputs the first backward would recompute from
    with pytest.raises(RuntimeError, match="another forward with grad ran between"):
        first.backward()


def test_padded_batches_fall_back_to_checkpointing_and_stay_correct(family_models):
    base, reference = family_models
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    _assert_parity(expected, _swiftune_step(model, examples, layout="padded"), _trainable(reference))
    stats = graphed_layer_stats(model)
    assert stats["graphed_forwards"] == 0 and stats["fallback_forwards"] >= 1
    assert "padding-free" in stats["last_fallback"] or "padding mask" in stats["last_fallback"]


def test_a_deep_copy_of_a_graphed_model_trains_ungraphed_and_correctly(family_models):
    base, reference = family_models
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    _swiftune_step(model, examples)
    clone = copy.deepcopy(model)  # e.g. a frozen reference copy: graphs are not copied
    assert graphed_layer_stats(clone) == {}
    _assert_parity(expected, _swiftune_step(clone, examples), _trainable(reference))
    assert graphed_layer_stats(model)["graphed_forwards"] == 1  # the copy never used the original's graphs


def test_full_finetuning_is_not_graphed():
    base = tiny_model("qwen3").train()
    model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    model = FastModel.for_training(model, use_gradient_checkpointing=True)
    enable_graphed_layers(model)
    expected = _reference_step(copy.deepcopy(base).train(), _examples())
    _assert_parity(expected, _swiftune_step(model.train(), _examples()), _trainable(base))
    assert "trainable base parameter" in graphed_layer_stats(model)["last_fallback"]


def test_negative_control_merged_documents_are_caught(family_models, monkeypatch):
    """The parity check fails when the graphs' offsets let two documents see each other."""
    from swiftune.training import layer_graphs

    base, reference = family_models
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference)
    original = layer_graphs.GraphedStack._fill_step_buffers

    def merge_padding(self, x, cos_sin, packed):
        original(self, x, cos_sin, packed)
        offsets = self.offsets[self.step.slots]
        offsets[1] = offsets[0]  # the first document empty, the second one both

    monkeypatch.setattr(layer_graphs.GraphedStack, "_fill_step_buffers", merge_padding)
    with pytest.raises(AssertionError):
        _assert_parity(expected, _swiftune_step(model, examples), _trainable(reference))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_offloaded_inputs_equal_the_unpatched_model_over_steps(family):
    """offload_inputs: six layers through a ring of three device buffers, four inputs kept on the host and
    brought back in backward; three steps (the second a larger bucket: buffers made again), each against
    transformers + PEFT per document after the same optimizer updates, loss and every LoRA gradient."""
    from swiftune.training.layer_graphs import RING_SLOTS

    base = tiny_model(family, num_hidden_layers=6).train()
    reference = _lora_reference(base).train()
    model = _graphed_model(base, reference, min_bucket_tokens=16, offload_inputs=True)
    # (a smaller step than the two-layer test's: with six layers lr=0.5 leaves float32 noise near TOL, graphed or not)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_params = dict(reference.named_parameters())
    for step, lengths in enumerate([(10, 4, 7, 3, 6), (20, 9, 13, 2), (3, 3, 2, 4, 2)]):
        examples = _examples(lengths, seed=step)
        expected = _reference_step(reference, examples)
        _assert_parity(expected, _swiftune_step(model, examples), _trainable(reference))
        opt.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    ref_params[name].copy_(p)
    stats = graphed_layer_stats(model)
    assert stats["graphed_forwards"] == 3 and stats["fallback_forwards"] == 0, stats
    stack = model.get_base_model()._swiftune_graphed_stack
    assert len(stack.acts) == RING_SLOTS and len(stack.host) == 6 - 2
    assert stats["host_input_bytes"] == 4 * stack.capacity * base.config.hidden_size * 4 > 0


def test_negative_control_offloaded_inputs_not_brought_back_are_caught(monkeypatch):
    """The offloaded parity check fails when backward recomputes from whatever the ring slot holds."""
    from swiftune.training import layer_graphs

    base = tiny_model("qwen3", num_hidden_layers=6).train()
    reference = _lora_reference(base).train()
    examples = _examples()
    expected = _reference_step(reference, examples)
    model = _graphed_model(base, reference, min_bucket_tokens=16, offload_inputs=True)
    monkeypatch.setattr(layer_graphs.GraphedStack, "input_from_host", lambda self, index, bucket: None)
    with pytest.raises(AssertionError):
        _assert_parity(expected, _swiftune_step(model, examples), _trainable(reference))


def test_offloaded_inputs_fall_back_where_hidden_states_are_recorded():
    """Layer outputs are ring slots with offload_inputs: a forward that records them (transformers passes
    output_hidden_states down to the layers) runs the layers as checkpointing does, and its hidden states are
    the unpatched model's."""
    base = tiny_model("qwen3", num_hidden_layers=6).train()
    reference = _lora_reference(base).train()
    model = _graphed_model(base, reference, min_bucket_tokens=16, offload_inputs=True)
    batch = make_collator("padding_free", max_length=64, pad_token_id=PAD_ID)(_examples())
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
    out = model(**inputs, output_hidden_states=True)
    stats = graphed_layer_stats(model)
    assert stats["graphed_forwards"] == 0 and "output_hidden_states" in stats["last_fallback"], stats["last_fallback"]
    with torch.no_grad():  # the reference runs each document alone
        per_doc = [reference(input_ids=torch.tensor([e["input_ids"]]), output_hidden_states=True).hidden_states
                   for e in _examples()]
    want = [torch.cat([states[layer] for states in per_doc], dim=1) for layer in range(7)]
    assert len(out.hidden_states) == 7
    for got, ref in zip(out.hidden_states[1:-1], want[1:-1]):  # the last one is after the final norm
        assert rel_err(got, ref) < 1e-4
    out.logits.float().sum().backward()
    _swiftune_step(model, _examples())  # without recording: graphed again
    assert graphed_layer_stats(model)["graphed_forwards"] == 1


GPU_TOL = 2e-2  # the GPU parity suite's bound (tests/test_gradient_parity.py), with its per-tensor relief


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family,offload_inputs", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_cuda_graphs_bf16_equal_the_unpatched_model_and_the_eager_path(family, offload_inputs):
    """Real captures on the GPU, bf16 under autocast as the trainers run: four steps (the last
    replays the one before's graphs) against the unpatched fp32 model per document, within the GPU parity
    suite's bound (or 3x transformers' own bf16 error on a tensor), and against swiftune's eager path.
    ``offload_inputs``: five layers, three inputs through pinned host memory on the side stream."""
    layers = 5 if offload_inputs else 2
    base = tiny_model(family, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=layers).cuda().train()
    reference = _lora_reference(base).train()
    with torch.no_grad():  # the same bf16-representable weights on every side
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    eager = patch_model(copy.deepcopy(base).to(torch.bfloat16))
    eager = FastModel.get_peft_model(eager, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                     use_gradient_checkpointing=True, init_lora_weights=False)
    eager.load_state_dict(reference.state_dict())
    graphed = copy.deepcopy(eager)
    enable_graphed_layers(graphed, offload_inputs=offload_inputs)
    for step, lengths in enumerate([(40, 17, 33, 9), (25, 60, 11, 200, 30), (40, 17, 33, 9), (40, 17, 33, 9)]):
        examples = _examples(lengths, seed=min(step, 1))
        expected_loss, expected = _reference_step(reference, examples)
        _, plain_bf16 = _reference_step(copy.deepcopy(reference).to(torch.bfloat16), examples)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager_loss, eager_grads = _swiftune_step(eager.train(), examples)
            loss, grads = _swiftune_step(graphed.train(), examples)
        assert torch.isfinite(loss) and rel_err(loss, expected_loss) < GPU_TOL, (float(loss), float(expected_loss))
        allowed = {name: max(GPU_TOL, 3 * rel_err(plain_bf16[name], want)) for name, want in expected.items()}
        assert_gradients_match(expected, grads, _trainable(reference), allowed)
        assert rel_err(loss, eager_loss) < 1e-2
        assert_gradients_match(eager_grads, grads, _trainable(reference), 2e-2)
    stats = graphed_layer_stats(graphed)
    assert stats["graphed_forwards"] == 4 and stats["fallback_forwards"] == 0, stats
    # 99 tokens (bucket 256), then 326 (bucket 512: larger buffers, so the third step captures 256 again);
    # the fourth step replays the third's graphs
    assert stats["captures"] == 3 * base.config.num_hidden_layers, stats
    assert (stats["host_input_bytes"] > 0) == offload_inputs, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_second_forward_before_backward_raises():
    base = tiny_model("qwen3", hidden_size=128, intermediate_size=256, head_dim=32).cuda().train()
    model = _graphed_model(base, _lora_reference(base).train(), kernel_backend="auto", dtype=torch.bfloat16)
    batch = make_collator("padding_free", max_length=64, pad_token_id=PAD_ID)(_examples())
    inputs = {k: v.cuda() for k, v in batch.items() if k in ("input_ids", "position_ids")}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        first = model(**inputs).logits.float().sum()
        model(**inputs)
    assert graphed_layer_stats(model)["graphed_forwards"] == 2
    with pytest.raises(RuntimeError, match="another forward with grad ran between"):
        first.backward()


def test_sft_trainer_with_graphed_layers_trains_like_plain_checkpointing(tmp_path):
    """SFTConfig(cuda_graph_layers=True) through the real trainer: every step graphed, and the same
    per-step losses as plain checkpointing on the same rows (the proof of the arithmetic is the
    per-document parity above; this checks the trainer's wiring)."""
    import swiftune
    from swiftune.data.builtin import build_tokenizer
    from tests.helpers import builtin_qwen3

    tokenizer = build_tokenizer()
    rows = [{"prompt": f"Reverse: {w}\n", "completion": w[::-1]} for w in ("abc", "garden", "river", "stone")] * 2
    losses = {}
    # plain checkpointing, graphed layers, graphed layers with their inputs on the host (activation_offloading)
    for graphs, host in ((False, False), (True, False), (True, True)):
        model = builtin_qwen3(lora=True, num_hidden_layers=4)  # two layer inputs on the host
        args = swiftune.SFTConfig(output_dir=str(tmp_path / f"{graphs}{host}"), max_steps=3,
                                  per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                                  save_strategy="no", report_to="none", use_cpu=True, gradient_checkpointing=True,
                                  cuda_graph_layers=graphs, activation_offloading=host, seed=0,
                                  kernel_backend="reference")
        trainer = swiftune.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        trainer.train()
        losses[graphs, host] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if graphs:
            stats = graphed_layer_stats(trainer.model)
            assert stats["graphed_forwards"] == 3 and stats["fallback_forwards"] == 0, stats
            assert (stats["host_input_bytes"] > 0) == host, stats
    assert len(losses[True, False]) == 3
    for graphed in (losses[True, False], losses[True, True]):
        assert torch.allclose(torch.tensor(graphed), torch.tensor(losses[False, False]), rtol=1e-5, atol=0), losses


def test_config_refuses_graphs_with_padded_rows(tmp_path):
    import swiftune
    from swiftune.errors import ConfigError

    with pytest.raises(ConfigError, match="padding_free=True"):
        swiftune.SFTConfig(output_dir=str(tmp_path), cuda_graph_layers=True, packing=True, max_length=64)
