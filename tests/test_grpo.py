"""GRPO on a tiny random model: packed / shared-prompt policy rows equal the padded computation,
the reference policy of LoRA is the base model, the built-in rollout engine matches transformers'
generate and a forward pass, gradient accumulation equals one big batch, a short run logs what it
must, and the built-in `swiftune grpo` run learns.

Kernels and attention run their plain-PyTorch references (``kernel_backend`` /
``attention_backend="reference"``) for speed, as in test_sft.py.
"""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftune.data import EOS_TOKEN_ID, build_tokenizer, tiny_model_config
from swiftune.models import patch_model
from swiftune.training import FastModel, enable_gradient_checkpointing
from swiftune.rl import (
    GRPOConfig,
    GRPOTrainer,
    Rollouts,
    SamplingParams,
    TransformersRolloutEngine,
    build_policy_row,
    completion_logprobs,
    grpo_loss,
)
from tests.helpers import KillAt, rel_err

FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, dataloader_pin_memory=False, disable_tqdm=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_model(family: str = "qwen3", seed: int = 0, patch: bool = True, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_model_config(family, **overrides), dtype=torch.float32)
    if patch:
        patch_model(model, attention="reference", kernel_backend="reference")
    return model


def add_lora(model, seed: int = 1):
    torch.manual_seed(seed)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    with torch.no_grad():  # PEFT starts B at zero: give the adapters an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def random_groups(seed: int = 0, prompt_lengths=(6, 9), group_size: int = 3, max_completion: int = 7):
    """Prompts repeated per group and completions of varied length (one of a single token)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for p_len in prompt_lengths:
        prompt = torch.randint(0, 256, (p_len,), generator=g).tolist()
        for _ in range(group_size):
            n = int(torch.randint(1, max_completion + 1, (1,), generator=g))
            prompts.append(prompt)
            completions.append(torch.randint(0, 256, (n,), generator=g).tolist())
    completions[1] = completions[1][:1]
    return prompts, completions


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_grad_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(rel_err(a[k], b[k]) for k in a if b[k].norm() > 0)


# ----------------------------------------------------------------------------- policy forward

def test_packed_policy_loss_equals_padded(tokenizer):
    """One padding-free row + chunked selective log-softmax == right-padded batch + full logits."""
    model = tiny_model()
    plain = tiny_model(patch=False)  # same weights, transformers' own attention and kernels
    prompts, completions = random_groups(seed=1)
    adv = torch.tensor([0.5, -1.0, 0.3, 1.2, -0.2, -0.8])
    T = 0.8

    row = build_policy_row(prompts, completions, attention_backend="reference")
    assert row.input_ids.shape[0] == 1
    assert row.num_tokens == sum(len(p) + len(c) - 1 for p, c in zip(prompts, completions))
    logps, _ = completion_logprobs(model, row, temperature=T, kernel_backend="reference", chunk_tokens=5)
    old = logps.detach() + 0.1 * torch.sin(torch.arange(logps.numel(), dtype=torch.float32))
    loss = grpo_loss(logps, old, adv, row.seq_index, loss_type="grpo", beta=0.0).loss
    loss.backward()

    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1
    logits = plain(input_ids=ids, attention_mask=attn).logits.float() / T
    logp_all = torch.log_softmax(logits, dim=-1)
    per_seq = []
    flat_ref = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        lp = logp_all[i, len(p) - 1:len(p) + len(c) - 1].gather(1, torch.tensor(c)[:, None]).squeeze(1)
        flat_ref.append(lp)
        o = old[row.seq_index == i]
        ratio = torch.exp(lp - o)
        term = torch.min(ratio * adv[i], torch.clamp(ratio, 0.8, 1.2) * adv[i])
        per_seq.append(-term.mean())
    ref_loss = torch.stack(per_seq).mean()
    ref_loss.backward()
    assert rel_err(logps, torch.cat(flat_ref)) < 1e-5
    assert rel_err(loss, ref_loss) < 1e-5
    assert max_grad_err(grads(model), grads(plain)) < 1e-4


@pytest.mark.parametrize("case", ["qwen3-checkpointing", "gemma2-window-softcap", "qwen3-lora"])
def test_shared_prompt_equals_unshared(case):
    """Each group's prompt encoded once: same completion log-probs and parameter gradients."""
    if case.startswith("gemma2"):
        model = tiny_model("gemma2", sliding_window=5)  # a window shorter than the rows
    else:
        model = tiny_model()
    if case == "qwen3-checkpointing":
        enable_gradient_checkpointing(model)  # the backward recomputes the layers with the same layout
        model.train()
    if case == "qwen3-lora":
        model = add_lora(model)
    prompts, completions = random_groups(seed=2, group_size=4)
    weights = torch.linspace(-1.0, 1.0, sum(len(c) for c in completions))
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        row = build_policy_row(prompts, completions, share_prompt=share, group_ids=[i // 4 for i in range(8)],
                               attention_backend="reference")
        logps, entropy = completion_logprobs(model, row, temperature=0.7, return_entropy=True,
                                             kernel_backend="reference")
        ((logps * weights).sum() + 0.1 * entropy.sum()).backward()
        results[share] = (logps.detach(), entropy.detach(), grads(model), row.num_tokens)
    shared, unshared = results[True], results[False]
    assert shared[3] < unshared[3] - 2 * (6 + 9)  # 3 of 4 prompt copies dropped per group
    assert rel_err(shared[0], unshared[0]) < 1e-5
    assert rel_err(shared[1], unshared[1]) < 1e-5
    assert max_grad_err(shared[2], unshared[2]) < 1e-4


@pytest.mark.parametrize("family,kernel", [("qwen3", "flex"), ("gemma2", "flex"), ("qwen3", "sdpa")])
def test_shared_prompt_kernel_paths(device, family, kernel):
    """Shared rows on their CUDA kernels against the unshared reference rows: flex (window and
    soft-cap too) and sdpa (on CUDA in float32 a fused kernel without GQA, so the K/V-expanding
    retry runs). Off CUDA flex has no backward: there the flex run checks the forward only."""
    model = tiny_model(family, **({"sliding_window": 5} if family == "gemma2" else {})).to(device)
    prompts, completions = random_groups(seed=2, group_size=4)
    weights = torch.linspace(-1.0, 1.0, sum(len(c) for c in completions), device=device)
    with_grad = device == "cuda" or kernel == "sdpa"
    out = {}
    for backend, share in (("reference", False), (kernel, True)):
        model.zero_grad(set_to_none=True)
        row = build_policy_row(prompts, completions, share_prompt=share, attention_backend=backend, device=device)
        with torch.set_grad_enabled(with_grad):
            logps, _ = completion_logprobs(model, row, kernel_backend="reference")
            if with_grad:
                (logps * weights).sum().backward()
        out[backend] = (logps.detach(), grads(model) if with_grad else None)
    assert rel_err(out[kernel][0], out["reference"][0]) < 1e-5
    if with_grad:
        assert max_grad_err(out[kernel][1], out["reference"][1]) < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_shared_prompt_sdpa_row_equals_unpatched_peft_model_per_sample(monkeypatch, family):
    """The shared-prompt sdpa row (each group's prompt once, later completions' queries borrowed from
    the tokens before them) through the patched LoRA model against transformers + PEFT unpatched, each
    prompt + completion run alone: completion log-probs, and every LoRA tensor's gradient, each
    non-zero where the reference's is (Qwen3: q/k norms between the projections and attention)."""
    from peft import LoraConfig, get_peft_model

    from swiftune.attention import shared_prompt

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = add_lora(tiny_model(family), seed=3)
    plain = tiny_model(family, patch=False)  # the same base weights (seed 0)
    plain = get_peft_model(plain, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    plain.load_state_dict(model.state_dict())
    calls = []
    monkeypatch.setattr(shared_prompt, "dense_causal_attention",
                        lambda q, *a, _f=shared_prompt.dense_causal_attention, **kw: calls.append(q.shape[0]) or _f(q, *a, **kw))
    prompts, completions = random_groups(seed=4, group_size=3)
    weights = torch.linspace(-1.0, 1.5, sum(len(c) for c in completions))
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[i // 3 for i in range(6)],
                           attention_backend="sdpa")
    logps, _ = completion_logprobs(model, row, kernel_backend="reference")
    (logps * weights).sum().backward()
    # the shared sdpa path ran: one call per layer for each group's first completion and each later one
    # with an input token (a one-token completion has none); the later ones borrow prompt-length queries
    later = [ce - cs for (ps, pe, cs, ce), prev in zip(row.layout.sequences[1:], row.layout.sequences)
             if prev[0] == ps and ce > cs]
    assert later and len(calls) == model.config.num_hidden_layers * (2 + len(later)), calls
    ref = []
    for p, c in zip(prompts, completions):
        logits = plain(input_ids=torch.tensor([p + c[:-1]])).logits[0, len(p) - 1:].float()
        ref.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1))
    ref = torch.cat(ref)
    (ref * weights).sum().backward()
    assert rel_err(logps.detach(), ref.detach()) < 1e-5
    got, want = grads(model), grads(plain)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora) and set(got) == set(want) == set(lora)
    for name in lora:
        assert want[name].abs().max() > 0 and got[name].abs().max() > 0, name
        assert rel_err(got[name], want[name]) < 1e-4, name


