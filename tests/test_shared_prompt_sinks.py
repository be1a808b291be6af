"""Shared-prompt GRPO rows on gpt-oss (attention sinks, alternating sliding / full layers) against the
*unpatched* transformers model (+ PEFT) run on each ``prompt + completion`` alone.

The swiftune side is GRPO's policy forward (:func:`swiftune.rl.completion_logprobs` on a row from
:func:`swiftune.rl.build_policy_row` with ``share_prompt=True``: each group's prompt once, then its
completions), on a model patched by :func:`swiftune.patch_model` (reference kernels: the Triton ones
are the dense suites' business) with LoRA from :meth:`FastModel.get_peft_model` where PEFT is used.
The reference is transformers' eager gpt-oss (its own sink softmax and window masks) with PEFT LoRA
of the same weights, one sequence at a time: per-token log-probs of every completion (fp32, relative
norm < 1e-5) and the gradients of ``sum(logp x advantage)`` w.r.t. every trainable tensor, the sinks
included, each non-zero where the reference's is.

The model (tests/test_moe_parity.py's tiny gpt-oss): layer 0 sliding with window 4, layer 1 full,
sinks drawn from N(0, 1) so they take real probability mass. Prompts of 3-5 tokens and completions of
up to 6 put prompt + completion past the window, so the window clips prompt keys for late completion
tokens; groups of 2-3 completions put siblings within reach of the full layer (and of the window),
so a mask that let a completion see a sibling changes the log-probs.

Flex: on CPU it runs eagerly and forward-only (no backward off CUDA), so the CPU case compares the
forward and the CUDA case (skipped without a GPU) the gradients too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from swiftune.attention.shared_prompt import RowLayout, grpo_attention_forward
from swiftune.models import patch_model
from swiftune.rl import build_policy_row, completion_logprobs
from swiftune.training import FastModel
from tests.helpers import assert_gradients_match, rel_err
from tests.test_moe_parity import ATTENTION, tiny_gpt_oss

TOL = 1e-5
SINK_GRAD_TOL_CUDA = 1e-4
# three groups (3, 2 and 2 completions), each one document of the shared row
PROMPTS = [[5, 6, 7]] * 3 + [[8, 9, 10, 11, 12]] * 2 + [[13, 14, 15, 16]] * 2
COMPLETIONS = [[20, 21, 22, 23, 24], [25, 26], [27, 28, 29, 30, 31, 32], [33, 34, 35], [36, 37, 38, 39],
               [40], [41, 42, 43, 44, 45]]
GROUPS = [0, 0, 0, 1, 1, 2, 2]
ADVANTAGES = torch.tensor([0.9, -1.3, 0.4, 1.1, -0.7, -0.5, 1.6], dtype=torch.float64)


def _models(lora: bool, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unpatched reference, patched swiftune model) with the same weights; the sinks trained in both."""
    base = tiny_gpt_oss(seed=seed).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        # init_lora_weights=False: B is random too, so every adapter tensor gets a gradient
        reference = get_peft_model(copy.deepcopy(base), LoraConfig(
            r=4, lora_alpha=8, target_modules=ATTENTION, lora_dropout=0.0, init_lora_weights=False,
            task_type="CAUSAL_LM"))
        model = FastModel.get_peft_model(patch_model(copy.deepcopy(base), kernel_backend="reference"), r=4,
                                         lora_alpha=8, target_modules=ATTENTION, use_gradient_checkpointing=False,
                                         init_lora_weights=False)
        model.load_state_dict(reference.state_dict())
        for m in (reference, model):
            for name, p in m.named_parameters():
                if name.endswith("self_attn.sinks"):
                    p.requires_grad_(True)
    else:
        reference = copy.deepcopy(base)
        model = patch_model(copy.deepcopy(base), kernel_backend="reference")
    assert _trainable(model) == _trainable(reference)
    assert any(n.endswith("self_attn.sinks") for n in _trainable(model))
    return reference, model


