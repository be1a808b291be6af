"""Attention outputs kept through the recompute (``enable_offloaded_checkpointing(attention_output_layers=n)``).

The reference is transformers' own model (eager attention) with PEFT's LoRA, each document alone
(tests/test_gradient_parity.py's step); swiftune runs per-document sdpa attention with every layer input
offloaded, with and without the kept outputs. The loss and every trainable tensor's gradient must equal the
reference's, and the fused sdpa kernel must run once per document and layer in the forward and, in the
recompute, only in the layers that do not keep their outputs (counted at the dispatcher, under the
checkpoint's own caching)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swiftune.attention.kept_outputs import check_attention_output_layers, sdpa_kernel_ops
from swiftune.memory.planner import attention_output_bytes, plan_memory
from swiftune.training.checkpointing import enable_offloaded_checkpointing, offload_stats
from tests.test_gradient_parity import (GPU_TOL, QWEN3_8B_LAYER, _assert_parity, _examples, _lora_reference,
                                        _reference_step, _swiftune_model, _swiftune_step, _trainable)
from tests.helpers import assert_gradients_match, rel_err, tiny_model


class CountSdpaKernels(TorchDispatchMode):
    """Counts the fused sdpa kernels that really run (a kernel whose output the checkpoint serves from
    its cache never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in sdpa_kernel_ops():
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _counted_step(model) -> tuple:
    """The parity tests' padding-free step on ``model`` and the fused sdpa kernels it ran (skipped where this
    CPU torch runs sdpa's math path, which runs no fused kernel to count)."""
    counter = CountSdpaKernels()
    with counter:
        got = _swiftune_step(model, _examples(), "padding_free")
    if not counter.calls:
        pytest.skip("F.scaled_dot_product_attention ran no fused kernel on this CPU torch (its math path)")
    return got, counter.calls


@pytest.fixture(scope="module")
def qwen3_reference():
    base = tiny_model("qwen3", num_hidden_layers=3)
    reference = _lora_reference(base).train()
    return base, reference, _reference_step(reference, _examples())


def _sdpa_model(base, reference, kept: int, on_host: bool = False):
    # the kernels' plain-PyTorch references (the attention is the subject), per-document sdpa, every input offloaded
    model = _swiftune_model(base, reference, True, "offload", kernel_backend="reference")
    from swiftune.models import patch_model

    patch_model(model, attention="sdpa", kernel_backend="reference")
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, attention_output_layers=kept,
                                   attention_outputs_on_host=on_host)
    return model


@pytest.mark.parametrize("kept,on_host", [(0, False), (2, False), (3, False), (2, True), (3, True)])
def test_kept_attention_outputs_give_the_unpatched_models_gradients_and_skip_the_kernel(qwen3_reference, kept,
                                                                                        on_host):
    """On the device or in host pages (``attention_outputs_on_host``): the loss and every adapter's gradient
    equal the unpatched model's on each document alone, and the recompute runs no kernel in the keeping layers."""
    base, reference, expected = qwen3_reference
    model = _sdpa_model(base, reference, kept, on_host)
    docs, layers = len(_examples()), 3
    got, calls = _counted_step(model)
    _assert_parity(expected, got, _trainable(reference))
    assert set(got[1]) == set(_trainable(reference)), "every adapter gets a gradient"
    # forward: every layer and document; recompute: only the layers that do not keep their outputs
    assert calls == docs * layers + docs * (layers - kept), calls
    stats = offload_stats(model)
    assert stats["attention_output_layers"] == kept
    assert stats["attention_output_layers_on_host"] == (kept if on_host else 0)
    assert stats["offloaded"] > 0  # the layer inputs went to the host as before