def autograd_nodes(output: torch.Tensor) -> set:
    """Every node of ``output``'s autograd graph."""
    seen, pending = set(), [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return seen


def test_row_pieces_gradient_is_the_sum_of_the_slices():
    """``row_pieces``: overlapping views of a row, one of them unused; the gradient equals plain slicing's
    (float64), in one row-sized buffer, and the shared-prompt sdpa's backward slices no row-long tensor."""
    from swiftune.attention.pieces import row_pieces
    from swiftune.attention.shared_prompt import shared_prompt_sdpa

    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ranges = [(0, 7), (2, 5), (5, 12), (9, 11)]
    weights = [torch.randn(b - a, 3, 4, generator=g, dtype=torch.float64) for a, b in ranges]
    pieces = row_pieces(x, ranges)
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in pieces)
    used = [0, 1, 3]  # the piece (5, 12) takes no part: its rows 7-8 get no gradient from any piece
    got = torch.autograd.grad(sum((pieces[i] * weights[i]).sum() for i in used), x)[0]
    want = torch.autograd.grad(sum((x[ranges[i][0]:ranges[i][1]] * weights[i]).sum() for i in used), x)[0]
    assert torch.equal(got, want) and got[7:9].abs().sum() == 0 and got[2:5].abs().sum() > 0

    prompts, completions = random_groups(seed=5, prompt_lengths=(6, 9, 4), group_size=3)
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[i // 3 for i in range(9)])
    T = row.num_tokens
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = shared_prompt_sdpa(q, k, v, row.layout, scale=0.4)
    nodes = autograd_nodes(out)
    gathers = sum(type(node).__name__.startswith("_RowPiecesBackward") for node in nodes)
    row_slices = [tuple(node._saved_self_sym_sizes) for node in nodes if type(node).__name__ == "SliceBackward0"
                  and tuple(node._saved_self_sym_sizes)[:1] == (T,)]
    assert gathers == 3 and not row_slices, (gathers, row_slices)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_policy_backward_never_indexes_the_row_out_of_a_batch_of_one(share_prompt):
    """A policy row is a batch of one; taking it out by indexing (``t[0]``) makes the backward fill a zero
    tensor of the whole row and copy the gradient in (per layer for q/k/v, once for the hidden states: at a
    676K-token row 5.5 GB each). The log-probs' autograd graph has no such selection of a row-long tensor."""
    model = add_lora(tiny_model())
    prompts, completions = random_groups(seed=4, group_size=3)
    row = build_policy_row(prompts, completions, share_prompt=share_prompt, group_ids=[i // 3 for i in range(6)],
                           attention_backend="sdpa" if share_prompt else "auto")
    logps, _ = completion_logprobs(model, row, kernel_backend="reference")
    nodes = autograd_nodes(logps)
    selections = [sizes for sizes in (tuple(node._saved_self_sym_sizes) for node in nodes
                                      if type(node).__name__ == "SelectBackward0")
                  if sizes and sizes[0] == 1 and row.num_tokens in sizes]
    assert len(nodes) > 50  # the graph was walked (the layers' nodes)
    assert not selections, selections


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_shared_row_attention_hands_back_token_major_gradients(backend):
    """The projections lay q/k/v out token-major (``[1, T, H, D]`` seen as ``[1, H, T, D]``), and the
    gradients a shared row's attention hands back keep that layout: its ``[1, H, T, D] -> [T, H, D]``
    step is a view in backward too. Taking row 0 by indexing instead made autograd fill a head-major
    zero tensor of the whole row and copy into it: one q-sized buffer and a pass over it per layer, and
    the layout in which RoPE's backward once wrapped its 64-bit head offsets at 676K tokens."""
    from swiftune.attention.shared_prompt import grpo_attention_forward

    prompts, completions = random_groups(seed=5, prompt_lengths=(6, 9, 4), group_size=3)
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[i // 3 for i in range(9)])
    layout = copy.copy(row.layout)
    layout.backend = backend
    T = row.num_tokens
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1, T, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2)]
    projected = [t * 1.0 for t in leaves]  # non-leaf outputs, as a projection's
    seen: dict[str, torch.Tensor] = {}
    for name, t in zip("qkv", projected):
        t.register_hook(lambda grad, name=name: seen.__setitem__(name, grad))
    query, key, value = (t.transpose(1, 2) for t in projected)
    out, _ = grpo_attention_forward(torch.nn.Identity(), query, key, value, None, scaling=0.4,
                                    swiftune_row_layout=layout)
    out.backward(torch.randn(out.shape, generator=g))
    assert sorted(seen) == ["k", "q", "v"]
    for name, grad in seen.items():
        assert grad.is_contiguous(), (name, grad.stride())
        assert grad.abs().sum() > 0


def test_shared_prompt_sdpa_equals_the_masked_reference_with_gradients(monkeypatch):
    """The sdpa path of shared rows (each completion as dense prompt + completion, later ones
    gathered) against the masked eager reference in float64: outputs and q/k/v gradients, with
    groups of one, several and empty-input completions. Every call's queries are a slice of the
    row's (later completions borrow the tokens before them for the prompt's positions): no copy."""
    from swiftune.attention import shared_prompt
    from swiftune.attention.shared_prompt import shared_prompt_reference, shared_prompt_sdpa

    query_storages = []

    def recording(q, k, v, **kwargs):
        query_storages.append(q.untyped_storage().data_ptr())
        return dense_causal_attention(q, k, v, **kwargs)

    dense_causal_attention = shared_prompt.dense_causal_attention
    monkeypatch.setattr(shared_prompt, "dense_causal_attention", recording)

    prompts, completions = random_groups(seed=5, prompt_lengths=(6, 9, 4), group_size=3)
    completions[3] = completions[3][:1]  # a group whose first completion has no input token
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[i // 3 for i in range(9)])
    T = row.num_tokens
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(T, 4, 8, generator=g, dtype=torch.float64)
    got = shared_prompt_sdpa(q, k, v, row.layout, scale=0.4)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want = shared_prompt_reference(q, k, v, row.layout, scale=0.4)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert rel_err(got, want) < 1e-12
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 1e-10
    assert len(query_storages) == 8 and set(query_storages) == {q.untyped_storage().data_ptr()}
    # negative control: later completions without their prompt (each alone) give other outputs
    layout = copy.copy(row.layout)
    seqs = row.layout.sequences
    layout.sequences = [(cs, cs, cs, ce) if i and seqs[i - 1][0] == ps else (ps, pe, cs, ce)
                        for i, (ps, pe, cs, ce) in enumerate(seqs)]
    assert rel_err(shared_prompt_sdpa(q, k, v, layout, scale=0.4), want) > 1e-2
    layout.sequences = seqs[:-1]  # a table that does not cover the row
    with pytest.raises(ValueError, match="covers"):
        shared_prompt_sdpa(q, k, v, layout, scale=0.4)
    layout.sequences = [seqs[1], seqs[0], *seqs[2:]]
    with pytest.raises(ValueError, match="in order"):
        shared_prompt_sdpa(q, k, v, layout, scale=0.4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_gpu_shared_prompt_sdpa_saves_no_query_copy():
    """A shared row of two long completions at a Qwen3-8B layer's heads in bf16 (cuDNN / flash, GQA in
    the kernel): what the attention saves for backward is the row's q/k/v, the later completion's
    prompt + completion K/V copies, both outputs and their float32 log-sum-exp; no copy of the later
    completion's queries (``(P + L) x q_dim`` bf16 more, what gathering the prompt's queries saved).
    Gradients equal the masked reference's in float32 within bf16 rounding."""
    from swiftune.attention.shared_prompt import shared_prompt_reference, shared_prompt_sdpa

    P, L, hq, hk, d = 256, 2048, 32, 8, 128  # the float32 reference builds T x T scores per head
    prompts, completions = [list(range(3, 3 + P))], [list(range(5, 6 + L)), list(range(7, 8 + L))]
    row = build_policy_row(prompts * 2, completions, share_prompt=True, group_ids=[0, 0], device="cuda")
    T = row.num_tokens
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(T, h, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for h in (hq, hk, hk))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = shared_prompt_sdpa(q, k, v, row.layout, scale=d**-0.5)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    lq = [P + L, P + L]  # the two calls' query rows
    expected = (T * (hq + 2 * hk) * d * 2  # the row's q, k, v
                + 2 * (P + L) * hk * d * 2  # the later completion's K/V copies
                + sum(n * hq * d * 2 + hq * n * 4 for n in lq))  # outputs, log-sum-exp
    assert 0.95 * expected <= sum(storages.values()) <= expected + (P + L) * hq * d, (sum(storages.values()), expected)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    want_out = shared_prompt_reference(qf, kf, vf, row.layout, scale=d**-0.5)
    want = torch.autograd.grad(want_out, (qf, kf, vf), dout.float())
    assert rel_err(out.float(), want_out) < 2e-2
    for a, b in zip(got, want):
        assert b.abs().max() > 0 and rel_err(a.float(), b) < 2e-2


def test_shared_rows_take_sdpa_on_cuda_for_long_completions_only():
    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS as n
    from swiftune.attention.shared_prompt import flex_attention

    short = build_policy_row([[1, 2, 3]] * 2, [[4, 5], [6]], share_prompt=True, group_ids=[0, 0]).layout
    long = build_policy_row([[1, 2, 3]] * 2, [[4] * n, [5] * n], share_prompt=True, group_ids=[0, 0]).layout
    flex_or = "flex" if flex_attention is not None else "sdpa"
    assert long.shared_backend(on_cuda=True) == "sdpa" and short.shared_backend(on_cuda=True) == flex_or
    windowed = "flex" if flex_attention is not None else "reference"  # sdpa has no window / soft-cap
    assert long.shared_backend(on_cuda=True, window=4096) == windowed
    assert long.shared_backend(on_cuda=True, softcap=30.0) == windowed
    assert long.shared_backend(on_cuda=False) == "reference"
    assert long.sequences == [(0, 3, 3, 2 + n), (0, 3, 2 + n, 1 + 2 * n)]


def test_row_layout_names_its_attention_kernel_and_longest_sequence():
    """Offloaded checkpointing reads these to size a recomputed layer: flex and sdpa rows say so
    (sdpa with the longest sequence one call covers: prompt + completion in a shared row, the
    longest document in a plain one); the reference path and varlen-style kernels claim nothing."""
    from swiftune.attention.backends import SDPA_MIN_MEAN_DOC_TOKENS
    from swiftune.attention.shared_prompt import flex_attention

    prompts, completions = [[5, 6, 7]] * 2, [[8, 9], [10]]
    shared = build_policy_row(prompts, completions, share_prompt=True, group_ids=[0, 0])
    plain = build_policy_row(prompts, completions, share_prompt=False)
    assert shared.layout.shared and not plain.layout.shared
    assert shared.layout.attention_kernel is None  # CPU: the shared row runs the reference path
    assert shared.layout.shared_backend(on_cuda=False) == "reference"
    assert plain.layout.attention_kernel is None
    # a row's inputs end one token before each completion's last (that one is only a target)
    assert shared.layout.max_seqlen == 3 + 2 - 1 and plain.layout.max_seqlen == 3 + 2 - 1
    for kernel in ("flex", "sdpa"):
        for layout in (shared.layout, plain.layout):
            layout.backend = kernel
            assert layout.attention_kernel == kernel and layout.attention_kernel_on(True) == kernel
        assert shared.layout.shared_backend(on_cuda=False) == kernel
    plain.layout.backend = "varlen"
    assert plain.layout.attention_kernel_on(True) is None
    # auto on CUDA: short sequences run flex (where torch has it), long ones sdpa, as the forward picks
    short_flex = "flex" if flex_attention is not None else None
    for layout in (shared.layout, plain.layout):
        layout.backend = "auto"
    assert shared.layout.attention_kernel_on(True) == short_flex and plain.layout.attention_kernel_on(True) is None
    n = SDPA_MIN_MEAN_DOC_TOKENS
    long_completions = [list(range(8, 8 + n + 1)), list(range(8, 8 + n - 1))]  # inputs: 3 + n and 3 + n - 2
    long_shared = build_policy_row(prompts, long_completions, share_prompt=True, group_ids=[0, 0])
    long_plain = build_policy_row(prompts, long_completions, share_prompt=False)
    assert long_shared.layout.shared_backend(on_cuda=True) == "sdpa" == long_shared.layout.attention_kernel_on(True)
    assert long_plain.layout.attention_kernel_on(True) == "sdpa"
    assert long_shared.layout.max_seqlen == 3 + n == long_plain.layout.max_seqlen
    assert long_shared.layout.attention_kernel is None  # (still CPU tensors: the reference path)


def test_policy_forward_tells_offloaded_checkpointing_its_attention_kernel(monkeypatch):
    """The RowLayout keyword of a policy forward reaches the offloaded layers' plan: flex rows plan
    for flex's memory, reference rows for the defaults. (CPU flex cannot run with grad, so the spy
    stops the forward at the first layer's plan, which is where the hint is read.)"""
    from swiftune.training.checkpointing import OffloadState, enable_offloaded_checkpointing

    class Planned(Exception):
        pass

    seen = []

    def spy(self, index, x, attention_kernel=None, max_doc_tokens=None):
        seen.append((index, attention_kernel, max_doc_tokens))
        raise Planned

    monkeypatch.setattr(OffloadState, "layer_input", spy)
    model = tiny_model("qwen3").train()
    enable_offloaded_checkpointing(model, gpu_budget_bytes=0)
    prompts, completions = random_groups(seed=2, group_size=4)
    longest = max(len(p) + len(c) - 1 for p, c in zip(prompts, completions))  # the last token: a target only
    for backend, expected in (("flex", ("flex", longest)), ("sdpa", ("sdpa", longest)), ("reference", (None, None))):
        seen.clear()
        row = build_policy_row(prompts, completions, share_prompt=True, attention_backend=backend)
        with pytest.raises(Planned):
            completion_logprobs(model, row, kernel_backend="reference")
        assert seen == [(0, *expected)], backend


def test_shared_row_layout():
    prompts = [[1, 2, 3]] * 2 + [[4, 5]]
    completions = [[10, 11], [12], [13, 14, 15]]
    row = build_policy_row(prompts, completions, share_prompt=True)
    assert row.input_ids.tolist() == [[1, 2, 3, 10, 4, 5, 13, 14]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert row.layout.seg.tolist() == [0, 0, 0, 1, 0, 0, 1, 1]
    assert row.layout.packed.cu_seqlens.tolist() == [0, 4, 8]
    assert row.hidden_index.tolist() == [2, 3, 2, 5, 6, 7]
    assert row.targets.tolist() == [10, 11, 12, 13, 14, 15]
    assert row.seq_index.tolist() == [0, 0, 1, 2, 2, 2]


# ----------------------------------------------------------------------------- reference policy

def test_lora_reference_is_base_model_with_adapters_disabled(tokenizer, tmp_path):
    base = tiny_model()
    base_copy = copy.deepcopy(base)
    model = add_lora(base)
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.04, num_generations=2, per_device_train_batch_size=2, **FAST)
    trainer = GRPOTrainer(model, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=[{"prompt": "abc"}] * 4, processing_class=tokenizer)
    assert trainer.ref_model is None  # no second copy of the weights
    prompts, completions = random_groups(seed=3)
    row = build_policy_row(prompts, completions, share_prompt=True, attention_backend="reference")
    ref = trainer.reference_logprobs(row)
    want, _ = completion_logprobs(base_copy, row, kernel_backend="reference")
    assert not ref.requires_grad
    assert rel_err(ref, want) < 1e-6
    policy, _ = completion_logprobs(model, row, kernel_backend="reference")  # adapters are back on
    assert (policy - want).abs().max() > 1e-3


def test_full_finetuning_reference_copy_only_when_beta(tokenizer, tmp_path):
    rows = [{"prompt": "abc"}] * 4
    reward = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    common = dict(num_generations=2, per_device_train_batch_size=2, **FAST)
    t0 = GRPOTrainer(tiny_model(), reward, GRPOConfig(output_dir=str(tmp_path / "a"), **common), rows,
                     processing_class=tokenizer)
    assert t0.ref_model is None
    t1 = GRPOTrainer(tiny_model(), reward, GRPOConfig(output_dir=str(tmp_path / "b"), beta=0.1, **common), rows,
                     processing_class=tokenizer)
    assert t1.ref_model is not None and not any(p.requires_grad for p in t1.ref_model.parameters())
    prompts, completions = random_groups(seed=4)
    row = build_policy_row(prompts, completions, attention_backend="reference")
    want, _ = completion_logprobs(tiny_model(), row, kernel_backend="reference")
    assert rel_err(t1.reference_logprobs(row), want) < 1e-6


# ----------------------------------------------------------------------------- rollout engine

PROMPT_TEXTS = ["Reverse: abc\n", "Sort the letters: garden\n", "Hi\n"]


def test_greedy_equals_generate(tokenizer):
    for lora in (False, True):
        model = tiny_model(seed=5)
        if lora:
            model = add_lora(model)
        prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
        engine = TransformersRolloutEngine(model, pad_token_id=tokenizer.pad_token_id)
        out = engine.generate(prompts, 1, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[EOS_TOKEN_ID]))
        for p, got in zip(prompts, out.completion_ids):
            ref = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, eos_token_id=EOS_TOKEN_ID,
                                 pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist()
            if EOS_TOKEN_ID in ref:
                ref = ref[:ref.index(EOS_TOKEN_ID) + 1]
            assert got == ref, (lora, got, ref)


def test_sampling_logprobs_equal_forward_pass(tokenizer):
    model = tiny_model(seed=6)
    model.train()
    enable_gradient_checkpointing(model)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    engine = TransformersRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, seed=3)
    out = engine.generate(prompts, 4, SamplingParams(max_tokens=10, temperature=0.8, stop_token_ids=[EOS_TOKEN_ID]))
    assert model.training  # the training mode came back
    assert len(out.completion_ids) == 12 and all(not lp.requires_grad for lp in out.logprobs)
    rep = [p for p in prompts for _ in range(4)]
    row = build_policy_row(rep, out.completion_ids, share_prompt=True, attention_backend="reference")
    with torch.no_grad():
        model.eval()
        fwd, _ = completion_logprobs(model, row, temperature=0.8, kernel_backend="reference")
    assert rel_err(torch.cat(out.logprobs), fwd) < 1e-5

    # top-k: log-probs of the renormalised top-k distribution, tokens inside the top k
    out_k = engine.generate(prompts, 2, SamplingParams(max_tokens=6, temperature=0.8, top_k=5))
    rep = [p for p in prompts for _ in range(2)]
    row = build_policy_row(rep, out_k.completion_ids, attention_backend="reference")
    with torch.no_grad():
        full, _ = completion_logprobs(model, row, temperature=0.8, kernel_backend="reference")
        logits = model(input_ids=row.input_ids, position_ids=row.position_ids).logits[0].float() / 0.8
        top5 = logits.index_select(0, row.hidden_index).topk(5, dim=-1)
        top5_lse = torch.logsumexp(top5.values, dim=-1)
        hidden_rank = (top5.indices == row.targets[:, None]).any(dim=1)
    sampled = torch.cat(out_k.logprobs)
    assert hidden_rank.all()
    # log p_topk(t) = log p(t) - log sum_{top5} p = y_t - lse(top5 logits)
    assert rel_err(sampled, full + torch.logsumexp(logits.index_select(0, row.hidden_index), -1) - top5_lse) < 1e-5


def test_stops_at_stop_token_and_max_tokens(tokenizer):
    model = tiny_model(seed=7)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    engine = TransformersRolloutEngine(model, pad_token_id=tokenizer.pad_token_id)
    free = engine.generate(prompts, 1, SamplingParams(max_tokens=10, temperature=0))
    assert all(len(c) == 10 for c in free.completion_ids) and not any(free.finished)
    stop = free.completion_ids[0][3]
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))
    for full, got, done in zip(free.completion_ids, out.completion_ids, out.finished):
        if stop in full:
            assert done and got == full[:full.index(stop) + 1]
        else:
            assert not done and got == full
    assert out.completion_ids[0][-1] == stop and len(out.completion_ids[0]) <= 4


