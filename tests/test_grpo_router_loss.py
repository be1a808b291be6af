"""GRPO's MoE router load-balancing loss, as TRL 1.16's GRPOTrainer adds it (issue 25).

TRL asks each micro-batch's policy forward for the router logits (``output_router_logits=True``; the
model config is left alone) and adds ``router_aux_loss_coef * aux_loss / gradient_accumulation_steps``
to the micro-batch's loss, ``aux_loss`` being transformers' own ``load_balancing_loss_func`` over the
micro-batch's padded ``prompt + completion`` rows with their attention mask: every prompt token of
every sample (a prompt shared by G samples counts G times), every completion token up to its end, the
completions ``mask_truncated_completions`` masks not at all. ``router_aux_loss_coef=None`` takes the
model config's coefficient, ``0.0`` switches the term off, a non-zero value on a dense model is an
error; ``aux_loss`` (the unweighted term) is logged.

The swiftune side is a real :class:`swiftune.GRPOTrainer` with a fixed rollout engine on a tiny
patched Qwen3-MoE (a sparse layer and a dense one; one case on gpt-oss), its own micro-steps (``training_step``: packed
policy rows, shared-prompt or plain, the recorded router logits, the division by the accumulation
steps, backward). The reference is the unpatched transformers model on TRL's padded micro-batches
(the prompts have the same length, so TRL's left padding adds nothing and the positions are each
sample's own): the policy objective from the papers' formula (:func:`tests.test_grpo_loss.reference_loss`,
float64 log-softmax of the full logits) plus ``coef * load_balancing_loss_func(router logits, mask)``
for each micro-batch as TRL weighs it. Loss and every trainable tensor's gradient are compared.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import transformers

from swiftune.data import build_tokenizer
from swiftune.errors import ConfigError
from swiftune.models import causal_lm_of, enable_tiled_mlp, patch_model
from swiftune.models.support import controls_attention
from swiftune.rl import GRPOConfig, GRPOTrainer
from tests.helpers import assert_gradients_match, rel_err
from tests.test_grpo_loss import L_MAX, reference_loss
from tests.test_grpo_parity import (
    COMPLETIONS, G, PROMPTS, TEMPERATURE, FixedRollouts, _group_advantages, _grads, _trainable, reward,
)
from tests.test_moe_parity import AUX_COEF, _count_tiled_experts, tiny_moe, tiny_qwen3_moe

TOL = 1e-5
PAD = 0  # the reference's padding token: masked out, never attended to


def _samples(tokenizer) -> tuple[list[tuple[list[int], list[int]]], list[bool]]:
    samples = [(tokenizer(p, add_special_tokens=False)["input_ids"], list(c)) for p in PROMPTS for c in COMPLETIONS[p]]
    assert len({len(p) for p, _ in samples}) == 1  # no left padding in TRL's batch: positions as per sample
    return samples, [c[-1] == tokenizer.eos_token_id for _, c in samples]


def _reference_step(model, tokenizer, *, ga: int, mask_truncated: bool, loss_type: str, coef: float):
    """TRL's step on the unpatched model: per micro-batch the padded rows (attention mask: prompt, and
    each completion unless masked as truncated), the policy objective of its log-probs and
    ``coef * load_balancing_loss_func`` of its router logits under that mask, each divided by the
    accumulation steps (dapo: the policy term by the step's token count instead). Returns the loss,
    the gradients and each micro-batch's aux."""
    samples, finished = _samples(tokenizer)
    advantages = _group_advantages(reward(None, None, [c for _, c in samples]))
    n = len(samples) // ga
    total_tokens = sum(len(c) for (_, c), f in zip(samples, finished) if f or not mask_truncated)
    model.zero_grad(set_to_none=True)
    loss, auxes = 0.0, []
    for s in range(ga):
        part = samples[s * n:(s + 1) * n]
        P, width = len(part[0][0]), max(len(c) for _, c in part)
        ids = torch.full((n, P + width), PAD)
        attention = torch.zeros(n, P + width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.float64)
        for r, ((prompt, completion), done) in enumerate(zip(part, finished[s * n:(s + 1) * n])):
            ids[r, :P + len(completion)] = torch.tensor(prompt + completion)
            attention[r, :P] = 1
            if done or not mask_truncated:
                attention[r, P:P + len(completion)] = 1
                mask[r, :len(completion)] = 1
        out = model(input_ids=ids, attention_mask=attention, output_router_logits=True, use_cache=False)
        logits = out.logits[:, P - 1:P + width - 1].double() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(2, ids[:, P:, None]).squeeze(2)
        policy = reference_loss(logp, logp.detach(), None, mask, advantages[s * n:(s + 1) * n], loss_type=loss_type,
                                num_items=total_tokens)
        config = model.config
        own = importlib.import_module(type(model).__module__).load_balancing_loss_func  # the model's own
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        aux = own(out.router_logits, experts, config.num_experts_per_tok, attention)
        auxes.append(aux.detach())
        loss = loss + (policy if loss_type == "dapo" else policy / ga) + coef * aux / ga
    loss.backward()
    return loss.detach(), _grads(model), auxes


def _trainer(model, tokenizer, output_dir, *, ga: int, share: bool, mask_truncated: bool, loss_type: str,
             coef: float | None) -> GRPOTrainer:
    args = GRPOConfig(
        output_dir=str(output_dir), report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_pin_memory=False, per_device_train_batch_size=len(PROMPTS) * G // ga,
        gradient_accumulation_steps=ga, num_generations=G, temperature=TEMPERATURE, max_completion_length=L_MAX,
        share_prompt=share, mask_truncated_completions=mask_truncated, loss_type=loss_type, beta=0.0,
        router_aux_loss_coef=coef, kernel_backend="reference", attention_backend="reference", logit_chunk_tokens=4,
    )
    return GRPOTrainer(model, [reward], args=args, train_dataset=[{"prompt": p} for p in PROMPTS],
                       processing_class=tokenizer, rollout_engine=FixedRollouts(tokenizer))


def _swiftune_step(trainer: GRPOTrainer, ga: int) -> tuple[torch.Tensor, dict]:
    """The trainer's own micro-steps over one generation (the Trainer's loop, one optimizer step)."""
    model = trainer.model
    trainer.current_gradient_accumulation_steps = ga  # what Trainer's loop sets for each step
    model.zero_grad(set_to_none=True)
    inputs = {"prompt_rows": [{"prompt": p} for p in PROMPTS]}
    loss = sum(trainer.training_step(model, inputs) for _ in range(ga))
    return loss.detach(), _grads(model)


# (share_prompt, gradient_accumulation_steps, mask_truncated_completions, loss_type, router_aux_loss_coef,
#  packed attention): shared prompts counted once per sample, truncated completions masked, the config's
# coefficient (None); plain rows over two accumulation steps with dapo's global normaliser and an explicit
# coefficient; the padded fallback of a model whose attention is not swiftune's
CASES = [
    ("qwen3_moe", True, 1, True, "grpo", None, True, False),
    ("qwen3_moe", False, 2, False, "dapo", 0.5, True, False),
    ("qwen3_moe", True, 2, True, "grpo", 0.5, False, False),
    # gpt-oss: router with a bias, the block returns its routing weights, sinks (plain rows only)
    ("gpt_oss", False, 1, True, "grpo", None, True, False),
    # the MoE experts in tiles of 3 tokens (the router once over the whole row)
    ("qwen3_moe", True, 1, True, "grpo", None, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-share{c[1]}-ga{c[2]}-masktrunc{c[3]}-{c[4]}-coef{c[5]}-"
                                                        + ("packed" if c[6] else "padded") + ("-tiled" if c[7] else ""))
def test_grpo_router_loss_and_gradients_equal_trls_formula_on_the_unpatched_model(case, tmp_path, monkeypatch):
    family, share, ga, mask_truncated, loss_type, coef, packed, tiled = case
    tokenizer = build_tokenizer()
    base = tiny_moe(family).train()
    assert base.config.router_aux_loss_coef == AUX_COEF and not base.config.output_router_logits
    weight = AUX_COEF if coef is None else coef
    reference = copy.deepcopy(base)
    expected_loss, expected, auxes = _reference_step(reference, tokenizer, ga=ga, mask_truncated=mask_truncated,
                                                     loss_type=loss_type, coef=weight)
    # the term matters far beyond the tolerance (loss and the router's gradient): the test can fail
    plain_loss, plain, _ = _reference_step(copy.deepcopy(base), tokenizer, ga=ga, mask_truncated=mask_truncated,
                                           loss_type=loss_type, coef=0.0)
    router = "model.layers.0.mlp.router.weight" if family == "gpt_oss" else "model.layers.0.mlp.gate.weight"
    assert rel_err(plain_loss, expected_loss) > 100 * TOL and rel_err(plain[router], expected[router]) > 100 * TOL

    model = patch_model(copy.deepcopy(base), attention="reference" if packed else None, kernel_backend="reference")
    if tiled:
        enable_tiled_mlp(model, tile_tokens=3)
    trainer = _trainer(model, tokenizer, tmp_path, ga=ga, share=share, mask_truncated=mask_truncated,
                       loss_type=loss_type, coef=coef)
    assert trainer.router_aux.enabled and trainer.router_aux.coef == weight
    assert not model.config.output_router_logits  # TRL's GRPOTrainer leaves the model config alone
    assert controls_attention(causal_lm_of(model)) == packed
    tiled_calls = _count_tiled_experts(monkeypatch)
    loss, grads = _swiftune_step(trainer, ga)
    assert (tiled_calls["forward"] > 0 and tiled_calls["backward"] > 0) == tiled, tiled_calls
    assert all((mb.row.layout.seg is not None) == share for mb in trainer._buffer)
    assert torch.isfinite(loss) and rel_err(loss, expected_loss) < TOL, (float(loss), float(expected_loss))
    assert_gradients_match(expected, grads, _trainable(reference), TOL)

    trainer.log({"loss": float(loss)})  # TRL's aux_loss: the unweighted term, mean over the micro-batches
    assert rel_err(torch.tensor(trainer.state.log_history[-1]["aux_loss"]), torch.stack(auxes).mean()) < TOL


def test_grpo_router_loss_coefficient_zero_adds_nothing_and_dense_models_refuse_one(tmp_path):
    """``0.0``: no term, the policy loss alone (and no aux_loss logged); a dense policy refuses a
    non-zero coefficient and takes ``None``; a negative one is refused by the config."""
    tokenizer = build_tokenizer()
    base = tiny_qwen3_moe().train()
    expected_loss, expected, _ = _reference_step(copy.deepcopy(base), tokenizer, ga=1, mask_truncated=False,
                                                 loss_type="dapo", coef=0.0)
    model = patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    trainer = _trainer(model, tokenizer, tmp_path / "off", ga=1, share=True, mask_truncated=False, loss_type="dapo",
                       coef=0.0)
    assert not trainer.router_aux.enabled
    loss, grads = _swiftune_step(trainer, 1)
    assert rel_err(loss, expected_loss) < TOL
    assert_gradients_match(expected, grads, _trainable(model), TOL)
    trainer.log({"loss": float(loss)})
    assert "aux_loss" not in trainer.state.log_history[-1]
    # the last completion tokens are routed only when the term is on: the rows are the usual ones
    assert all(mb.row.num_tokens == 2 + 2 + 2 + 3 for mb in trainer._buffer)  # 2 prompts, inputs 2 + 0, 2 + 1

    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        _trainer(dense, tokenizer, tmp_path / "dense", ga=1, share=False, mask_truncated=False, loss_type="grpo",
                 coef=0.01)
    assert not _trainer(dense, tokenizer, tmp_path / "dense_none", ga=1, share=False, mask_truncated=False,
                        loss_type="grpo", coef=None).router_aux.enabled
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        GRPOConfig(output_dir=str(tmp_path / "neg"), router_aux_loss_coef=-0.1, report_to="none")
