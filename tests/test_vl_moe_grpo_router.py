"""GRPO on Qwen3-VL-MoE with image prompts: the router load-balancing term, as TRL 1.16 adds it (issue 28).

TRL's GRPOTrainer asks each micro-batch's policy forward for the router logits and adds
``router_aux_loss_coef * load_balancing_loss_func(router logits, attention mask) / accumulation steps``
(tests/test_grpo_router_loss.py says which tokens its mask holds: every prompt token of every sample,
image tokens included, a prompt shared by G samples G times; every completion token unless
``mask_truncated_completions`` masks its completion). Qwen3-VL-MoE keeps its router settings in
``text_config``.

The reference is the unpatched transformers Qwen3-VL-MoE run on each sample ``prompt + completion``
alone (its own M-RoPE index and vision tower, ``output_router_logits=True``): the policy objective
from the papers' formula (:func:`tests.test_grpo_loss.reference_loss`, float64 log-softmax of the
full logits at the sampling temperature) plus ``coef * load_balancing_loss_func`` (the model
module's own) of each micro-batch's router logits, laid out as TRL's padded micro-batch (one row per
sample, zeros under a zero mask). The swiftune side is a real :class:`swiftune.GRPOTrainer` with a
fixed rollout engine on the patched model (full fine-tuning: the vision tower, mergers, routers and
experts train), its own micro-steps (packed image rows, shared-prompt or plain, the recorded router
logits, the division by the accumulation steps, backward). Loss and every trainable tensor's
gradient are compared, fp32 on CPU.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import swiftune
from swiftune.rl import GRPOConfig, GRPOTrainer
from swiftune.rl.multimodal import VisionGRPO
from swiftune.rl.rollout import Rollouts
from tests.helpers import assert_gradients_match, rel_err
from tests.test_grpo_loss import reference_loss
from tests.test_qwen3_vl import _model, _processor, tiny_vl_moe, transformers
from tests.test_qwen3_vl_grpo import _prompt_rows

if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3-VL-MoE", allow_module_level=True)

COEF = 0.5  # the model config's coefficient: large, so that the term moves the loss and the routers visibly
TOL = 1e-5
G = 2
TEMPERATURE = 0.7
MAX_COMPLETION = 4


def _completions(eos: int) -> list[list[list[int]]]:
    """G completions per prompt of tests.test_qwen3_vl_grpo._prompt_rows (image, two images, text):
    finished ones end with EOS, the others were cut (masked under mask_truncated_completions); one
    is EOS alone (its only target predicted by the prompt's last token)."""
    return [[[65, 66, eos], [eos]], [[80, 81, 82, 83], [90, eos]], [[70, 71], [75, 76, 77, eos]]]


class FixedVisionRollouts:
    """A rollout engine for image prompts returning the completions above (and whether each finished)."""

    accepts_vision_inputs = True

    def __init__(self, by_prompt: dict[tuple[int, ...], list[list[int]]], eos: int):
        self.by_prompt, self.eos = by_prompt, eos

    def generate(self, prompt_ids, num_generations, params, vision_inputs=None):
        assert num_generations == G and params.temperature == TEMPERATURE and vision_inputs is not None
        ids = [list(c) for p in prompt_ids for c in self.by_prompt[tuple(p)]]
        return Rollouts(ids, [torch.zeros(len(c)) for c in ids], [c[-1] == self.eos for c in ids], G)

    def load_weights(self, model):
        pass


def reward(prompts, completions, completion_ids, **kwargs):
    return [len(c) + 0.1 * c[0] for c in completion_ids]


def _group_advantages(rewards: list[float]) -> torch.Tensor:
    """TRL's ``scale_rewards="group"``: (r - mean_g) / (std_g + 1e-4)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def _sample_forward(model, prompt, completion):
    """The unpatched model on ``prompt + completion`` alone: float64 log-probs of the completion at
    the sampling temperature, and every sparse layer's router logits ``[tokens, experts]``."""
    ids = torch.tensor([prompt.input_ids + completion])
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if prompt.pixel_values is not None:
        inputs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    out = model(**inputs, output_router_logits=True, use_cache=False)
    p = len(prompt.input_ids)
    logits = out.logits[0, p - 1:p - 1 + len(completion)].double() / TEMPERATURE
    logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    return logps, [layer.reshape(ids.shape[1], -1) for layer in out.router_logits if layer is not None]


def _reference_step(model, prompts, completions, eos: int, *, ga: int, mask_truncated: bool, loss_type: str,
                    coef: float):
    """TRL's step on the unpatched model, micro-batch by micro-batch: the policy objective of its
    samples' log-probs plus ``coef * load_balancing_loss_func`` of their router logits under TRL's
    attention mask, each divided by the accumulation steps (dapo: the policy term by the step's token
    count instead). Returns the loss, the gradients and each micro-batch's aux."""
    samples = [(prompt, c) for prompt, cs in zip(prompts, completions) for c in cs]
    kept = [c[-1] == eos or not mask_truncated for _, c in samples]
    advantages = _group_advantages(reward(None, None, [c for _, c in samples]))
    total_tokens = sum(len(c) for (_, c), k in zip(samples, kept) if k)
    text = model.config.text_config
    own = importlib.import_module(type(model).__module__).load_balancing_loss_func  # the model's own
    n = len(samples) // ga
    model.zero_grad(set_to_none=True)
    loss, auxes = 0.0, []
    for s in range(ga):
        part = list(range(s * n, (s + 1) * n))
        width = max(len(samples[i][0].input_ids) + len(samples[i][1]) for i in part)
        logp = torch.zeros(n, MAX_COMPLETION, dtype=torch.float64)
        mask = torch.zeros(n, MAX_COMPLETION, dtype=torch.float64)
        attention = torch.zeros(n, width, dtype=torch.long)
        gates = []
        for r, i in enumerate(part):
            prompt, completion = samples[i]
            lp, routers = _sample_forward(model, prompt, completion)
            logp[r, :len(completion)] = lp
            p = len(prompt.input_ids)
            attention[r, :p] = 1
            if kept[i]:
                mask[r, :len(completion)] = 1
                attention[r, p:p + len(completion)] = 1
            gates.append([torch.nn.functional.pad(g, (0, 0, 0, width - g.shape[0])) for g in routers])
        # TRL's padded micro-batch: per sparse layer [n * width, experts], the padding under a zero mask
        layers = tuple(torch.cat([g[k] for g in gates]) for k in range(len(gates[0])))
        aux = own(layers, text.num_experts, text.num_experts_per_tok, attention)
        policy = reference_loss(logp, logp.detach(), None, mask, advantages[part], loss_type=loss_type,
                                num_items=total_tokens)
        auxes.append(aux.detach())
        loss = loss + (policy if loss_type == "dapo" else policy / ga) + coef * aux / ga
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, auxes


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    base = tiny_vl_moe(_model(proc), scale=0.3, router_aux_loss_coef=COEF).train()
    assert base.config.text_config.router_aux_loss_coef == COEF and not getattr(base.config.text_config, "output_router_logits", False)
    return proc, base


ROUTER = "model.language_model.layers.0.mlp.gate.weight"

# (share_prompt, gradient_accumulation_steps, mask_truncated_completions, loss_type, router_aux_loss_coef):
# shared prompts (each group's prompt and images once, counted G times), truncated completions masked,
# the text config's coefficient (None); plain rows, one group per micro-batch over three accumulation
# steps, dapo's global normaliser and an explicit coefficient
CASES = [(True, 1, True, "grpo", None), (False, 3, False, "dapo", 0.3)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"share{c[0]}-ga{c[1]}-masktrunc{c[2]}-{c[3]}-coef{c[4]}")
def test_vl_moe_grpo_router_loss_and_gradients_equal_trls_formula(setup, case, tmp_path):
    share, ga, mask_truncated, loss_type, coef = case
    proc, base = setup
    weight = COEF if coef is None else coef
    eos = proc.tokenizer.eos_token_id
    model = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    rows = _prompt_rows()
    prompts = [VisionGRPO(model, proc).encode(row) for row in rows]
    assert [0 if p.image_grid_thw is None else p.image_grid_thw.shape[0] for p in prompts] == [1, 2, 0]
    completions = _completions(eos)
    step = dict(ga=ga, mask_truncated=mask_truncated, loss_type=loss_type)
    expected_loss, expected, auxes = _reference_step(copy.deepcopy(base), prompts, completions, eos, coef=weight,
                                                     **step)
    # the term matters far beyond the tolerance (loss and the router's gradient): the test can fail
    plain_loss, plain, _ = _reference_step(copy.deepcopy(base), prompts, completions, eos, coef=0.0, **step)
    assert rel_err(plain_loss, expected_loss) > 100 * TOL and rel_err(plain[ROUTER], expected[ROUTER]) > 100 * TOL
    assert any(".visual." in name for name in expected)  # the vision tower trains too

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_pin_memory=False, per_device_train_batch_size=len(rows) * G // ga, gradient_accumulation_steps=ga,
        num_generations=G, temperature=TEMPERATURE, max_completion_length=MAX_COMPLETION, share_prompt=share,
        mask_truncated_completions=mask_truncated, loss_type=loss_type, beta=0.0, router_aux_loss_coef=coef,
        kernel_backend="reference", attention_backend="reference", logit_chunk_tokens=4,
    )
    engine = FixedVisionRollouts({tuple(p.input_ids): cs for p, cs in zip(prompts, completions)}, eos)
    trainer = GRPOTrainer(model, [reward], args=args, train_dataset=rows, processing_class=proc,
                          rollout_engine=engine)
    assert trainer.vision is not None and trainer.router_aux.enabled and trainer.router_aux.coef == weight
    assert not getattr(model.config.text_config, "output_router_logits", False)  # TRL's GRPOTrainer leaves the config alone
    model = trainer.model
    trainer.current_gradient_accumulation_steps = ga  # what Trainer's loop sets for each step
    model.zero_grad(set_to_none=True)
    loss = sum(trainer.training_step(model, {"prompt_rows": rows}) for _ in range(ga)).detach()
    assert len(trainer._buffer) == ga and all(mb.row.layout.shared == share for mb in trainer._buffer)
    assert all("pixel_values" in mb.row.model_inputs for mb in trainer._buffer[:2])  # image rows
    assert torch.isfinite(loss) and rel_err(loss, expected_loss) < TOL, (float(loss), float(expected_loss))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    assert_gradients_match(expected, grads, [n for n, p in model.named_parameters() if p.requires_grad], TOL)

    trainer.log({"loss": float(loss)})  # TRL's aux_loss: the unweighted term, mean over the micro-batches
    assert rel_err(torch.tensor(trainer.state.log_history[-1]["aux_loss"]), torch.stack(auxes).mean()) < TOL