def test_engine_without_cache_row_ops(tokenizer, monkeypatch):
    """Older caches without batch_repeat_interleave / batch_select_indices: same greedy tokens."""
    from swiftune.rl import rollout

    model = tiny_model(seed=7)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[EOS_TOKEN_ID, 101, 105])
    want = TransformersRolloutEngine(model).generate(prompts, 2, params)
    monkeypatch.setattr(rollout, "cache_supports", lambda cache, method: False)
    got = TransformersRolloutEngine(model).generate(prompts, 2, params)
    assert got.completion_ids == want.completion_ids and got.finished == want.finished
    assert rel_err(torch.cat(got.logprobs), torch.cat(want.logprobs)) < 1e-5


def test_sampling_is_seeded(tokenizer):
    model = tiny_model(seed=8)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPT_TEXTS]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9)
    a = TransformersRolloutEngine(model, seed=11).generate(prompts, 3, params)
    b = TransformersRolloutEngine(model, seed=11).generate(prompts, 3, params)
    c = TransformersRolloutEngine(model, seed=12).generate(prompts, 3, params)
    assert a.completion_ids == b.completion_ids
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.completion_ids != c.completion_ids
    assert len({tuple(x) for x in a.completion_ids[:3]}) > 1  # a group's samples differ


# ----------------------------------------------------------------------------- trainer