def test_attention_output_layers_are_checked_and_budgeted(qwen3_reference):
    base, reference, _ = qwen3_reference
    model = _sdpa_model(base, reference, 0)
    for bad in (-1, 4, 1.5, True, "all"):
        with pytest.raises(ValueError, match="attention_output_layers must be an int from 0"):
            enable_offloaded_checkpointing(model, attention_output_layers=bad)
    assert check_attention_output_layers(3, 3) == 3
    # a bf16 Qwen3-8B layer at 131,584 tokens: 32 heads x (128 x 2 + 4) bytes a token
    assert attention_output_bytes(32, 128, 131_584, 2) == 131_584 * 32 * 260
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, attention_output_layers=2)
    state = model.get_base_model()._swiftune_offload_state
    x = torch.zeros(1, 10, 64)
    assert state.kept_attention_bytes(x) == 2 * attention_output_bytes(4, 16, 10, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert state.kept_attention_bytes(x) == 2 * attention_output_bytes(4, 16, 10, 2)
    assert [state.keeps_attention_output(i) for i in range(3)] == [False, True, True]


SHARED_PROMPT, SHARED_COMPLETIONS = [5, 6, 7], [[8, 9, 10, 11], [12, 13]]


def completion_logprobs_reference(reference, prompt: list[int], completions: list[list[int]]) -> tuple:
    """transformers' own model (+ PEFT) on each ``prompt + completion`` alone: the summed completion
    log-probs (float64) and every parameter's gradient of that sum."""
    reference.zero_grad(set_to_none=True)
    want = 0.0
    for completion in completions:
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(reference(input_ids=ids, use_cache=False).logits[0].double(), -1)
        want = want + logp[len(prompt) - 1:-1].gather(1, ids[0, len(prompt):, None]).sum()
    want.backward()
    return want.detach(), {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("on_host", [False, True])
def test_shared_prompt_rows_keep_their_outputs_and_give_the_unpatched_models_gradients(qwen3_reference, on_host):
    """GRPO's shared-prompt row (one prompt, two completions, each ``prompt + completion`` through sdpa)
    with every layer keeping its outputs: the summed completion log-probs and every adapter's gradient
    equal transformers' own model + PEFT on each ``prompt + completion`` alone; the recompute runs no
    sdpa kernel."""
    from swiftune.rl import build_policy_row, completion_logprobs

    base, reference, _ = qwen3_reference
    prompt, completions = SHARED_PROMPT, SHARED_COMPLETIONS
    want, ref_grads = completion_logprobs_reference(reference, prompt, completions)

    model = _sdpa_model(base, reference, 3, on_host)
    row = build_policy_row([prompt, prompt], completions, share_prompt=True, attention_backend="sdpa")
    assert row.layout.shared and row.layout.sequences is not None
    model.zero_grad(set_to_none=True)
    counter = CountSdpaKernels()
    with counter:
        logps, _ = completion_logprobs(model, row, kernel_backend="reference")
        logps.sum().backward()
    if not counter.calls:
        pytest.skip("F.scaled_dot_product_attention ran no fused kernel on this CPU torch (its math path)")
    assert counter.calls == 3 * len(completions)  # the forward's only: every layer served its recompute
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(float(logps.sum()) - float(want)) < 1e-5 * max(1.0, abs(float(want)))
    assert_gradients_match(ref_grads, got, _trainable(reference), 1e-5)


def test_the_planner_counts_kept_attention_outputs_as_the_runtime_does():
    """plan_memory(attention_output_layers=n): n layers' outputs in the checkpoints, set aside before layer
    inputs are kept on the GPU (fewer kept inputs on a budget), refused without offloading; the GRPO
    benchmark's planner answer shrinks with them."""
    plain = plan_memory("qwen3-8b", 131_584, gradient_checkpointing="offload", gpu_bytes=int(80e9))
    kept = plan_memory("qwen3-8b", 131_584, gradient_checkpointing="offload", gpu_bytes=int(80e9),
                       attention_output_layers=36)
    per_layer = attention_output_bytes(32, 128, 131_584, 2)
    assert kept.checkpoints - kept.kept_layers * 131_584 * 4096 * 2 == 36 * per_layer
    assert kept.kept_layers < plain.kept_layers and kept.total > plain.total - plain.kept_layers * 131_584 * 8192
    with pytest.raises(ValueError, match="needs gradient_checkpointing='offload'"):
        plan_memory("qwen3-8b", 1024, gradient_checkpointing=True, attention_output_layers=1)
    from benchmarks import grpo

    args = grpo.build_parser().parse_args(["--bisect-completion", "--model", "qwen3-8b", "--share-prompt",
                                           "--gpu-budget-gb", "80"])
    before = grpo.planner_max_completion(args, host_bytes=int(100e9))["completion"]
    args.attention_output_layers = 36
    assert grpo.planner_max_completion(args, host_bytes=int(100e9))["completion"] < before


def test_get_peft_model_takes_the_kept_attention_layers_with_offloading_only():
    from swiftune.training import FastModel

    model = FastModel.get_peft_model(tiny_model("qwen3", num_hidden_layers=3), r=4, lora_alpha=8,
                                     use_gradient_checkpointing="offload", offload_attention_output_layers=2)
    assert offload_stats(model)["attention_output_layers"] == 2
    with pytest.raises(ValueError, match="offload_attention_output_layers needs use_gradient_checkpointing='offload'"):
        FastModel.get_peft_model(tiny_model("qwen3"), r=4, use_gradient_checkpointing=True,
                                 offload_attention_output_layers=1)
    with pytest.raises(ValueError, match="attention_output_layers must be an int from 0"):
        FastModel.get_peft_model(tiny_model("qwen3", num_hidden_layers=3), r=4, use_gradient_checkpointing="offload",
                                 offload_attention_output_layers=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_gpu_bf16_kept_outputs_equal_the_recomputed_ones_and_the_unpatched_model():
    """On CUDA in bf16 (cuDNN's or FlashAttention's sdpa kernel), one Qwen3-8B-shaped layer: the step with the
    layer keeping its attention outputs, on the GPU or in pinned host pages (copied on the side stream, in the
    kernel's own strides), gives bit for bit the gradients of the step that recomputes them
    (the forward kernel is deterministic), runs the kernel once a document instead of twice, and both are
    within bf16 tolerance of the unpatched model in fp32 on each document alone."""
    base = tiny_model("qwen3", **QWEN3_8B_LAYER).cuda().train()
    reference = _lora_reference(base)
    with torch.no_grad():  # the same bf16-representable weights on every side
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    expected_loss, expected = _reference_step(reference, _examples())
    _, plain_bf16 = _reference_step(copy.deepcopy(reference).to(torch.bfloat16), _examples())
    runs = {}
    for kept, on_host in ((0, False), (1, False), (1, True)):
        model = _sdpa_model(base.to(torch.bfloat16), reference, kept, on_host)
        model.load_state_dict(reference.state_dict())
        counter = CountSdpaKernels()
        with counter:
            runs[kept, on_host] = _swiftune_step(model, _examples(), "padding_free")
        assert counter.calls == len(_examples()) * (2 - kept), (kept, counter.calls)
        assert offload_stats(model)["attention_output_layers_on_host"] == (1 if on_host else 0)
    recomputed = runs[0, False]
    for kept_run in (runs[1, False], runs[1, True]):  # on the device and through pinned host pages
        assert torch.equal(recomputed[0], kept_run[0])
        assert recomputed[1].keys() == kept_run[1].keys()
        assert all(torch.equal(recomputed[1][n], g) for n, g in kept_run[1].items())
    loss, grads = runs[1, True]
    assert torch.isfinite(loss) and rel_err(loss, expected_loss) < GPU_TOL, (float(loss), float(expected_loss))
    allowed = {name: max(GPU_TOL, 3 * rel_err(plain_bf16[name], want)) for name, want in expected.items()}
    assert_gradients_match(expected, grads, _trainable(reference), allowed)


def test_derived_layer_inputs_rerun_their_attention_apart_from_the_kept_outputs():
    """Host memory for only some offloaded inputs: layers 1 and 3 derive theirs in backward by running the layer
    before once more (no grad) inside their own recompute. That rerun computes its attention itself and does
    not touch the kept outputs of the layer being recomputed: the loss and every gradient still equal the
    unpatched model's, and the kernel runs once a document and layer in the forward plus once a document for
    each of the two reruns."""
    base = tiny_model("qwen3", num_hidden_layers=6)
    reference = _lora_reference(base).train()
    expected = _reference_step(reference, _examples())
    model = _sdpa_model(base, reference, 6)
    tokens = sum(len(e["input_ids"]) for e in _examples())
    page = 4096
    per_layer_host = -(-(tokens * 64 * 4) // page) * page
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, host_budget_bytes=4 * per_layer_host, page_bytes=page,
                                   attention_output_layers=6)
    got, calls = _counted_step(model)
    stats = offload_stats(model)
    assert stats["derived"] == (1, 3) and stats["derived_recomputed"] == 2, stats
    # a derived input is the layer before run a second time (no grad), whose float32 sums a many-core CPU may
    # order otherwise than the first run's: 2.3e-5 on one adapter of the 16-core GPU host, 1e-5 here on 2 cores
    _assert_parity(expected, got, _trainable(reference), tol=5e-5)
    docs = len(_examples())
    assert calls == docs * 6 + docs * 2, calls


@pytest.mark.parametrize("on_host", [False, True])
def test_a_second_backward_through_kept_outputs_raises(qwen3_reference, on_host):
    """Selective checkpointing serves each kept output once: after retain_graph=True a second backward raises
    (as the module says), rather than computing gradients from consumed outputs."""
    from swiftune.data import make_collator
    from swiftune.sft.trainer import sft_loss

    base, reference, _ = qwen3_reference
    model = _sdpa_model(base, reference, 3, on_host)
    batch = make_collator("padding_free", max_length=24, pad_token_id=299)(_examples())
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    loss, _ = sft_loss(model, inputs, batch["labels"], num_items_in_batch=batch["num_trained_tokens"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_host_copies_keep_the_bytes_and_strides_of_a_permuted_tensor():
    """An attention output is often a ``[batch, tokens, heads, dim]`` buffer seen as ``[batch, heads, tokens,
    dim]``: the copy back has the same values and strides (the backward kernel reads that layout), and a
    tensor with gaps comes back dense with the same values."""
    from swiftune.memory.planner import pinned_slot_bytes
    from swiftune.training.offload_memory import HostCopy, PagePool

    pool = PagePool(pin=False)
    permuted = torch.randn(2, 7, 3, 5).permute(0, 2, 1, 3)
    for t in (permuted, permuted[:, :, 1:], torch.randn(3, 4)[:, ::2]):  # dense, then two with gaps
        copy_ = HostCopy(pool, t, 64, None)  # whole pages of 64 bytes, or one of a power of two below it
        assert pool.in_use_bytes == pinned_slot_bytes(t.numel() * 4, 64)
        assert pool.in_use_bytes == (-(-t.numel() * 4 // 64) * 64 if t.numel() * 4 > 64 else 32)
        back, event = copy_.restore(None)
        assert event is None and torch.equal(back, t)
        dense = t.permute(*sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)).is_contiguous()
        assert back.stride() == (t.stride() if dense else t.contiguous().stride())
        del copy_
        assert pool.in_use_bytes == 0  # the pages go back to the pool with the copy


def test_the_page_pool_unpins_only_what_a_new_page_size_needs():
    """A step takes pages of several sizes (layer inputs, attention outputs, log-sum-exps). When one size runs
    short, idle pages of other sizes are unpinned only as many bytes as the new pages take, smallest first:
    the idle pages the next requests of their own size want stay pinned."""
    from swiftune.training.offload_memory import PagePool

    pool = PagePool(pin=False)
    big, small = pool.acquire(4, 4096), pool.acquire(2, 512)
    pool.release(big, 4096)
    pool.release(small, 512)
    assert pool.held_bytes == 4 * 4096 + 2 * 512 and pool.in_use_bytes == 0
    pages = pool.acquire(1, 1024)  # a new size: the two idle 512-byte pages make room, the 4 KiB ones stay
    assert pool.held_bytes == 4 * 4096 + 1024 and pool.free_bytes == 4 * 4096
    assert len(pool.acquire(4, 4096)) == 4 and pool.held_bytes == 4 * 4096 + 1024  # served without pinning
    pool.release(pages, 1024)
    pool.acquire(3, 2048)  # 6 KiB of new pages: the idle 1 KiB page and none of the (in-use) 4 KiB ones
    assert pool.held_bytes == 4 * 4096 + 3 * 2048
    pool.clear()
    assert pool.held_bytes == pool.in_use_bytes == 4 * 4096 + 3 * 2048


def test_host_room_decides_how_many_layers_keep_their_outputs_on_the_host(qwen3_reference, caplog):
    """The host budget holds the offloaded layer inputs first; the attention outputs of the last layers take
    what is left, a layer at a time (the planner's rule), and the others recompute their attention: with room
    for one layer's outputs, only the last layer's recompute skips the kernel, and the gradients still equal
    the unpatched model's."""
    from swiftune.memory.planner import attention_layers_on_host, attention_output_host_bytes, pinned_slot_bytes

    base, reference, expected = qwen3_reference
    model = _sdpa_model(base, reference, 3, True)
    tokens = sum(len(e["input_ids"]) for e in _examples())
    page = 4096
    inputs = 3 * pinned_slot_bytes(tokens * 64 * 4, page)
    outputs = attention_output_host_bytes(4, 16, tokens, 4, page)
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, host_budget_bytes=inputs + outputs + outputs // 2,
                                   page_bytes=page, attention_output_layers=3, attention_outputs_on_host=True)
    with caplog.at_level("WARNING", logger="swiftune.training.checkpointing"):
        got, calls = _counted_step(model)
    _assert_parity(expected, got, _trainable(reference))
    stats = offload_stats(model)
    assert stats["attention_output_layers_on_host"] == 1 and stats["derived"] == (), stats
    said = [r.getMessage() for r in caplog.records if "attention outputs of 1 of the 3 layers" in r.getMessage()]
    assert len(said) == 1 and "the other 2 recompute their attention" in said[0], caplog.text
    docs = len(_examples())
    assert calls == docs * 3 + docs * 2, calls
    assert attention_layers_on_host(3, None, outputs) == 3 and attention_layers_on_host(3, outputs - 1, outputs) == 0


def test_attention_outputs_on_host_is_checked_and_budgeted_like_the_planner(qwen3_reference):
    """``attention_outputs_on_host`` needs layers that keep outputs and a bool; the automatic GPU budget sets
    aside two layers' outputs (restored and prefetched) instead of every keeping layer's, and so does the
    planner, which counts the outputs' pinned pages in the host bytes and keeps more layer inputs on the GPU."""
    base, reference, _ = qwen3_reference
    model = _sdpa_model(base, reference, 0)
    with pytest.raises(ValueError, match="also pass attention_output_layers=n"):
        enable_offloaded_checkpointing(model, attention_outputs_on_host=True)
    with pytest.raises(ValueError, match="must be True or False"):
        enable_offloaded_checkpointing(model, attention_output_layers=2, attention_outputs_on_host="yes")
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0, attention_output_layers=3, attention_outputs_on_host=True)
    state = model.get_base_model()._swiftune_offload_state
    x = torch.zeros(1, 10, 64)
    assert state.kept_attention_bytes(x) == 2 * attention_output_bytes(4, 16, 10, 4)
    assert not any(state.keeps_attention_output(i) for i in range(3))  # none on the device

    from swiftune.memory.planner import attention_output_host_bytes, pinned_slot_bytes

    T, gpu = 131_584, int(80e9)
    on_gpu = plan_memory("qwen3-8b", T, gradient_checkpointing="offload", gpu_bytes=gpu, attention_output_layers=36)
    on_host = plan_memory("qwen3-8b", T, gradient_checkpointing="offload", gpu_bytes=gpu, attention_output_layers=36,
                          attention_outputs_on_host=True)
    plain = plan_memory("qwen3-8b", T, gradient_checkpointing="offload", gpu_bytes=gpu)
    per_layer = attention_output_bytes(32, 128, T, 2)
    assert on_host.checkpoints - on_host.kept_layers * T * 4096 * 2 == 2 * per_layer
    assert on_gpu.kept_layers < on_host.kept_layers <= plain.kept_layers
    host_per_layer = attention_output_host_bytes(32, 128, T, 2)
    assert host_per_layer >= per_layer
    input_slot = pinned_slot_bytes(T * 4096 * 2)
    assert plain.host_bytes == plain.offloaded_layers * input_slot
    assert on_host.host_bytes == on_host.offloaded_layers * input_slot + 36 * host_per_layer
    tight = plan_memory("qwen3-8b", T, gradient_checkpointing="offload", gpu_bytes=gpu, attention_output_layers=36,
                        attention_outputs_on_host=True, host_bytes=on_host.host_bytes - 30 * host_per_layer)
    assert tight.host_bytes <= tight.host_limit and any("recompute them instead" in n for n in tight.notes)
    with pytest.raises(ValueError, match="needs attention_output_layers >= 1"):
        plan_memory("qwen3-8b", T, gradient_checkpointing="offload", attention_outputs_on_host=True)


def test_swiftune_plan_takes_the_kept_attention_outputs(capsys):
    """``swiftune plan --offload_attention_output_layers N [--offload_attention_outputs_on_host]`` plans what
    ``plan_memory`` does with them (on the host: pinned pages for them, two layers' on the GPU), and refuses
    them without offloading or without N."""
    import json

    from swiftune.cli.plan import main_plan

    common = ["--model", "qwen3-8b", "--tokens", "131584", "--gradient_checkpointing", "offload", "--gpu_gb", "80",
              "--host_gb", "200", "--json"]
    kw = dict(gradient_checkpointing="offload", gpu_bytes=int(80e9), host_bytes=int(200e9), tiled_mlp=True,
              lora_dtype_bytes=4, lora_input_casts=True, attention_output_layers=36)
    for extra, on_host in (([], False), (["--offload_attention_outputs_on_host"], True)):
        assert main_plan([*common, "--offload_attention_output_layers", "36", *extra]) == 0
        printed = json.loads(capsys.readouterr().out)["plan"]
        want = plan_memory("qwen3-8b", 131584, attention_outputs_on_host=on_host, **kw)
        assert (printed["checkpoints"], printed["host_bytes"]) == (want.checkpoints, want.host_bytes)
    assert main_plan(["--model", "qwen3-8b", "--offload_attention_output_layers", "2"]) == 2
    assert "needs gradient_checkpointing='offload'" in capsys.readouterr().err
    assert main_plan([*common, "--offload_attention_outputs_on_host"]) == 2
    assert "needs attention_output_layers >= 1" in capsys.readouterr().err
