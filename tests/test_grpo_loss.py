"""GRPO objectives, advantages and reward functions against plain float64 references.

The references below are written from the papers' formulas on padded ``[B, T]`` tensors, the
way the papers state them, independently of swiftune.rl.loss (which works on flat per-token
vectors with a sequence index, as packed rows need):

* GRPO (DeepSeekMath, eq. 3):  J = 1/G sum_i 1/|o_i| sum_t [ min(r A, clip(r, 1-e, 1+e) A) - beta D_KL ]
  with D_KL the k3 estimator  pi_ref/pi - log(pi_ref/pi) - 1;
* DAPO (eq. 8): token-level  1/sum_i |o_i| sum_i sum_t min(r A, clip(r, 1-e_low, 1+e_high) A);
* Dr. GRPO: sum_i sum_t min(...) / (B * L_max)  (a constant normaliser);
* bnpo: the DAPO sum over this batch's tokens;
* GSPO: s_i = (pi(o_i)/pi_old(o_i))^(1/|o_i|),  J = 1/G sum_i min(s_i A_i, clip(s_i, 1-e, 1+e) A_i);
* CISPO (MiniMax-M1, eq. 4): J = 1/sum_i |o_i| sum_i sum_t sg(min(r, e_max)) A_i log pi;
* two-sided clipping (delta): the unclipped ratio capped at delta.
"""

import asyncio
import math
import statistics
import time

import pytest
import torch

from swiftune.rl import GRPOConfig
from swiftune.rl.advantages import group_advantages
from swiftune.rl.loss import grpo_loss
from swiftune.rl.rewards import RewardFunctionError, compute_rewards
from tests.helpers import rel_err

# ----------------------------------------------------------------------------- fixtures

LENGTHS = [5, 1, 7, 3, 6, 4]  # completion lengths of B = 6 sequences (two groups of 3)
L_MAX = 8


def padded_inputs(seed: int = 0, spread: float = 0.3):
    """Random padded [B, T] float64 inputs: logp (leaf), old, ref, mask, advantages."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    # old / ref differ from logp by up to +-spread so that some ratios leave [1 - e, 1 + e]
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ref, mask, adv


def flatten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def seq_index(mask: torch.Tensor) -> torch.Tensor:
    return torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)[mask.bool()]


def reference_loss(logp, old, ref, mask, adv, *, loss_type, level="token", eps=0.2, eps_high=None, delta=None,
                   beta=0.0, num_items=None):
    """The papers' objectives (negated) on padded tensors, float64."""
    eps_high = eps if eps_high is None else eps_high
    A = adv[:, None]
    n_i = mask.sum(1)
    if level == "sequence":  # GSPO: length-normalised sequence ratio, the same for every token
        s = torch.exp(((logp - old) * mask).sum(1) / n_i.clamp(min=1))
        ratio = s[:, None].expand_as(logp)
    else:
        ratio = torch.exp(logp - old)
    if loss_type == "cispo":
        term = torch.clamp(ratio, max=eps_high).detach() * A * logp
    elif loss_type == "sapo":  # SAPO: a sigmoid gate, TRL's temperatures 1.0 (A > 0) / 1.05
        tau = torch.where(A > 0, torch.tensor(1.0, dtype=A.dtype), torch.tensor(1.05, dtype=A.dtype))
        term = torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    elif loss_type == "vespo":  # VESPO: gamma weight of the summed sequence log-ratio (TRL's k, lambda), detached
        log_w = ((logp - old).clamp(-20, 20) * mask).sum(1).clamp(math.log(1e-8), 20)
        two, three = torch.tensor(2.0, dtype=adv.dtype), torch.tensor(3.0, dtype=adv.dtype)
        k, lam = torch.where(adv >= 0, two, three), torch.where(adv >= 0, three, two)
        term = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).detach()[:, None] * A * logp
    else:
        unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
        term = torch.min(unclipped * A, torch.clamp(ratio, 1 - eps, 1 + eps_high) * A)
    if beta:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        term = term - beta * kl
    term = term * mask
    B = logp.shape[0]
    if loss_type in ("grpo", "sapo"):
        J = (term.sum(1) / n_i.clamp(min=1)).sum() / B
    elif loss_type == "luspo":  # LUSPO: each sequence's sum, batch mean
        J = term.sum() / B
    elif loss_type == "bnpo":
        J = term.sum() / mask.sum()
    elif loss_type == "dr_grpo":
        J = term.sum() / (B * L_MAX)
    else:  # dapo, cispo, vespo: the whole accumulated batch's token count
        J = term.sum() / (mask.sum() if num_items is None else num_items)
    return -J