class FixedEngine:
    """A deterministic RolloutEngine: completions are a function of the prompt (pluggability test)."""

    def __init__(self):
        self.calls = 0
        self.loads = 0

    def generate(self, prompt_ids, num_generations, params):
        self.calls += 1
        ids, done = [], []
        for p in prompt_ids:
            for g in range(num_generations):
                n = 1 + (sum(p) + 3 * g) % 6
                comp = [(sum(p) * (g + 1) + 7 * k) % 200 + 40 for k in range(n)]
                if g % 3:
                    comp.append(EOS_TOKEN_ID)
                ids.append(comp[:params.max_tokens])
                done.append(g % 3 != 0)
        return Rollouts(ids, [torch.zeros(len(c)) for c in ids], done, num_generations)

    def load_weights(self, model):
        self.loads += 1


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) / 4 for c in completion_ids]


def answer_reward(prompts, completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]


PROMPT_ROWS = [{"prompt": f"Reverse: {w}\n", "answer": w[::-1]} for w in
               ("abc", "hello", "tiger", "moon", "stone", "piano", "cloud", "river")]


@pytest.mark.parametrize("loss_type, share", [("dapo", True), ("grpo", False), ("dr_grpo", True), ("cispo", False)])
def test_accumulation_equals_one_big_batch(tokenizer, tmp_path, loss_type, share):
    """2 micro-batches of 8 completions accumulated == 1 micro-batch of 16 (same rollouts, SGD step)."""
    finals = []
    for bs, ga in ((16, 1), (8, 2)):
        model = tiny_model(seed=9)
        args = GRPOConfig(output_dir=str(tmp_path / f"{bs}"), max_steps=1, per_device_train_batch_size=bs,
                          gradient_accumulation_steps=ga, num_generations=8, max_completion_length=16,
                          loss_type=loss_type, share_prompt=share, optim="sgd", learning_rate=0.5,
                          lr_scheduler_type="constant", max_grad_norm=0.0, beta=0.05, **FAST)
        trainer = GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer,
                              rollout_engine=FixedEngine())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.train()
        finals.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    assert max_grad_err(finals[1], finals[0]) < 1e-4


