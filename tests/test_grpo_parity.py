"""GRPO gradient parity: swiftune's policy step against the objective on the *unpatched* model.

The swiftune side is what a user runs: ``swiftune.patch_model`` with its defaults (the Triton
kernels, through the interpreter on CPU, where everything here runs; packed attention),
``FastModel.get_peft_model`` (LoRA on all seven projections), a real :class:`swiftune.GRPOTrainer`
with a fixed rollout engine, and the trainer's own step: ``_prepare_inputs`` builds the packed
(shared-prompt or plain) policy rows, the group advantages, the old log-probs
(``num_iterations=2``: the rollouts are reused after an optimizer step) and the reference
log-probs (LoRA: adapters disabled); ``Trainer.training_step`` then runs
``GRPOTrainer.compute_loss`` (the policy forward on the packed row, the fused chunked selective
log-softmax at ``temperature``, ``grpo_loss``), the division by the accumulation steps and the
backward.

The reference is the plain library and the papers' formulas, never another swiftune path: the
transformers model (eager attention) with PEFT LoRA on top (the same weights), run on each
``prompt + completion`` alone, ``log_softmax(logits / T)`` of the full logits gathered at the
sampled tokens (float64), old log-probs from the same plain model before the optimizer step,
reference log-probs with its adapters disabled, group advantages ``(r - mean_g) / (std_g + 1e-4)``,
and the objective of each ``loss_type`` / ``importance_sampling_level`` written on padded tensors
(:func:`tests.test_grpo_loss.reference_loss`: GRPO, bnpo, Dr. GRPO, DAPO, GSPO, CISPO, two-sided
clipping, k3 KL), over the whole optimizer step (bnpo: TRL's per-micro-batch token mean, averaged).

For each case: **every trainable tensor's gradient** within fp32 tolerance (relative norm < 1e-5)
of the reference, the same set of tensors with a gradient, each non-zero where the reference's is,
and the step's loss within 1e-5 of the reference relative to the larger of the loss and its scale
(a group's advantages sum to zero, so the loss can be far smaller than the terms whose fp32
rounding it carries: the scale is the same normalised sum with every advantage positive). The
data are chosen so that clipping (or CISPO's cap, or the delta cap) really decides some tokens'
gradients, not all, and no ratio sits within 1e-3 of a clip boundary (checked for every case).

Cost: every token of a policy row runs the interpreted kernels (~0.1-0.3 s each on CPU), so the
models have one layer, the rows 9-13 tokens, and one generation (the old and reference passes)
per layout serves all the objectives of that layout: the rollouts do not depend on the objective,
so each case builds a GRPOTrainer from its own ``GRPOConfig`` and hands it that generation.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from swiftune.data import EOS_TOKEN_ID, build_tokenizer
from swiftune.losses import blocks
from swiftune.models import causal_lm_of, is_patched, patch_model
from swiftune.training import FastModel
from swiftune.models.lora_linear import LoRALinearFunction
from swiftune.models.support import controls_attention
from swiftune.rl import GRPOConfig, GRPOTrainer, Rollouts
from tests.helpers import assert_gradients_match, tiny_model
from tests.test_grpo_loss import L_MAX, reference_loss

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-5
TEMPERATURE = 0.7
G = 2  # completions per prompt
BETA = 0.04
# the kernels run through the Triton interpreter (tests/conftest.py, on a machine without CUDA); on a
# CUDA machine the same CPU tensors take the kernels' PyTorch references
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the rollouts: two prompts of two byte tokens, G completions each; a completion ending with EOS
# finished, the other was cut (masked when mask_truncated_completions); one completion is EOS alone
# (a single target predicted by the prompt's last token, no input token of its own). Every group's
# rewards differ (test_every_group_has_non_zero_advantages): with tied rewards a group's advantages are
# zero and at beta=0 it adds nothing to the loss, so a cross-completion attention leak in a
# shared-prompt row (which can only show in "xy": "ab"'s second completion has no input token) would
# pass the beta=0 cases. "xy": rewards 3 + 8.0 and 2 + 9.1.
PROMPTS = ("ab", "xy")
COMPLETIONS = {
    "ab": ([65, 66, EOS_TOKEN_ID], [EOS_TOKEN_ID]),
    "xy": ([80, 81, 82], [91, EOS_TOKEN_ID]),
}
# the optimizer step between the rollouts (old log-probs) and the policy step (Reference.first_step):
# sign(gradient) as AdamW's first step, plus noise; in units of each tensor's mean magnitude
STEP_LR, STEP_NOISE = 0.05, 0.6


class FixedRollouts:
    """A RolloutEngine that returns the completions above (and whether each finished)."""

    def __init__(self, tokenizer):
        self.by_prompt = {tuple(tokenizer(p, add_special_tokens=False)["input_ids"]): COMPLETIONS[p] for p in PROMPTS}

    def generate(self, prompt_ids, num_generations, params):
        assert num_generations == G and params.temperature == TEMPERATURE
        ids = [list(c) for p in prompt_ids for c in self.by_prompt[tuple(p)]]
        return Rollouts(ids, [torch.zeros(len(c)) for c in ids], [c[-1] == EOS_TOKEN_ID for c in ids], G)

    def load_weights(self, model):
        pass


def reward(prompts, completions, completion_ids, **kwargs):
    return [len(c) + 0.1 * c[0] for c in completion_ids]


# (family, share_prompt, gradient_accumulation_steps, mask_truncated_completions); with two
# accumulation steps each micro-batch holds one group, else both groups share one row
LAYOUTS = {
    "qwen3-shared": ("qwen3", True, 1, False),
    "qwen3-unshared": ("qwen3", False, 1, True),
    "llama-shared-ga2": ("llama", True, 2, True),
    "llama-unshared": ("llama", False, 1, False),
}

# (layout, objective): every loss_type at both importance-sampling levels, on both families, with
# and without the KL term; GSPO's clip range is narrower (its ratios are per-sequence means). With
# one micro-batch dapo's normaliser is bnpo's: the two differ on the accumulated layout only.
CASES = [
    ("qwen3-shared", dict(loss_type="grpo", beta=BETA)),
    ("qwen3-shared", dict(loss_type="bnpo")),
    ("qwen3-shared", dict(loss_type="dr_grpo", importance_sampling_level="sequence", epsilon=0.05)),
    ("qwen3-shared", dict(loss_type="dapo", epsilon_high=0.28, delta=1.4)),  # two-sided clipping
    ("qwen3-shared", dict(loss_type="cispo", epsilon_high=1.1, beta=BETA)),
    ("qwen3-shared", dict(loss_type="dapo", importance_sampling_level="sequence", epsilon=0.05, beta=BETA)),
    ("qwen3-unshared", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05)),
    ("qwen3-unshared", dict(loss_type="dr_grpo", beta=BETA)),
    ("qwen3-unshared", dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.1)),
    ("qwen3-unshared", dict(loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.05, beta=BETA)),
    ("llama-shared-ga2", dict(loss_type="dapo", beta=BETA)),
    ("llama-shared-ga2", dict(loss_type="grpo", epsilon_high=0.28)),
    ("llama-shared-ga2", dict(loss_type="bnpo", beta=BETA)),
    ("llama-shared-ga2", dict(loss_type="dapo", importance_sampling_level="sequence", epsilon=0.05)),
    ("llama-shared-ga2", dict(loss_type="cispo", epsilon_high=1.1)),
    ("llama-unshared", dict(loss_type="dr_grpo")),
    ("llama-unshared", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, beta=BETA)),
    ("llama-unshared", dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.1, beta=BETA)),
    ("llama-unshared", dict(loss_type="dr_grpo", importance_sampling_level="sequence", epsilon=0.05)),
    ("llama-unshared", dict(loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.05)),
    # TRL 1.16's sapo (soft gate), luspo (per-sequence sums) and vespo (gamma-weighted log-prob)
    ("qwen3-shared", dict(loss_type="sapo", beta=BETA)),
    ("qwen3-unshared", dict(loss_type="sapo", importance_sampling_level="sequence")),
    ("llama-shared-ga2", dict(loss_type="sapo", importance_sampling_level="sequence", beta=BETA)),
    ("llama-unshared", dict(loss_type="sapo")),
    ("qwen3-shared", dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05)),
    ("qwen3-unshared", dict(loss_type="luspo", beta=BETA)),
    ("llama-shared-ga2", dict(loss_type="luspo")),
    ("llama-unshared", dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05, beta=BETA)),
    ("qwen3-shared", dict(loss_type="vespo")),
    ("qwen3-unshared", dict(loss_type="vespo", importance_sampling_level="sequence", beta=BETA)),
    ("llama-shared-ga2", dict(loss_type="vespo", beta=BETA)),
    ("llama-unshared", dict(loss_type="vespo", importance_sampling_level="sequence")),
]


def _case_id(case) -> str:
    layout, objective = case
    return layout + "-" + "-".join(f"{k}={v}" for k, v in objective.items())


# ----------------------------------------------------------------------------- the reference


def _lora_reference(base: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so every adapter tensor gets a gradient
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(base), config)


def _full_logit_logps(model: torch.nn.Module, samples: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Each ``prompt + completion`` alone through the model: log_softmax(logits / T) at the sampled tokens."""
    out = []
    for prompt, completion in samples:
        logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
        predicting = logits[len(prompt) - 1:len(prompt) + len(completion) - 1].double() / TEMPERATURE
        out.append(torch.log_softmax(predicting, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1))
    return out


