"""Per-document sdpa outputs projected one by one (:mod:`swiftune.attention.pieces`).

The reference is transformers' own model (eager attention) with PEFT's LoRA on all seven projections,
each document (or ``prompt + completion``) alone (tests/test_gradient_parity.py's step). swiftune runs
per-document sdpa with the outputs left apart and ``o_proj`` applied to each; the loss and every
trainable tensor's gradient must equal the reference's, and the forward must save one copy of the
attention output fewer per layer than with the outputs concatenated (the memory the change is for).

On this CPU, ``PIECE_MIN_TOKENS`` is lowered so that the documents of a few tokens count as long."""

from __future__ import annotations

import pytest
import torch

import swiftune.attention.pieces as pieces_module
import swiftune.models.forwards as forwards_module
from swiftune.attention.pieces import DocumentOutputs, document_outputs
from swiftune.models import patch_model
from swiftune.models.tiled_mlp import enable_tiled_mlp
from tests.test_attention_outputs import SHARED_COMPLETIONS, SHARED_PROMPT, completion_logprobs_reference
from tests.test_gradient_parity import (_assert_parity, _examples, _lora_reference, _reference_step,
                                        _swiftune_model, _swiftune_step, _trainable)
from tests.helpers import assert_gradients_match, tiny_model

LAYERS = 2


@pytest.fixture(scope="module")
def qwen3_reference():
    base = tiny_model("qwen3", num_hidden_layers=LAYERS)
    reference = _lora_reference(base).train()
    return base, reference, _reference_step(reference, _examples())


@pytest.fixture
def projected(monkeypatch):
    """Every document counts as long; counts the attention forwards that projected pieces."""
    monkeypatch.setattr(pieces_module, "PIECE_MIN_TOKENS", 1)
    calls = []
    project = forwards_module.project_pieces

    def counting(o_proj, outputs, batch_shape):
        calls.append(len(outputs.pieces))
        return project(o_proj, outputs, batch_shape)

    monkeypatch.setattr(forwards_module, "project_pieces", counting)
    return calls


def _sdpa_model(base, reference, checkpointing: str, tiled_projections: bool = False):
    model = _swiftune_model(base, reference, True, checkpointing, kernel_backend="reference")
    patch_model(model, attention="sdpa", kernel_backend="reference")
    if tiled_projections:  # what GRPO's long rows run: the projections' inputs are the tile functions'
        enable_tiled_mlp(model, tile_tokens=4, projections=True)
    return model


def test_document_outputs_are_kept_apart_only_when_asked_and_long_enough(monkeypatch):
    a, b = torch.randn(5, 2, 3), torch.randn(7, 2, 3)
    assert document_outputs([a], keep_pieces=True) is a
    joined = document_outputs([a, b], keep_pieces=False)
    assert isinstance(joined, torch.Tensor) and torch.equal(joined, torch.cat([a, b]))
    assert isinstance(document_outputs([a, b], keep_pieces=True), torch.Tensor)  # 5 tokens < PIECE_MIN_TOKENS
    monkeypatch.setattr(pieces_module, "PIECE_MIN_TOKENS", 5)
    kept = document_outputs([a, b], keep_pieces=True)
    assert isinstance(kept, DocumentOutputs) and kept.pieces[0] is a and torch.equal(kept.cat(), joined)


@pytest.mark.parametrize("checkpointing,tiled", [("off", False), ("on", True), ("offload", False)],
                         ids=["no-checkpointing", "checkpointing-tiled-projections", "offload"])
def test_projected_pieces_give_the_unpatched_models_loss_and_gradients(qwen3_reference, projected, checkpointing,
                                                                      tiled):
    base, reference, expected = qwen3_reference
    model = _sdpa_model(base, reference, checkpointing, tiled)
    got = _swiftune_step(model, _examples(), "padding_free")
    _assert_parity(expected, got, _trainable(reference))
    assert set(got[1]) == set(_trainable(reference)), "every adapter gets a gradient"
    # every layer's forward (and its recompute when checkpointed) projected the five documents apart
    assert projected and set(projected) == {len(_examples())}
    assert len(projected) == LAYERS * (1 if checkpointing == "off" else 2), projected


def test_padded_batches_keep_the_concatenated_output(qwen3_reference, projected):
    """A padded batch's outputs are scattered back to ``[B, S]``: no pieces, the reference's gradients."""
    base, reference, expected = qwen3_reference
    model = _sdpa_model(base, reference, "off")
    _assert_parity(expected, _swiftune_step(model, _examples(), "padded"), _trainable(reference))
    assert projected == []