def test_short_run_logs_and_reuses_rollouts(tokenizer, tmp_path):
    """LoRA + KL, two optimisation passes per generation, async and sync rewards, chat prompts."""

    async def async_len(prompts, completions, **kwargs):
        return [min(len(c[0]["content"]), 8) / 8 for c in completions]

    rows = [{"prompt": [{"role": "user", "content": r["prompt"].strip()}], "answer": r["answer"]} for r in PROMPT_ROWS]
    model = add_lora(tiny_model(seed=10))

    class CountingEngine(TransformersRolloutEngine):
        calls = 0

        def generate(self, *a, **k):
            CountingEngine.calls += 1
            return super().generate(*a, **k)

    engine = CountingEngine(model, pad_token_id=tokenizer.pad_token_id, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, num_iterations=2, beta=0.1, learning_rate=1e-2,
                      reward_weights=[1.0, 0.5], loss_type="grpo", importance_sampling_level="sequence",
                      mask_truncated_completions=True, **FAST)
    trainer = GRPOTrainer(model, [answer_reward, async_len], args=args, train_dataset=rows,
                          processing_class=tokenizer, rollout_engine=engine)
    assert EOS_TOKEN_ID in trainer.stop_token_ids(True) and 258 in trainer.stop_token_ids(True)  # <|im_end|>
    trainer.train()
    assert CountingEngine.calls == 2  # 4 steps, each generation used twice
    assert trainer._buffer[0].old_logps is not None and trainer._buffer[0].ref_logps is not None
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("step", "reward", "reward_std", "completion_length", "kl", "loss", "entropy",
                "rewards/answer_reward/mean", "rewards/async_len/mean", "completions/max_length",
                "completions/clipped_ratio", "clip_ratio/region_mean", "tokens_per_s"):
        assert key in metrics[0], key
        assert all(isinstance(m[key], (int, float)) for m in metrics)
    assert (tmp_path / "reward.png").exists()