CASES = [
    dict(loss_type="grpo"),
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", eps_high=0.28),
    dict(loss_type="dapo", num_items=100.0, beta=0.1),
    dict(loss_type="dapo", delta=1.25),
    dict(loss_type="cispo", eps_high=1.1),
    dict(loss_type="grpo", level="sequence", eps=3e-4, eps_high=4e-4),  # GSPO's own clip range
    dict(loss_type="grpo", level="sequence", eps=0.05),
    dict(loss_type="dapo", level="sequence", beta=0.02),
    dict(loss_type="cispo", level="sequence", eps_high=1.02),
    dict(loss_type="sapo"),
    dict(loss_type="sapo", level="sequence", beta=0.04),
    dict(loss_type="luspo", level="sequence", eps=0.05),
    dict(loss_type="luspo", beta=0.04),
    dict(loss_type="vespo"),
    dict(loss_type="vespo", num_items=100.0, beta=0.1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("with_mask", [False, True], ids=["all", "masked"])
def test_loss_and_grad_match_reference(case, with_mask):
    logp, old, ref, mask, adv = padded_inputs(seed=len(str(case)), spread=0.02 if case.get("eps", 0.2) < 0.01 else 0.3)
    loss_mask = mask.clone()
    if with_mask:  # a "truncated" completion excluded from the loss (still counted in B)
        loss_mask[2] = 0
    expected_leaf = logp.clone().requires_grad_(True)
    expected = reference_loss(expected_leaf, old, ref, loss_mask, adv, **case)
    expected.backward()

    flat = flatten(logp, mask).clone().requires_grad_(True)
    out = grpo_loss(
        flat, flatten(old, mask), adv, seq_index(mask), num_sequences=len(LENGTHS), loss_type=case["loss_type"],
        importance_sampling_level=case.get("level", "token"), epsilon=case.get("eps", 0.2),
        epsilon_high=case.get("eps_high"), delta=case.get("delta"), beta=case.get("beta", 0.0),
        ref_logps=flatten(ref, mask), mask=flatten(loss_mask, mask), max_completion_length=L_MAX,
        num_items_in_batch=case.get("num_items"),
    )
    out.loss.backward()
    assert out.loss.dtype == torch.float64
    assert rel_err(out.loss, expected) < 1e-12, (float(out.loss), float(expected))
    assert rel_err(flat.grad, flatten(expected_leaf.grad, mask)) < 1e-12
    assert flat.grad.abs().sum() > 0
    if case.get("beta"):
        assert out.kl is not None and float(out.kl) > 0
    # some ratios really were clipped (the clipping branch is exercised)
    if case["loss_type"] in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") and case.get("level", "token") == "token":
        assert 0 < float(out.clip_region) < 1


def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient():
    """old = logp.detach(): ratio 1, and the grpo gradient is -A_i / (B |o_i|) per token."""
    logp, _, _, mask, adv = padded_inputs(seed=3)
    flat = flatten(logp, mask).clone().requires_grad_(True)
    idx = seq_index(mask)
    out = grpo_loss(flat, None, adv, idx, loss_type="grpo")
    out.loss.backward()
    n_i = mask.sum(1)
    expected = -(adv / (len(LENGTHS) * n_i))[idx]
    assert rel_err(flat.grad, expected) < 1e-12
    assert float(out.clip_region) == 0


def test_packed_token_order_does_not_matter():
    """The flat layout may interleave sequences (shared-prompt rows): only seq_index matters."""
    logp, old, ref, mask, adv = padded_inputs(seed=5)
    flat, flat_old, flat_ref, idx = flatten(logp, mask), flatten(old, mask), flatten(ref, mask), seq_index(mask)
    perm = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"):
        for level in ("token", "sequence"):
            kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, max_completion_length=L_MAX)
            a = grpo_loss(flat, flat_old, adv, idx, ref_logps=flat_ref, **kw).loss
            b = grpo_loss(flat[perm], flat_old[perm], adv, idx[perm], ref_logps=flat_ref[perm], **kw).loss
            assert rel_err(b, a) < 1e-12


def test_config_validation():
    base = dict(output_dir="/tmp/unused", report_to="none")
    assert GRPOConfig(**base, loss_type="cispo").epsilon_high == 5.0
    assert GRPOConfig(**base, epsilon=0.3).epsilon_high == 0.3
    assert GRPOConfig(**base, num_generations=4).share_prompt is True
    cfg = GRPOConfig(**base, gradient_accumulation_steps=3, per_device_train_batch_size=4, num_generations=4)
    assert cfg.steps_per_generation == 3 and cfg.prompts_per_generation == 3
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(**base, loss_type="ppo")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        GRPOConfig(**base, per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ValueError, match="delta"):
        GRPOConfig(**base, delta=1.1)
    assert GRPOConfig(**base, scale_rewards="false").scale_rewards == "none"


# ----------------------------------------------------------------------------- advantages

def _py_std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_group_advantages(mode):
    rewards = [0.0, 1.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0]
    G = 4
    got, group_std = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, mode)
    all_std = _py_std(rewards)
    for i, r in enumerate(rewards):
        grp = rewards[(i // G) * G:(i // G + 1) * G]
        centred = r - statistics.fmean(grp)
        want = {"group": centred / (_py_std(grp) + 1e-4), "batch": centred / (all_std + 1e-4), "none": centred}[mode]
        assert math.isclose(float(got[i]), want, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(float(group_std[i]), _py_std(grp), rel_tol=1e-12)
    assert torch.all(got[4:8] == 0)  # a group with equal rewards learns nothing


# ----------------------------------------------------------------------------- rewards

PROMPTS = ["p0", "p0", "p1", "p1"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]
IDS = [[1], [2, 2], [3, 3, 3], [4, 4, 4, 4]]


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_rewards_weighted_with_none_and_columns():
    def maybe(prompts, completions, completion_ids, answer, **kwargs):
        assert completion_ids == IDS and "trainer_state" in kwargs
        return [None if a == "skip" else 1.0 for a in answer]

    rewards, per_func = compute_rewards([length_reward, maybe], PROMPTS, COMPLETIONS, IDS,
                                        {"answer": ["x", "skip", "y", "skip"]}, weights=[0.5, 2.0],
                                        group_size=2, trainer_state=None)
    assert per_func.shape == (4, 2) and torch.isnan(per_func[1, 1]) and torch.isnan(per_func[3, 1])
    assert rewards.tolist() == [0.5 + 2.0, 1.0, 1.5 + 2.0, 2.0]


@pytest.mark.parametrize("bad, message", [
    (lambda prompts, completions, **kw: [1.0] * 3, r"'bad_reward' returned 3 values for 4 completions"),
    (lambda prompts, completions, **kw: [1.0, "high", 0.0, 1.0], r"'bad_reward' returned a non-number for row 1"),
    (lambda prompts, completions, **kw: [1.0, 0.0, float("nan"), 1.0], r"'bad_reward' returned nan for row 2"),
    (lambda prompts, completions, **kw: [1.0, 0.0, 0.0, float("inf")], r"'bad_reward' returned inf for row 3"),
    (lambda prompts, completions, **kw: 1.0, r"'bad_reward' returned float"),
])
def test_reward_errors_name_function_and_row(bad, message):
    bad.__name__ = "bad_reward"
    with pytest.raises(RewardFunctionError, match=message):
        compute_rewards([length_reward, bad], PROMPTS, COMPLETIONS, IDS)


def test_reward_error_names_group_position():
    def bad_reward(prompts, completions, **kw):
        return [0.0, 0.0, 0.0, float("nan")]

    with pytest.raises(RewardFunctionError, match=r"row 3 \(completion 1 of prompt 1\)"):
        compute_rewards([bad_reward], PROMPTS, COMPLETIONS, IDS, group_size=2)


def test_async_reward_functions_run_concurrently():
    """Two async functions that each wait for the other: they finish only if run concurrently."""
    state = {}

    async def ping(prompts, completions, **kw):
        state["ping"] = asyncio.Event() if "ping" not in state else state["ping"]
        state.setdefault("pong", asyncio.Event())
        state["ping"].set()
        await asyncio.wait_for(state["pong"].wait(), timeout=5)
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def pong(prompts, completions, **kw):
        state.setdefault("ping", asyncio.Event())
        state.setdefault("pong", asyncio.Event())
        state["pong"].set()
        await asyncio.wait_for(state["ping"].wait(), timeout=5)
        await asyncio.sleep(0.3)
        return [float(len(c)) for c in completions]

    t0 = time.perf_counter()
    rewards, per_func = compute_rewards([ping, length_reward, pong], PROMPTS, COMPLETIONS, IDS)
    assert time.perf_counter() - t0 < 0.55  # the two 0.3 s sleeps overlapped
    assert per_func[:, 0].tolist() == [1.0] * 4
    assert rewards.tolist() == [1 + 2 * n for n in (1, 2, 3, 4)]


def test_async_reward_error_is_reported():
    async def bad_async(prompts, completions, **kw):
        return [0.0]

    with pytest.raises(RewardFunctionError, match="'bad_async' returned 1 values"):
        compute_rewards([bad_async], PROMPTS, COMPLETIONS, IDS)