def _trainable(model: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each ``prompt + completion`` alone through the unpatched model: log_softmax at the sampled tokens."""
    out = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
        predicting = logits[len(prompt) - 1:len(prompt) + len(completion) - 1].double()
        out.append(torch.log_softmax(predicting, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    return out


def _objective(per_sample: list[torch.Tensor]) -> torch.Tensor:
    return sum((lp.double() * a).sum() for lp, a in zip(per_sample, ADVANTAGES))


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split([len(c) for c in COMPLETIONS]))


def _shared_row(backend: str = "auto", device: str = "cpu"):
    row = build_policy_row(PROMPTS, COMPLETIONS, share_prompt=True, group_ids=GROUPS, attention_backend=backend,
                           device=device)
    assert row.layout.shared and row.layout.packed.num_docs == 3  # each group's prompt once
    return row


def _reference_step(reference: torch.nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    reference.zero_grad(set_to_none=True)
    want = _reference_logprobs(reference)
    _objective(want).backward()
    return [w.detach() for w in want], _grads(reference)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_shared_prompt_sink_rows_equal_the_unpatched_model_per_sequence(lora):
    """The reference backend (CPU): log-probs and every trainable gradient, sinks included."""
    reference, model = _models(lora)
    want, want_grads = _reference_step(reference)
    row = _shared_row()
    assert row.layout.shared_sink_backend(on_cuda=False) == "reference"
    got, _ = completion_logprobs(model, row, kernel_backend="reference")
    got = _split(got)
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL
    model.zero_grad(set_to_none=True)
    _objective(got).backward()
    grads = _grads(model)
    assert_gradients_match(want_grads, grads, _trainable(model), TOL)
    assert all(grads[n].abs().max() > 0 for n in grads if n.endswith("self_attn.sinks"))


def test_the_sinks_window_and_siblings_matter_here():
    """The data can fail the parity test: the reference itself changes when the sinks are zeroed, when
    every layer is full (no window), and when a completion is run after a sibling (as a mask that let it
    see the sibling would compute on the full layer)."""
    reference = tiny_gpt_oss()
    with torch.no_grad():
        want = torch.cat(_reference_logprobs(reference))
        no_sinks = copy.deepcopy(reference)
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.zero_()
        assert rel_err(torch.cat(_reference_logprobs(no_sinks)), want) > 1e-2
        no_window = tiny_gpt_oss(layer_types=["full_attention"] * 2)
        assert rel_err(torch.cat(_reference_logprobs(no_window)), want) > 1e-2
        prompt, first, second = PROMPTS[0], COMPLETIONS[0], COMPLETIONS[1]
        alone = reference(input_ids=torch.tensor([prompt + second])).logits[0, len(prompt) - 1:-1]
        after = reference(input_ids=torch.tensor([prompt + first + second])).logits[0, len(prompt + first) - 1:-1]
        assert rel_err(after, alone) > 1e-2


def _flex_inputs(device: str):
    g = torch.Generator().manual_seed(3)
    row = _shared_row("flex", device)
    total = row.layout.packed.num_tokens
    q = torch.randn(1, 4, total, 8, generator=g)
    k, v = (torch.randn(1, 2, total, 8, generator=g) for _ in range(2))
    sinks = torch.randn(4, generator=g).mul(2)
    return row.layout, *(t.to(device) for t in (q, k, v, sinks))


def _attend(layout: RowLayout, q, k, v, sinks, window):
    module = torch.nn.Module()
    return grpo_attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window, s_aux=sinks,
                                  swiftune_row_layout=layout)[0]


def test_shared_prompt_sink_flex_forward_equals_the_unpatched_model_on_cpu():
    """The flex formulation (the shared-prompt mask_mod plus the sink slot) on CPU, forward only: the
    log-probs of the unpatched model per sequence, through the sliding and the full layer; flex asked
    for with a gradient off CUDA is refused rather than run without one."""
    reference, model = _models(lora=False)
    with torch.no_grad():
        want = torch.cat(_reference_logprobs(reference))
        got, _ = completion_logprobs(model, _shared_row("flex"), kernel_backend="reference")
    assert rel_err(got, want) < TOL
    layout, q, k, v, sinks = _flex_inputs("cpu")
    with pytest.raises(ValueError, match="no backward off CUDA"):
        _attend(layout, q.requires_grad_(), k, v, sinks, 4)


def test_shared_prompt_sink_rows_refuse_sdpa_by_name():
    """sdpa has no hook for the sink logit: asked for by name it is refused, never run without the sink."""
    layout, q, k, v, sinks = _flex_inputs("cpu")
    layout.backend = "sdpa"
    with pytest.raises(ValueError, match="sdpa backend has no attention sinks"):
        _attend(layout, q, k, v, sinks, None)
    for backend in ("auto", "varlen", "flash_attn"):
        layout.backend = backend
        assert layout.shared_sink_backend(on_cuda=False) == "reference"
        assert layout.shared_sink_backend(on_cuda=True) == "flex"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no backward off CUDA")
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_shared_prompt_sink_flex_rows_equal_the_unpatched_model_on_cuda(lora):
    """The flex backend (compiled, CUDA): log-probs and every trainable gradient as the unpatched model."""
    reference, model = _models(lora)
    want, want_grads = _reference_step(reference)
    model = model.cuda()
    row = _shared_row("auto", "cuda")
    assert row.layout.shared_sink_backend(on_cuda=True) == "flex"
    got, _ = completion_logprobs(model, row, kernel_backend="reference")
    got = _split(got.cpu())
    for g, w in zip(got, want):
        assert rel_err(g, w) < TOL
    model.zero_grad(set_to_none=True)
    _objective(got).backward()
    grads = {n: g.cpu() for n, g in _grads(model).items()}
    # a sink's gradient sums -p_sink * (dO . O) over every query row of its head, terms that nearly cancel;
    # the compiled kernel sums them in another order than the CPU reference (1.05e-5 seen on the H200)
    bounds = {n: SINK_GRAD_TOL_CUDA if n.endswith(".sinks") else TOL for n in want_grads}
    assert_gradients_match(want_grads, grads, _trainable(model), bounds)