def test_builtin_swiftune_grpo_run_learns(tmp_path):
    """The main job exactly as a user runs it (a fresh process without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "grpo"
    from swiftune import cli

    command = ["-m", "swiftune.cli", "grpo"] if "grpo" in getattr(cli, "COMMANDS", {}) else ["-m", "swiftune.rl"]
    proc = subprocess.run([sys.executable, *command, "--output_dir", str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("metrics.jsonl", "reward.png", "model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    for key in ("step", "reward", "reward_std", "completion_length", "kl", "loss"):
        assert key in rows[0], key
    k = len(rows) // 5
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    assert last > first + 0.05, (first, last)
    assert "first fifth" in proc.stdout


def test_command_on_a_saved_model_with_lora_and_jsonl(tokenizer, tmp_path):
    """`swiftune grpo --model_name_or_path DIR --dataset FILE.jsonl`: the real-model path, in process."""
    from swiftune.cli.grpo import run_grpo

    model_dir = tmp_path / "model"
    tiny_model(seed=11, patch=False).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for a in range(8):
            row = {"prompt": [{"role": "user", "content": f"What is {a} + 2?"}], "answer": str(a + 2)}
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "out"
    rc = run_grpo([
        "--model_name_or_path", str(model_dir), "--dataset", str(data), "--reward_funcs", "final_answer,exact_match",
        "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "4", "--dtype", "fp32", "--lora_r", "4", "--learning_rate", "1e-3",
        "--kernel_backend", "reference", "--attention_backend", "reference", "--report_to", "none",
        "--disable_tqdm", "true", "--save_strategy", "no", "--beta", "0.1",
        "--eval_dataset", str(data), "--eval_strategy", "steps", "--eval_steps", "2",
    ])
    assert rc == 0
    assert (out / "adapter_model.safetensors").exists() and (out / "reward.png").exists()
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [m for m in metrics if "reward" in m]
    assert len(train) == 2 and "rewards/final_answer_reward/mean" in train[0] and "kl" in train[0]
    evals = [m for m in metrics if "eval_reward" in m]
    assert [m["step"] for m in evals] == [2] and "eval_rewards/exact_match_reward/mean" in evals[0]


def test_trainer_runs_on_the_fast_rollout_engine(tokenizer, tmp_path):
    """rollout_engine="fast": the trainer samples through FastRolloutEngine (eager on CPU)."""
    from swiftune.rl.rollout.fast import FastRolloutEngine

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, rollout_engine="fast", **FAST)
    trainer = GRPOTrainer(tiny_model(seed=11), [answer_reward], args=args, train_dataset=PROMPT_ROWS,
                          processing_class=tokenizer)
    assert isinstance(trainer.rollout_engine, FastRolloutEngine)
    trainer.train()
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    with pytest.raises(ValueError, match="rollout_engine"):
        GRPOTrainer(tiny_model(seed=11), [answer_reward], processing_class=tokenizer, train_dataset=PROMPT_ROWS,
                    args=GRPOConfig(output_dir=str(tmp_path / "x"), rollout_engine="vllm", **FAST))


def test_rollout_kv_cache_dtype_reaches_the_fast_engine(tokenizer, tmp_path, caplog):
    """GRPOConfig(rollout_kv_cache_dtype="fp8"): the built-in fast engine samples from an FP8 cache (its
    workspace holds e4m3 codes and scales after training); the default keeps the model's dtype; when "auto"
    picks transformers' generate the run says the setting has no effect."""
    from swiftune.rl.rollout.fast import FastRolloutEngine
    from swiftune.rl.rollout import TransformersRolloutEngine

    caches = {}
    for kv in ("auto", "fp8"):
        args = GRPOConfig(output_dir=str(tmp_path / kv), max_steps=1, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, learning_rate=1e-2, rollout_engine="fast",
                          rollout_kv_cache_dtype=kv, **FAST)
        trainer = GRPOTrainer(tiny_model(seed=11), [answer_reward], args=args, train_dataset=PROMPT_ROWS,
                              processing_class=tokenizer)
        assert isinstance(trainer.rollout_engine, FastRolloutEngine)
        assert trainer.rollout_engine.kv_cache_dtype == kv
        trainer.train()
        metrics = [json.loads(line) for line in open(tmp_path / kv / "metrics.jsonl")]
        assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])
        ws = trainer.rollout_engine._ws
        caches[kv] = (ws.k[0].dtype, ws.k_scale is not None)
    assert caches == {"auto": (torch.float32, False), "fp8": (torch.float8_e4m3fn, True)}
    if torch.cuda.is_available():
        return  # "auto" picks the fast engine there
    args = GRPOConfig(output_dir=str(tmp_path / "auto_picks"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, rollout_kv_cache_dtype="fp8", **FAST)
    with caplog.at_level("WARNING", logger="swiftune"):
        trainer = GRPOTrainer(tiny_model(seed=11), [answer_reward], args=args, train_dataset=PROMPT_ROWS,
                              processing_class=tokenizer)
    assert type(trainer.rollout_engine) is TransformersRolloutEngine
    assert "rollout_kv_cache_dtype='fp8' has no effect" in caplog.text


def test_training_on_the_fused_layer_engine_equals_the_plain_engine(tokenizer, tmp_path, monkeypatch):
    """GRPO with LoRA on FastRolloutEngine(fused_layers=True) trains to the same weights and logs as
    with the engine calling the decoder layers (same seed: the same completions, bit for bit)."""
    import swiftune.rl.rollout.fast as engine_module
    from swiftune.rl.rollout.fast import FastRolloutEngine

    calls = []
    real = engine_module.prenorm_layers
    monkeypatch.setattr(engine_module, "prenorm_layers", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for fused in (True, False):
        before = len(calls)
        model = add_lora(tiny_model(seed=12))
        args = GRPOConfig(output_dir=str(tmp_path / str(fused)), max_steps=2, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, learning_rate=1e-2, beta=0.1, **FAST)
        engine = FastRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, seed=5, fused_layers=fused)
        trainer = GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS,
                              processing_class=tokenizer, rollout_engine=engine)
        trainer.train()
        metrics = [json.loads(line) for line in open(tmp_path / str(fused) / "metrics.jsonl")]
        runs[fused] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        assert (len(calls) > before) == fused  # the fused loop ran in the fused run only
    (m_fused, w_fused), (m_plain, w_plain) = runs[True], runs[False]
    assert [m["loss"] for m in m_fused] == [m["loss"] for m in m_plain]
    assert [m["reward"] for m in m_fused] == [m["reward"] for m in m_plain]
    assert all(torch.equal(w_fused[n], w_plain[n]) for n in w_plain)
    assert any(m["loss"] != 0 for m in m_fused)