def _padded(per_sample: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(x) for x in per_sample)
    return torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in per_sample])


def _group_advantages(rewards: list[float]) -> torch.Tensor:
    """DeepSeekMath's outcome advantages, TRL's ``scale_rewards="group"``: (r - mean_g) / (std_g + 1e-4)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


class Reference:
    """The unpatched PEFT model and the rollouts' fixed quantities (old / reference log-probs, advantages)."""

    def __init__(self, model, samples, finished, mask_truncated: bool, micro_batches: int):
        self.model, self.samples, self.micro_batches = model, samples, micro_batches
        lengths = [len(c) for _, c in samples]
        self.mask = torch.zeros(len(samples), max(lengths), dtype=torch.float64)
        for i, n in enumerate(lengths):
            if finished[i] or not mask_truncated:
                self.mask[i, :n] = 1
        self.advantages = _group_advantages(reward(None, None, [c for _, c in samples]))
        assert bool((self.advantages.view(-1, G).abs() > 0.1).any(1).all()), ("a group has zero advantages",
                                                                                 self.advantages)
        with torch.no_grad():
            self.old = _padded(_full_logit_logps(model, samples))
            with model.disable_adapter():
                self.ref = _padded(_full_logit_logps(model, samples))

    def first_step(self) -> dict[str, torch.Tensor]:
        """The update of the first optimizer step over the rollouts: AdamW's first step is
        ``-lr * sign(gradient)`` (here of the on-policy GRPO objective), plus noise so that some ratios
        move against their advantage too (two-sided clipping, CISPO's cap)."""
        self.model.zero_grad(set_to_none=True)
        logp = _padded(_full_logit_logps(self.model, self.samples))
        reference_loss(logp, logp.detach(), self.ref, self.mask, self.advantages, loss_type="grpo").backward()
        g = torch.Generator().manual_seed(7)
        update = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                scale = p.detach().abs().mean()
                noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
                update[name] = scale * (-STEP_LR * p.grad.sign() + STEP_NOISE * noise)
        self.model.zero_grad(set_to_none=True)
        return update

    def step(self, objective: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """The negated objective of the whole optimizer step, its gradients and its scale."""
        self.model.zero_grad(set_to_none=True)
        logp = _padded(_full_logit_logps(self.model, self.samples))
        kw = dict(loss_type=objective["loss_type"], level=objective.get("importance_sampling_level", "token"),
                  eps=objective.get("epsilon", 0.2), delta=objective.get("delta"), beta=objective.get("beta", 0.0),
                  eps_high=objective.get("epsilon_high", 5.0 if objective["loss_type"] == "cispo" else None))
        loss = self._objective(logp, self.old, self.advantages, kw)
        loss.backward()
        # the advantages of a group sum to zero, so the loss can be far below its terms (and fp32's
        # rounding of them): its scale is the same normalised sum with every advantage made positive
        scale = float(self._objective(logp.detach(), logp.detach(), self.advantages.abs(), dict(kw, beta=0.0)).abs())
        self._check_clipping(logp.detach(), kw)
        return loss.detach(), _grads(self.model), scale

    def _objective(self, logp, old, advantages, kw) -> torch.Tensor:
        if kw["loss_type"] == "bnpo":  # TRL: each micro-batch's token mean, averaged over the accumulation
            n = len(self.samples) // self.micro_batches
            parts = [slice(s * n, (s + 1) * n) for s in range(self.micro_batches)]
            return sum(reference_loss(logp[p], old[p], self.ref[p], self.mask[p], advantages[p], **kw)
                       for p in parts) / self.micro_batches
        # grpo, dr_grpo, dapo, cispo, sapo, luspo, vespo: the formulas over every completion of the step
        return reference_loss(logp, old, self.ref, self.mask, advantages, **kw)

    def _check_clipping(self, logp: torch.Tensor, kw: dict) -> None:
        """Clipping decides some (not all) gradients, and no ratio sits on a boundary (where fp32
        rounding of either side could flip it)."""
        if kw["loss_type"] in ("sapo", "vespo"):  # smooth weights: no clip boundary to check
            return
        m = self.mask.bool()
        A = self.advantages[:, None].expand_as(logp)
        if kw["level"] == "sequence":
            ratio = torch.exp(((logp - self.old) * self.mask).sum(1) / self.mask.sum(1).clamp(min=1))
            m, A, ratio = m.any(1), self.advantages, ratio
        else:
            ratio = torch.exp(logp - self.old)
        ratio, A = ratio[m], A[m]
        eps, eps_high = kw["eps"], kw["eps"] if kw["eps_high"] is None else kw["eps_high"]
        if kw["loss_type"] == "cispo":
            bounds, decided = [eps_high], ratio > eps_high
        else:
            bounds = [1 - eps, 1 + eps_high] + ([kw["delta"]] if kw["delta"] else [])
            decided = ((ratio > 1 + eps_high) & (A > 0)) | ((ratio < 1 - eps) & (A < 0))
            if kw["delta"]:
                assert bool(((ratio > kw["delta"]) & (A < 0)).any()), ("the delta cap decides no token", ratio, A)
        assert 0 < int(decided.sum()) < decided.numel(), ("clipping must decide some tokens, not all", ratio, A)
        gap = min(float((ratio - b).abs().min() / b) for b in bounds)
        assert gap > 1e-3, f"a ratio sits within {gap:.1e} of a clip boundary"


# ----------------------------------------------------------------------------- swiftune


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _trainable(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _config(output_dir, share: bool, ga: int, mask_truncated: bool, **objective) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(output_dir), report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
        dataloader_pin_memory=False, per_device_train_batch_size=len(PROMPTS) * G // ga,
        gradient_accumulation_steps=ga, num_generations=G, num_iterations=2, temperature=TEMPERATURE,
        max_completion_length=L_MAX, share_prompt=share, mask_truncated_completions=mask_truncated,
        logit_chunk_tokens=4, **objective,
    )


class Swiftune:
    """A patched LoRA model and the generation a GRPOTrainer made with it before an optimizer step."""

    def __init__(self, base, reference, tokenizer, output_dir, share, ga, mask_truncated):
        model = patch_model(copy.deepcopy(base))  # the defaults: Triton kernels, packed attention
        model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=PROJECTIONS,
                                         use_gradient_checkpointing=False, init_lora_weights=False)
        model.load_state_dict(reference.state_dict())
        assert is_patched(model) and _trainable(model) == _trainable(reference)
        assert controls_attention(causal_lm_of(model))  # the packed policy rows, not the padded fallback
        self.model, self.tokenizer, self.output_dir = model, tokenizer, output_dir
        self.layout, self.ga, self.cases = (share, ga, mask_truncated), ga, 0
        self.inputs = {"prompt_rows": [{"prompt": p} for p in PROMPTS]}
        trainer = self._trainer(beta=BETA)  # beta > 0: the reference pass runs
        for _ in range(ga):  # the first pass over the generation (its optimizer step: Reference.first_step)
            trainer._prepare_inputs(self.inputs)
        self.buffer = trainer._buffer
        assert len(self.buffer) == ga and all(mb.old_logps is not None and mb.ref_logps is not None
                                              for mb in self.buffer)
        assert all((mb.row.layout.seg is not None) == share for mb in self.buffer)  # shared-prompt rows or not
        assert all(mb.row.input_ids.shape[0] == 1 for mb in self.buffer)  # one padding-free row per micro-batch

    def _trainer(self, **objective) -> GRPOTrainer:
        self.cases += 1
        args = _config(self.output_dir / f"run{self.cases}", *self.layout, **objective)
        return GRPOTrainer(self.model, [reward], args=args, train_dataset=self.inputs["prompt_rows"],
                           processing_class=self.tokenizer, rollout_engine=FixedRollouts(self.tokenizer))

    def samples(self) -> tuple[list[tuple[list[int], list[int]]], list[bool]]:
        tok = self.tokenizer
        samples = [(tok(p, add_special_tokens=False)["input_ids"], list(c)) for p in PROMPTS for c in COMPLETIONS[p]]
        return samples, [c[-1] == EOS_TOKEN_ID for _, c in samples]

    def step(self, objective: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The second pass over the generation under ``objective``: a trainer with that GRPOConfig,
        holding the generation (as a resumed run holds its checkpoint's), runs its micro-steps."""
        trainer = self._trainer(**objective)
        trainer._buffer, trainer._micro_step = self.buffer, self.ga
        trainer.current_gradient_accumulation_steps = self.ga  # what Trainer's loop sets for each step
        self.model.zero_grad(set_to_none=True)
        loss = sum(trainer.training_step(self.model, self.inputs) for _ in range(self.ga))
        return loss.detach(), _grads(self.model)


def _apply(update: dict[str, torch.Tensor], models: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for model in models:
            params = dict(model.named_parameters())
            for name, delta in update.items():
                params[name].add_(delta)


def _assert_parity(reference: tuple, got: tuple, trainable: list[str], tol: float = TOL) -> None:
    (ref_loss, ref_grads, scale), (loss, grads) = reference, got
    assert torch.isfinite(loss), loss
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), scale)
    assert loss_err < tol, (float(loss), float(ref_loss), scale)
    assert_gradients_match(ref_grads, grads, trainable, tol)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """Per layout: (the reference, swiftune), both after the optimizer step that follows the rollouts."""
    assert INTERPRETED or torch.cuda.is_available()
    tokenizer = build_tokenizer()
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            family, share, ga, mask_truncated = LAYOUTS[name]
            base = tiny_model(family, num_hidden_layers=1).train()
            reference_model = _lora_reference(base).train()
            ours = Swiftune(base, reference_model, tokenizer, tmp_path_factory.mktemp(name), share, ga, mask_truncated)
            samples, finished = ours.samples()
            reference = Reference(reference_model, samples, finished, mask_truncated, ga)  # old / ref: before the step
            _apply(reference.first_step(), [reference_model, ours.model])
            cache[name] = (reference, ours)
        return cache[name]

    return get


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_policy_step_gradients_equal_the_objective_on_the_unpatched_model(layouts, case, monkeypatch):
    name, objective = case
    reference, ours = layouts(name)
    expected = reference.step(objective)
    calls = {"stats": 0, "grad": 0}  # the fused (Triton) log-prob blocks run, forward and backward
    for attr, key in (("fused_block_stats", "stats"), ("fused_block_grad_", "grad")):
        def spy(*args, _f=getattr(blocks, attr), _k=key, **kwargs):
            calls[_k] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(blocks, attr, spy)
    got = ours.step(objective)
    assert not INTERPRETED or (calls["stats"] > 0 and calls["grad"] > 0), calls
    _assert_parity(expected, got, _trainable(reference.model))


def test_every_objective_is_covered():
    """Each loss_type GRPOConfig accepts, at each importance-sampling level, on both families, and each
    loss_type with and without the KL term, on shared-prompt rows and plain ones."""
    from swiftune.rl.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

    seen = {(LAYOUTS[n][0], o["loss_type"], o.get("importance_sampling_level", "token")) for n, o in CASES}
    assert seen == {(f, t, lv) for f in ("qwen3", "llama") for t in LOSS_TYPES for lv in IMPORTANCE_SAMPLING_LEVELS}
    kl = {(o["loss_type"], bool(o.get("beta"))) for _, o in CASES}
    assert kl == {(t, b) for t in LOSS_TYPES for b in (False, True)}
    assert {LAYOUTS[n][1] for n, _ in CASES} == {True, False}


def test_every_group_has_non_zero_advantages():
    """Every group's rewards differ, so each group's advantages are non-zero and every group's tokens
    enter the policy-gradient term at beta=0; and some group has a later completion with an input token
    of its own after a sibling's (with a non-zero advantage): the token through which a cross-completion
    attention leak in a shared-prompt row changes a log-prob (a tie there once let such a leak pass
    every beta=0 shared-prompt case)."""
    for prompt in PROMPTS:
        rewards = reward(None, None, list(COMPLETIONS[prompt]))
        assert len(set(rewards)) > 1, (prompt, rewards)
        advantages = _group_advantages(rewards)
        assert bool((advantages.abs() > 0.1).all()), (prompt, rewards, advantages)
    exposed = [p for p in PROMPTS if len(COMPLETIONS[p][0]) > 1 and any(len(c) > 1 for c in COMPLETIONS[p][1:])]
    assert exposed, "no completion could attend to a sibling's tokens"


def test_negative_control_parity_catches_a_dropped_lora_gradient(layouts, monkeypatch):
    """The check fails when one LoRA tensor is cut out of the graph (as the q/k bug did)."""
    objective = dict(loss_type="grpo", beta=BETA)
    reference, ours = layouts("qwen3-shared")
    expected = reference.step(objective)
    lora_a = ours.model.base_model.model.model.layers[0].self_attn.k_proj.lora_A["default"]
    # cut on both paths a LoRA layer can take: PEFT's own forward (lora_A's module) and the fused node
    forward = lora_a.forward
    monkeypatch.setattr(lora_a, "forward", lambda x: forward(x).detach())
    apply = LoRALinearFunction.apply

    def cut(x, weight, bias, a, *rest):
        return apply(x, weight, bias, a.detach() if a is lora_a.weight else a, *rest)

    monkeypatch.setattr(LoRALinearFunction, "apply", cut)
    got = ours.step(objective)
    dropped = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight"
    assert dropped not in got[1] and set(expected[1]) - set(got[1]) == {dropped}
    with pytest.raises(AssertionError, match="no gradient where the unpatched model has one"):
        _assert_parity(expected, got, _trainable(reference.model))