def test_shared_prompt_rows_project_each_sequence_and_give_the_unpatched_models_gradients(qwen3_reference, projected):
    """GRPO's shared-prompt row (one prompt, two completions, each ``prompt + completion`` through sdpa,
    the later one keeping only its own outputs), recomputed: the summed completion log-probs and every
    adapter's gradient equal transformers' own model + PEFT on each ``prompt + completion`` alone."""
    from swiftune.rl import build_policy_row, completion_logprobs

    base, reference, _ = qwen3_reference
    prompt, completions = SHARED_PROMPT, SHARED_COMPLETIONS
    want, ref_grads = completion_logprobs_reference(reference, prompt, completions)

    model = _sdpa_model(base, reference, "on", tiled_projections=True)
    row = build_policy_row([prompt, prompt], completions, share_prompt=True, attention_backend="sdpa")
    model.zero_grad(set_to_none=True)
    logps, _ = completion_logprobs(model, row, kernel_backend="reference")
    logps.sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(float(logps.sum()) - float(want)) < 1e-5 * max(1.0, abs(float(want)))
    assert_gradients_match(ref_grads, got, _trainable(reference), 1e-5)
    assert projected == [2] * (2 * LAYERS), projected  # prompt + first completion, the second: forward + recompute


def _saved_storage_bytes(model, examples) -> int:
    """Bytes of the distinct storages the forward saves for backward (weights included)."""
    from swiftune.data import make_collator

    batch = make_collator("padding_free", max_length=64, pad_token_id=0)(examples)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    device = next(model.parameters()).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device), use_cache=False)
    return sum(storages.values())


def _assert_one_output_fewer(model, monkeypatch, dtype_bytes: int) -> None:
    examples = _examples()
    tokens = sum(len(e["input_ids"]) for e in examples)
    attention = model.get_base_model().model.layers[0].self_attn
    q_dim = attention.config.num_attention_heads * attention.head_dim
    joined = _saved_storage_bytes(model, examples)
    monkeypatch.setattr(pieces_module, "PIECE_MIN_TOKENS", 1)
    apart = _saved_storage_bytes(model, examples)
    assert joined - apart == LAYERS * tokens * q_dim * dtype_bytes, (joined, apart)


def test_projected_pieces_save_one_attention_output_fewer_per_layer(qwen3_reference, monkeypatch):
    """Without checkpointing, every layer's forward saves sdpa's outputs; concatenated for ``o_proj``
    (whose LoRA adapter saves its input) they are saved a second time. Projected piece by piece, the
    adapter saves views of sdpa's own outputs: exactly ``T x q_dim`` float32 values fewer per layer.
    (CPU sdpa lays its output out ``[L, H, D]`` in memory, as the CUDA kernels do: the flattening is a view.)"""
    base, reference, _ = qwen3_reference
    _assert_one_output_fewer(_sdpa_model(base, reference, "off"), monkeypatch, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_gpu_bf16_projected_pieces_save_one_attention_output_fewer_per_layer(qwen3_reference, monkeypatch):
    """The same in bf16 on the GPU's fused sdpa kernels, and their premise at a Qwen3-8B layer's shape
    (32 query heads, 8 K/V heads, head_dim 128, GQA in the kernel): a document's output ``[L, H, D]`` is
    contiguous, so ``o_proj``'s input is a view of what sdpa saved. The memory planner drops its
    ``attention_out_copy`` term for long documents only on this evidence."""
    from swiftune.attention.backends import dense_causal_attention

    q = torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = dense_causal_attention(q, k, v, scale=128**-0.5)
    assert out.is_contiguous() and out.reshape(4096, -1).data_ptr() == out.data_ptr()
    base, reference, _ = qwen3_reference
    model = _sdpa_model(base, reference, "off").cuda().to(torch.bfloat16)
    _assert_one_output_fewer(model, monkeypatch, 2)


def test_row_pieces_of_disjoint_ranges_give_plain_slicings_gradient():
    """``row_pieces`` over ranges that do not overlap (the documents of a packed row), out of order, with
    rows no range covers and a piece that takes no part: the gradient equals plain slicing's (float64),
    zero exactly on the rows no used piece covers, and the pieces are views of the row."""
    from swiftune.attention.pieces import row_pieces

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ranges = [(9, 14), (1, 4), (4, 9), (16, 19)]  # rows 0, 14-15 and 19 in no range
    weights = [torch.randn(b - a, 3, 4, generator=g, dtype=torch.float64) for a, b in ranges]
    pieces = row_pieces(x, ranges)
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)
    used = [0, 1, 3]  # (4, 9) takes no part
    got = torch.autograd.grad(sum((pieces[i] * weights[i]).sum() for i in used), x)[0]
    want = torch.autograd.grad(sum((x[ranges[i][0]:ranges[i][1]] * weights[i]).sum() for i in used), x)[0]
    assert torch.equal(got, want)
    covered = torch.zeros(20, dtype=torch.bool)
    for i in used:
        covered[ranges[i][0]:ranges[i][1]] = True
    assert got[~covered].abs().sum() == 0 and (got[covered].abs().sum(dim=(1, 2)) > 0).all()