def test_rollout_engine_auto_picks_by_device(tokenizer, tmp_path):
    """The default ("auto"): the fast engine on CUDA, transformers' generate elsewhere."""
    from swiftune.rl.rollout.fast import FastRolloutEngine
    from swiftune.rl.rollout import TransformersRolloutEngine

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, **FAST)
    assert args.rollout_engine == "auto"
    trainer = GRPOTrainer(tiny_model(seed=11), [answer_reward], args=args, train_dataset=PROMPT_ROWS,
                          processing_class=tokenizer)
    expected = FastRolloutEngine if args.device.type == "cuda" else TransformersRolloutEngine
    assert type(trainer.rollout_engine) is expected
    trainer.is_fsdp_enabled = True  # FSDP-sharded: auto never picks the fast engine, forcing it is an error
    assert type(trainer._builtin_engine(0)) is TransformersRolloutEngine
    trainer.args.rollout_engine = "fast"
    with pytest.raises(ValueError, match="FSDP"):
        trainer._builtin_engine(0)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_killed_run_resumes_to_the_same_weights(tokenizer, tmp_path, num_iterations):
    """A run killed after its checkpoint and resumed ends where the uninterrupted run ends
    (deterministic rollouts; with num_iterations=2 the checkpoint at step 3 falls mid-way through
    reusing a generation, so the resumed run must take that generation's micro-batches from the
    checkpoint rather than sample again under the later policy)."""
    common = dict(max_steps=4, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  num_iterations=num_iterations, beta=0.05, learning_rate=1e-2, lr_scheduler_type="cosine",
                  warmup_steps=1, save_steps=2 if num_iterations == 1 else 3, metrics_file=None, plot_rewards=False,
                  **{**FAST, "save_strategy": "steps"})

    def trainer_for(out, model, callbacks=()):
        args = GRPOConfig(output_dir=str(out), **common)
        return GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer,
                           rollout_engine=FixedEngine(), callbacks=list(callbacks))

    full = add_lora(tiny_model(seed=12))
    full_trainer = trainer_for(tmp_path / "full", full)
    full_trainer.train()
    killed_at = common["save_steps"] + 1
    trainer = trainer_for(tmp_path / "killed", add_lora(tiny_model(seed=12)), [KillAt(killed_at)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "killed" / f"checkpoint-{common['save_steps']}").is_dir()
    resumed = add_lora(tiny_model(seed=12), seed=99)  # other adapter init: the state must come from the checkpoint
    resumed_trainer = trainer_for(tmp_path / "killed", resumed)
    resumed_trainer.train(resume_from_checkpoint=True)
    want = {n: p for n, p in full.named_parameters() if p.requires_grad}
    for n, p in resumed.named_parameters():
        if p.requires_grad:
            assert rel_err(p, want[n]) < 1e-5, n
    # every step after the checkpoint logs its generation's metrics as the uninterrupted run does, the first
    # one too (with num_iterations=2 it reuses the checkpoint's generation: it logged none)

    def generation_logs(trainer) -> dict[int, dict]:
        return {h["step"]: {k: v for k, v in h.items() if k == "reward" or k.startswith(("rewards/", "completions/"))}
                for h in trainer.state.log_history if "loss" in h and h["step"] > common["save_steps"]}

    after = generation_logs(resumed_trainer)
    assert sorted(after) == list(range(common["save_steps"] + 1, common["max_steps"] + 1))
    assert all("reward" in logs for logs in after.values())
    full_logs = generation_logs(full_trainer)
    for step, logs in after.items():
        assert logs.keys() == full_logs[step].keys(), step
        assert all(logs[k] == pytest.approx(full_logs[step][k], rel=1e-6) for k in logs), step


def test_warns_when_completions_outrun_the_models_positions(tokenizer, tmp_path, caplog):
    model = tiny_model(seed=3, max_position_embeddings=64)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_prompt_length=32, max_completion_length=48, **FAST)
    with caplog.at_level("WARNING", logger="swiftune.rl.trainer"):
        GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer)
    assert "max_position_embeddings = 64" in caplog.text and "80 tokens" in caplog.text


def test_evaluate_scores_fresh_completions_of_held_out_prompts(tokenizer, tmp_path):
    """evaluate(): mean rewards of the engine's completions of the eval prompts (checked against the
    same completions scored here), logged; with eval_strategy="steps" during training too."""
    eval_rows = [{"prompt": f"Sort: {w}\n", "answer": "".join(sorted(w))} for w in ("dog", "zebra", "kiwi")]
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=1,
                      **FAST)
    trainer = GRPOTrainer(tiny_model(seed=15), [length_reward, answer_reward], args=args, train_dataset=PROMPT_ROWS,
                          eval_dataset=eval_rows, processing_class=tokenizer, rollout_engine=FixedEngine())
    metrics = trainer.evaluate()
    ids = [trainer.tokenize_prompt(r["prompt"]) for r in eval_rows]
    comps = FixedEngine().generate(ids, 4, SamplingParams(max_tokens=8)).completion_ids
    texts = tokenizer.batch_decode(comps, skip_special_tokens=True)
    lengths = length_reward(None, texts, comps)
    answers = answer_reward(None, texts, [r["answer"] for r in eval_rows for _ in range(4)])
    assert metrics["eval_rewards/length_reward/mean"] == pytest.approx(sum(lengths) / 12)
    assert metrics["eval_rewards/answer_reward/mean"] == pytest.approx(sum(answers) / 12)
    assert metrics["eval_reward"] == pytest.approx((sum(lengths) + sum(answers)) / 12)
    assert metrics["eval_completion_length"] == pytest.approx(sum(len(c) for c in comps) / 12)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2]  # train() starts a fresh state
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines if "eval_reward" in m] == [1, 2]  # the file starts with the run
    assert [m["step"] for m in lines if "reward" in m] == [1, 2]
    with pytest.raises(ValueError, match="prompt"):
        trainer.evaluate([{"text": "no prompt"}])


def test_reward_functions_by_name_module_or_file(tmp_path):
    from swiftune.cli.grpo import BUILTIN_REWARDS, resolve_reward_funcs
    from swiftune.errors import ConfigError

    path = tmp_path / "my_rewards.py"
    path.write_text("def brevity(prompts, completions, **kw):\n    return [-len(c) / 10 for c in completions]\n")
    funcs = resolve_reward_funcs(f"{sorted(BUILTIN_REWARDS)[0]}, json:dumps, {path}:brevity")
    assert funcs[0] is BUILTIN_REWARDS[sorted(BUILTIN_REWARDS)[0]] and funcs[1] is json.dumps
    assert funcs[2](None, ["abcd", ""]) == [-0.4, 0.0]
    for spec, message in ((f"{path}:nope", "has no function"), (f"{tmp_path}/missing.py:f", "no file"),
                          ("no_such_module_xyz:f", "cannot import"), ("nonsense", "unknown reward")):
        with pytest.raises(ConfigError, match=message):
            resolve_reward_funcs(spec)


def test_bf16_step_skips_lora_input_casts_but_generation_keeps_them(tokenizer, tmp_path):
    """bf16 weights, float32 adapters, bf16=True: the loss forward and backward run with PEFT's LoRA
    input casts off (autocast covers them); generation inside the same training step (transformers'
    generate, no autocast) runs with them on, else bf16 inputs would meet float32 adapters."""
    model = add_lora(tiny_model(seed=12).to(torch.bfloat16))
    lora_layer = next(m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A"))
    seen = set()
    lora_layer.register_forward_pre_hook(lambda m, a: seen.add((torch.is_grad_enabled(), m.cast_input_dtype_enabled)))
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, bf16=True, use_cpu=True, **FAST)
    trainer = GRPOTrainer(model, [length_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer)
    trainer.train()
    assert (False, True) in seen  # generation: casts on
    assert (True, False) in seen and (True, True) not in seen  # the loss forward: casts off
    assert lora_layer.cast_input_dtype_enabled
    assert math.isfinite(trainer.state.log_history[0]["loss"])
