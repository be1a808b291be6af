"""A TRL 1.16 GRPO user changes imports only: GRPOConfig's fields and defaults, refusals at
construction, the new loss types against a plain-PyTorch formula on full logits (loss and LoRA
gradients), and the metric names and values of a short run computed here from the rollouts.

The TRL values below were read from trl 1.16.0's grpo_config.py / grpo_trainer.py.
"""

import copy
import math
import warnings

import pytest
import torch

from swiftune.data import build_tokenizer
from swiftune.errors import ConfigError
from swiftune.models import patch_model
from swiftune.rl import GRPOConfig, GRPOTrainer, build_policy_row, completion_logprobs, grpo_loss
from swiftune.rl.grpo_metrics import generation_metrics
from swiftune.rl.loss import high_entropy_mask
from tests.helpers import rel_err
from tests.test_grpo import FAST, PROMPT_ROWS, FixedEngine, add_lora, random_groups, tiny_model

# TRL 1.16 GRPOConfig defaults of fields beyond TrainingArguments (a selection covering every group)
TRL_DEFAULTS = dict(
    num_generations=8, num_generations_eval=None, max_completion_length=512, temperature=1.0, top_p=1.0, min_p=None,
    top_k=0,
    generation_kwargs=None, chat_template_kwargs=None, repetition_penalty=1.0, use_vllm=False, vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.3, beta=0.0, num_iterations=1, epsilon=0.2, delta=None, epsilon_high=None,
    sapo_temperature_neg=1.05, sapo_temperature_pos=1.0, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
    vespo_lambda_neg=2.0, importance_sampling_level="token", reward_weights=None,
    multi_objective_aggregation="sum_then_normalize", scale_rewards="group", loss_type="dapo",
    mask_truncated_completions=False, sync_ref_model=False, ref_model_mixup_alpha=0.6, ref_model_sync_steps=512,
    top_entropy_quantile=1.0, entropy_coef=0.0, log_completions=False, num_completions_to_print=None,
    disable_dropout=False, cast_lm_head_to_fp32=False, model_init_kwargs=None, shuffle_dataset=True,
    learning_rate=1e-6, remove_unused_columns=False, steps_per_generation=None, generation_batch_size=None,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_trl_fields_exist_with_trls_defaults(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8)
    for name, value in TRL_DEFAULTS.items():
        if name in ("steps_per_generation", "epsilon_high"):  # derived at construction, as in TRL
            continue
        assert getattr(args, name) == value, name
    assert args.steps_per_generation == 1 and args.epsilon_high == 0.2
    assert args.max_prompt_length is None  # TRL 1.16 truncates no prompt


@pytest.mark.parametrize("field, value, needle", [
    ("use_vllm", True, "own rollout engine"), ("loss_type", "ppo", "sapo, luspo, vespo"),
    ("repetition_penalty", 0.0, "> 0"), ("generation_kwargs", {"num_beams": 2}, "num_beams"),
    ("generation_kwargs", {"temperature": 0.5}, "set temperature"),
    ("generation_kwargs", {"max_new_tokens": 9}, "max_completion_length"),
    ("multi_objective_aggregation", "max", "normalize_then_sum"), ("entropy_coef", 0.1, "entropy bonus"),
    ("top_entropy_quantile", 0.0, "top_entropy_quantile"), ("pad_to_multiple_of", 64, "padding-free"),
    ("sync_ref_model", True, "beta"),
])
def test_unsupported_values_are_refused_at_construction(tmp_path, field, value, needle):
    with pytest.raises(ConfigError, match=field) as err:
        GRPOConfig(output_dir=str(tmp_path), report_to="none", **{field: value})
    assert needle in str(err.value)


def test_fields_without_effect_warn_once_and_generation_kwargs_override(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_server_port=9000)
    assert [str(w.message) for w in caught if "vllm_server_port" in str(w.message)].__len__() == 1
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", top_p=1.0, generation_kwargs={"top_p": 0.9})
    assert args.top_p == 0.9
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", repetition_penalty=1.1,
                      generation_kwargs={"repetition_penalty": 1.3, "do_sample": True})
    assert args.repetition_penalty == 1.3


def _full_logits_logps(model, prompts, completions):
    """Padded per-sample reference: the model's full logits, log_softmax, the sampled token."""
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) + len(c) - 1].double()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def _reference_loss(logps, old, adv, ref, loss_type, beta, rho_mask, bias_kl):
    """TRL 1.16's formulas, sequence by sequence (lists of [T_i] tensors)."""
    per_seq, tokens = [], 0
    for i, lp in enumerate(logps):
        lr = lp - old[i]
        r, a = torch.exp(lr), float(adv[i])
        if loss_type == "sapo":
            tau = 1.0 if a > 0 else 1.05
            term = -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * a
        elif loss_type == "vespo":
            log_w = min(max(float(torch.clamp(lr, -20, 20).sum()), math.log(1e-8)), 20.0)
            k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
            term = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * a * lp
        else:
            term = -torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a)
        term = term * rho_mask[i]
        if beta:
            d = ref[i] - lp
            kl = torch.exp(d) - d - 1
            term = term + beta * (kl * r if bias_kl else kl)
        per_seq.append(term)
        tokens += len(lp)
    if loss_type == "sapo":
        return sum(t.mean() for t in per_seq) / len(per_seq)
    if loss_type == "luspo":
        return sum(t.sum() for t in per_seq) / len(per_seq)
    return sum(t.sum() for t in per_seq) / tokens  # vespo: dapo normalisation, one micro-batch


@pytest.mark.parametrize("loss_type, beta, rho, bias_kl", [
    ("sapo", 0.0, 1.0, False), ("luspo", 0.1, 0.5, True), ("vespo", 0.1, 1.0, False),
])
def test_new_loss_types_equal_the_full_logits_formula(loss_type, beta, rho, bias_kl):
    prompts, completions = random_groups(seed=3)
    ref_model = add_lora(tiny_model(seed=21, patch=False))
    model = copy.deepcopy(ref_model)
    patch_model(model, attention="reference", kernel_backend="reference")
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(len(prompts), generator=g)
    row = build_policy_row(prompts, completions, share_prompt=True, group_ids=[i // 3 for i in range(len(prompts))])
    logps, entropy = completion_logprobs(model, row, return_entropy=True, kernel_backend="reference")
    old = logps.detach() + 0.3 * torch.randn(logps.shape, generator=g)  # ratios away from 1: clipping acts
    ref = logps.detach() + 0.2 * torch.randn(logps.shape, generator=g)
    ent_mask = high_entropy_mask(entropy.detach(), torch.ones_like(logps), rho)
    out = grpo_loss(logps, old, adv, row.seq_index, loss_type=loss_type, beta=beta, ref_logps=ref,
                    entropy_mask=ent_mask if rho < 1 else None, kl_bias_correction=bias_kl)
    out.loss.backward()

    want_logps = _full_logits_logps(ref_model, prompts, completions)
    split = [len(c) for c in completions]
    olds, refs = old.double().split(split), ref.double().split(split)
    ent = entropy.detach().double()
    if rho < 1:  # the quantile computed here from the entropies of every token
        thr = torch.quantile(ent, 1 - rho)
        rho_mask = (ent >= thr).double().split(split)
        assert 0 < float((ent >= thr).double().mean()) < 1
    else:
        rho_mask = [torch.ones(n, dtype=torch.float64) for n in split]
    want = _reference_loss(want_logps, olds, adv.double(), refs, loss_type, beta, rho_mask, bias_kl)
    want.backward()
    assert abs(float(out.loss) - float(want)) < 1e-5 * max(1.0, abs(float(want)))
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    exp = {n: p.grad for n, p in ref_model.named_parameters() if p.requires_grad}
    assert got and set(got) == set(exp)
    for n in exp:
        assert exp[n] is not None and exp[n].abs().max() > 0, n
        assert rel_err(got[n], exp[n]) < 1e-4, n


def test_clip_min_max_are_the_extremes_of_per_completion_shares():
    g = torch.Generator().manual_seed(1)
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    logps = torch.randn(9, generator=g)
    old = logps + 0.4 * torch.randn(9, generator=g)
    adv = torch.tensor([1.0, -1.0, 1.0])
    m = grpo_loss(logps, old, adv, seq_index, loss_type="grpo").metrics("grpo")
    r = torch.exp(logps - old)
    a = adv[seq_index]
    low = ((r < 0.8) & (a < 0)).float()
    high = ((r > 1.2) & (a > 0)).float()
    shares = lambda x: [float(x[seq_index == i].mean()) for i in range(3)]  # noqa: E731
    assert m["clip_ratio/low_min"] == pytest.approx(min(shares(low)))
    assert m["clip_ratio/high_max"] == pytest.approx(max(shares(high)))
    assert m["clip_ratio/low_mean"] == pytest.approx(float(low.mean()))
    assert m["clip_ratio/region_mean"] == pytest.approx(float((low + high).mean()))


def logging_reward(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("custom/first_len", float(len(completion_ids[0])))
    log_extra("n_tokens", [len(c) for c in completion_ids])
    return [float(len(c)) / 4 for c in completion_ids]


def test_short_run_logs_trls_metrics_with_values_from_the_rollouts(tokenizer, tmp_path, capsys):
    G, B = 4, 8
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=B, num_generations=G,
                      max_completion_length=8, beta=0.1, log_completions=True, num_completions_to_print=3,
                      per_device_eval_batch_size=4, num_generations_eval=2, learning_rate=1e-2, **FAST)
    trainer = GRPOTrainer(add_lora(tiny_model(seed=4)), [logging_reward], args=args, train_dataset=PROMPT_ROWS,
                          eval_dataset=PROMPT_ROWS[:2], processing_class=tokenizer, rollout_engine=FixedEngine())
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    # the same completions, recomputed here (FixedEngine is deterministic; the sampler's prompts are logged)
    rows = [trainer.train_dataset[i] for i in next(iter(trainer.get_train_dataloader().batch_sampler))]
    ids = [trainer.tokenize_prompt(r["prompt"]) for r in rows]
    comps = FixedEngine().generate(ids, G, type("P", (), {"max_tokens": 8})()).completion_ids
    lengths = torch.tensor([len(c) for c in comps], dtype=torch.float64)
    done = torch.tensor([g % 3 != 0 for _ in rows for g in range(G)])
    rewards = lengths / 4
    assert log["completions/mean_length"] == pytest.approx(float(lengths.mean()))
    assert log["completions/min_length"] == float(lengths.min()) and log["completions/max_length"] == lengths.max()
    assert log["completions/clipped_ratio"] == pytest.approx(float((~done).double().mean()))
    assert log["completions/mean_terminated_length"] == pytest.approx(float(lengths[done].mean()))
    assert log["completions/max_terminated_length"] == float(lengths[done].max())
    assert log["reward"] == pytest.approx(float(rewards.mean()))
    assert log["reward_std"] == pytest.approx(float(rewards.std()))  # TRL 1.16: the batch's std
    assert log["rewards/logging_reward/std"] == pytest.approx(float(rewards.std()))
    zero = [float(grp.std()) == 0 for grp in rewards.view(-1, G)]
    assert log["frac_reward_zero_std"] == pytest.approx(sum(zero) / len(zero))
    prompt_tokens = sum(len(p) for p in ids) * G
    assert log["num_tokens"] == prompt_tokens + float(lengths.sum())
    assert log["custom/first_len"] == len(comps[0])  # log_metric from the reward function
    for key in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_max",
                "clip_ratio/region_mean", "tokens_per_s", "padding_fraction", "completion_length"):
        assert isinstance(log[key], float) and math.isfinite(log[key]), key
    assert log["tokens_per_s"] > 0  # in the Trainer's log: every integration receives it
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "n_tokens" in text and "Advantage" in text and "trained 1 steps" in text

    metrics = trainer.evaluate()
    for key in ("eval_loss", "eval_reward", "eval_reward_std", "eval_completions/mean_length", "eval_entropy",
                "eval_kl", "eval_clip_ratio/region_mean", "eval_custom/first_len"):
        assert key in metrics and math.isfinite(metrics[key]), key
    ev_ids = [trainer.tokenize_prompt(r["prompt"]) for r in PROMPT_ROWS[:2]]
    ev = FixedEngine().generate(ev_ids, 2, type("P", (), {"max_tokens": 8})()).completion_ids
    assert metrics["eval_completions/mean_length"] == pytest.approx(sum(map(len, ev)) / len(ev))  # G_eval = 2


def test_chat_template_kwargs_from_config_and_row(tokenizer, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, chat_template_kwargs={"flag": "config"}, **FAST)
    rows = [{"prompt": [{"role": "user", "content": "hi"}]} for _ in range(4)]
    trainer = GRPOTrainer(tiny_model(seed=5), [logging_reward], args=args, train_dataset=rows,
                          processing_class=tokenizer, rollout_engine=FixedEngine())
    seen = []
    real = tokenizer.apply_chat_template

    def spy(*a, **k):
        seen.append(k.get("flag"))
        return real(*a, **{key: v for key, v in k.items() if key != "flag"})

    tokenizer.apply_chat_template = spy
    try:
        trainer.tokenize_prompt(rows[0]["prompt"])
        trainer.tokenize_prompt(rows[0]["prompt"], {"flag": "row"})
    finally:
        del tokenizer.apply_chat_template
    assert seen == ["config", "row"]


def test_a_prompt_longer_than_max_prompt_length_keeps_its_end_and_is_said_once(tokenizer, tmp_path, caplog):
    """TRL's cut (the last max_prompt_length tokens) with a warning, once a run, naming the lengths and what to
    change; prompts that fit are untouched and say nothing."""
    import logging

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_prompt_length=3, **FAST)
    trainer = GRPOTrainer(tiny_model(seed=5), [logging_reward], args=args, train_dataset=PROMPT_ROWS,
                          processing_class=tokenizer, rollout_engine=FixedEngine())
    text = "a b c d e f"
    whole = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(whole) > 3
    with caplog.at_level(logging.WARNING, logger="swiftune.rl.trainer"):
        assert trainer.tokenize_prompt("a") == list(tokenizer("a", add_special_tokens=False)["input_ids"])
        assert not caplog.records
        assert trainer.tokenize_prompt(text) == whole[-3:] and trainer.tokenize_prompt(text) == whole[-3:]
    (record,) = caplog.records
    assert f"a prompt of {len(whole)} tokens is longer than max_prompt_length=3" in record.getMessage()
    assert "set it to None" in record.getMessage()


def test_disable_dropout_and_model_init_kwargs(tokenizer, tmp_path):
    model = tiny_model(seed=6)
    model.model.layers[0].self_attn.some_dropout = torch.nn.Dropout(0.3)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, disable_dropout=True, **FAST)
    GRPOTrainer(model, [logging_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer,
                rollout_engine=FixedEngine())
    assert model.model.layers[0].self_attn.some_dropout.p == 0
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      model_init_kwargs={"dtype": "float32"}, **FAST)
    with pytest.raises(ValueError, match="model_init_kwargs"):
        GRPOTrainer(tiny_model(seed=6), [logging_reward], args=args, train_dataset=PROMPT_ROWS,
                    processing_class=tokenizer, rollout_engine=FixedEngine())


def test_generation_metrics_skip_none_rewards():
    per_func = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [3.0, 2.0], [5.0, 0.0]])
    m = generation_metrics(per_func, [1.0, 0.5], ["a", "b"], torch.tensor([3.0, 4.0, 5.0, 6.0]),
                           torch.tensor([False, True, False, False]), group_size=2)
    combined = torch.tensor([1.0, 4.0, 5.0])  # the all-None row left out
    assert m["reward"] == pytest.approx(float(combined.mean()))
    assert m["reward_std"] == pytest.approx(float(combined.std()))
    assert m["rewards/b/mean"] == pytest.approx(1.0) and m["completions/min_terminated_length"] == 3.0


def test_normalize_then_sum_against_the_formula():
    from statistics import mean, stdev

    from swiftune.rl.aggregation import normalize_then_sum

    per_func = torch.tensor([[1.0, 10.0], [2.0, 30.0], [4.0, math.nan], [0.0, 20.0], [5.0, 25.0], [6.0, 10.0]])
    w = [1.0, 0.5]
    adv, _ = normalize_then_sum(per_func, w, group_size=3)
    s = [0.0] * 6
    for g in range(2):
        for f in range(2):
            vals = [float(per_func[i, f]) for i in range(3 * g, 3 * g + 3) if not math.isnan(per_func[i, f])]
            mu, sd = mean(vals), stdev(vals)
            for i in range(3 * g, 3 * g + 3):
                if not math.isnan(per_func[i, f]):
                    s[i] += w[f] * (float(per_func[i, f]) - mu) / (sd + 1e-4)
    want = [(x - mean(s)) / (stdev(s) + 1e-4) for x in s]
    assert adv.tolist() == pytest.approx(want, rel=1e-5)


def test_sync_ref_model_mixes_the_policy_into_the_reference(tokenizer, tmp_path):
    from swiftune.rl.trl_runtime import sync_reference

    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sync_reference(policy, ref, 0.6)
    for n, p in ref.named_parameters():
        assert torch.allclose(p, 0.6 * dict(policy.named_parameters())[n] + 0.4 * before[n])
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                      learning_rate=1e-2, **FAST)
    model = tiny_model(seed=7)
    trainer = GRPOTrainer(model, [logging_reward], args=args, train_dataset=PROMPT_ROWS, processing_class=tokenizer,
                          rollout_engine=FixedEngine())
    start = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.ref_model.named_parameters() if not torch.equal(p, start[n])]
    assert moved  # the frozen copy followed the policy
    with pytest.raises(ValueError, match="sync_ref_model"):
        GRPOTrainer(add_lora(tiny_model(seed=7)), [logging_reward], args=args, train_dataset=PROMPT_ROWS,
                    processing_class=tokenizer, rollout_engine=FixedEngine())


def test_cast_lm_head_to_fp32_computes_the_head_in_float32(tokenizer, tmp_path, monkeypatch):
    import swiftune.rl.policy as policy

    seen = []
    real = policy.selective_log_softmax
    monkeypatch.setattr(policy, "selective_log_softmax",
                        lambda hidden, weight, *a, **k: seen.append((hidden.dtype, weight.dtype)) or real(
                            hidden, weight, *a, **k))
    model = tiny_model(seed=2).to(torch.bfloat16)
    prompts, completions = random_groups(seed=1)
    for cast in (False, True):
        args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          cast_lm_head_to_fp32=cast, **FAST)
        trainer = GRPOTrainer(model, [logging_reward], args=args, train_dataset=PROMPT_ROWS * 2,
                              processing_class=tokenizer, rollout_engine=FixedEngine())
        # the trainer places the model (CUDA where there is one): the row goes where the model is
        row = build_policy_row(prompts, completions, device=trainer.model.device)
        trainer._logps(trainer.model, row)
    assert seen == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


def test_top_entropy_quantile_reaches_the_trainers_loss(tokenizer, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, **FAST)
    trainer = GRPOTrainer(tiny_model(seed=8), [logging_reward], args=args, train_dataset=PROMPT_ROWS,
                          processing_class=tokenizer, rollout_engine=FixedEngine())
    mb = trainer._generate_and_score(PROMPT_ROWS[:2])[0]
    logps, entropy = trainer._logps(trainer.model, mb.row, entropy=True)
    full = float(trainer.compute_loss(trainer.model, mb))
    trainer.args.top_entropy_quantile = 0.3
    kept = float(trainer.compute_loss(trainer.model, mb))
    keep = high_entropy_mask(entropy.detach(), mb.token_mask, 0.3)
    want = grpo_loss(logps.detach(), None, mb.advantages, mb.row.seq_index, entropy_mask=keep,
                     num_items_in_batch=mb.num_items_in_batch).loss * trainer.args.gradient_accumulation_steps
    assert kept != full and kept == pytest.approx(float(want), rel=1e-6, abs=1e-9)


def test_completions_table_without_rich_is_plain_text(monkeypatch):
    import io
    import sys

    from swiftune.rl.completions_log import completion_rows, print_completions

    header, rows = completion_rows(["p1", "p1", "p2"], ["c1", "c2", "c3"], {"len": [1.0, 2.0, 3.0]},
                                   [0.5, -0.5, 0.0], {"src": ["a", "b", "c"]}, num=None, unique_prompts=True)
    assert header == ["Prompt", "Completion", "len", "Advantage", "src"]
    assert [r[:2] for r in rows] == [["p1", "c1"], ["p2", "c3"]]  # one row per distinct prompt
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails as without rich
    out = io.StringIO()
    print_completions(7, header, rows, file=out)
    text = out.getvalue().splitlines()
    assert text[0] == "Step 7" and text[1].split(" | ")[0].strip() == "Prompt"
    assert [line.split(" | ")[1].strip() for line in text[3:]] == ["c1", "c3"]


# ---------------------------------------------------------------- repetition penalty (transformers' semantics)

def _history(rows, vocab, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g)  # repeats on purpose: vocab is small


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_processor(penalty):
    """The seen-mask penalty equals transformers' RepetitionPenaltyLogitsProcessor on the same ids, bit for bit."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from swiftune.rl.rollout.sampling import apply_repetition_penalty, mark_seen, seen_mask

    rows, vocab = 5, 40
    ids = _history(rows, vocab, 12, seed=0)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3  # both signs
    seen = seen_mask(ids[:, :-1].tolist(), vocab, "cpu")
    mark_seen(seen, ids[:, -1])  # the last column as if just sampled
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = apply_repetition_penalty(logits, seen, penalty)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_penalty_then_warpers_in_generates_order():
    """Sampled log-probs are under transformers' processor chain: penalty, temperature, top-k, top-p, min-p."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from swiftune.rl.rollout import sample_tokens
    from swiftune.rl.rollout.sampling import seen_mask

    rows, vocab, temp, penalty = 6, 30, 0.7, 1.5
    ids = _history(rows, vocab, 8, seed=2)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g) * 2
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temp),
                                 TopKLogitsWarper(8), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)])
    ref = torch.log_softmax(chain(ids, logits.clone()).double(), dim=-1)
    seen = seen_mask(ids.tolist(), vocab, "cpu")
    for _ in range(20):
        tok, lp = sample_tokens(logits, torch.rand(rows, vocab, generator=g), temp, 8, 0.9, 0.05,
                                seen=seen, repetition_penalty=penalty)
        want = ref.gather(1, tok[:, None]).squeeze(1)
        assert torch.isfinite(want).all()  # drawn inside transformers' kept set
        assert rel_err(lp.double(), want) < 1e-6
    # greedy: the arg-max of the penalised logits, log-prob at temperature 1
    tok, lp = sample_tokens(logits, None, 0.0, seen=seen, repetition_penalty=penalty)
    pen = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(tok, pen.argmax(-1))
    assert rel_err(lp.double(), torch.log_softmax(pen.double(), -1).gather(1, tok[:, None]).squeeze(1)) < 1e-6


@pytest.mark.parametrize("engine_kind, family", [("fast", "qwen3"), ("fast", "llama"), ("transformers", "qwen3")])
def test_greedy_with_penalty_equals_transformers_generate(tokenizer, engine_kind, family):
    """Greedy decoding with repetition_penalty from the built-in engines equals transformers'
    generate(repetition_penalty=p, do_sample=False) on the unpatched model, token for token."""
    from transformers import AutoModelForCausalLM

    from swiftune.data import tiny_model_config
    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams, TransformersRolloutEngine

    torch.manual_seed(11)
    ref = AutoModelForCausalLM.from_config(tiny_model_config(family), dtype=torch.float32).eval()
    model = copy.deepcopy(ref)
    patch_model(model, attention="reference", kernel_backend="reference")
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abcabc\n", "Sort the letters: garden\n", "Hi\n")]
    n, pad = 16, tokenizer.pad_token_id
    if engine_kind == "fast":  # CPU: the eager form of the decode step the GPU replays as a CUDA graph
        engine = FastRolloutEngine(model, pad_token_id=pad, kv_bucket=4, check_every=3)
    else:
        engine = TransformersRolloutEngine(model, pad_token_id=pad)
    plain = engine.generate(prompts, 2, SamplingParams(max_tokens=n, temperature=0))
    out = engine.generate(prompts, 2, SamplingParams(max_tokens=n, temperature=0, repetition_penalty=1.8))
    changed = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                            repetition_penalty=1.8, pad_token_id=pad)[0, len(p):].tolist()
        assert len(want) == n
        assert out.completion_ids[2 * i] == want and out.completion_ids[2 * i + 1] == want, (i, family)
        changed += plain.completion_ids[2 * i] != want
    assert changed  # the penalty changes what greedy decoding emits


@pytest.mark.parametrize("engine_kind", ["fast", "transformers"])
def test_sampled_logprobs_with_penalty_equal_the_processed_forward(tokenizer, engine_kind):
    """Sampling with a penalty, rows finishing at stop tokens and leaving the batch: each recorded log-prob
    equals transformers' penalty + temperature applied to a plain forward over the produced sequence."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from swiftune.rl.rollout import FastRolloutEngine, SamplingParams, TransformersRolloutEngine

    model = tiny_model(seed=12).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("Reverse: abcabc\n", "Hi\n")]
    pad, temp, penalty = tokenizer.pad_token_id, 0.9, 1.4
    if engine_kind == "fast":
        engine = FastRolloutEngine(model, pad_token_id=pad, seed=5, kv_bucket=4, check_every=2)
    else:
        engine = TransformersRolloutEngine(model, pad_token_id=pad, seed=5)
    stops = list(range(60, 120))  # many stop tokens: rows end at different steps
    out = engine.generate(prompts, 4, SamplingParams(max_tokens=12, temperature=temp, repetition_penalty=penalty,
                                                     stop_token_ids=stops))
    assert any(out.finished) and len({len(c) for c in out.completion_ids}) > 1
    if engine_kind == "fast":
        assert engine.stats.get("compactions", 0) >= 1
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (c, lp) in enumerate(zip(out.completion_ids, out.logprobs)):
        p = prompts[i // 4]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        want = []
        for t in range(len(c)):
            scores = processor(ids[:, :len(p) + t], logits[None, len(p) + t - 1].clone())[0] / temp
            want.append(torch.log_softmax(scores.double(), -1)[c[t]])
        assert rel_err(lp.double(), torch.stack(want)) < 1e-5, i


def test_trainer_samples_with_the_configs_penalty(tokenizer, tmp_path):
    seen = []

    class RecordingEngine(FixedEngine):
        def generate(self, prompt_ids, num_generations, params):
            seen.append(params.repetition_penalty)
            return super().generate(prompt_ids, num_generations, params)

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, generation_kwargs={"repetition_penalty": 1.25}, **FAST)
    trainer = GRPOTrainer(tiny_model(seed=8), [lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=PROMPT_ROWS, processing_class=tokenizer, rollout_engine=RecordingEngine())
    trainer._generate_and_score(PROMPT_ROWS[:2])
    assert seen == [1.25]


def test_one_completion_a_prompt_counts_as_no_spread():
    """num_generations_eval=1: TRL 1.16 gives each single completion a reward std of 0, so
    frac_reward_zero_std is 1.0 (the Bessel std of one value is NaN, which counted as 0.0)."""
    from swiftune.rl.grpo_metrics import zero_std_fraction

    rewards = torch.tensor([0.5, 1.0, 0.0, 2.0])
    assert zero_std_fraction(rewards, 1, False) == 1.0
    assert zero_std_fraction(rewards, 2, False) == 0.0
    assert zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2, False) == 0.5


def test_reward_columns_are_those_of_every_row():
    """Rows given as plain dicts may differ in their columns: a column one row lacks reaches the reward
    functions as None there (the first row's keys decided: a later row without one raised KeyError, a
    column only later rows had was not passed at all)."""
    from swiftune.rl.batching import reward_columns

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "images": ["x.png"]}]
    assert reward_columns(rows, 2) == {"answer": ["1", "1", None, None],
                                       "images": [None, None, ["x.png"], ["x.png"]]}


class _Loaded(Exception):
    """Raised by the stand-in loader: the keywords a model path would have been loaded with."""


def _loader_that_records(monkeypatch):
    import swiftune

    def from_pretrained(name, **kwargs):
        raise _Loaded(kwargs)

    monkeypatch.setattr(swiftune.FastModel, "from_pretrained", from_pretrained)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize("arguments, needle", [
    (dict(reward_funcs="some/reward-model"), "wrap it in a function"),
    (dict(reward_funcs=[_reward, torch.nn.Linear(2, 1)]), "wrap it in a function"),
    (dict(reward_processing_classes=[object()]), "leave reward_processing_classes=None"),
    (dict(tools=[_reward]), "tools=None"), (dict(rollout_func=lambda prompts, trainer: {}), "rollout_engine="),
    (dict(environment_factory=object), "environment_factory=None"),
])
def test_trls_trainer_arguments_without_counterpart_are_refused_before_loading(tmp_path, monkeypatch, arguments,
                                                                                needle):
    """TRL 1.16's GRPOTrainer takes reward models (by name or as modules) with their tokenizers, tools, a
    rollout function and environments; swiftune runs none of them, and says so before loading the model
    (a reward model passed the callable check and failed at the first reward; the others were a TypeError
    from transformers' Trainer after the model loaded)."""
    _loader_that_records(monkeypatch)
    arguments = {"reward_funcs": _reward, **arguments}
    with pytest.raises(ConfigError, match=needle):
        GRPOTrainer(model="some/model", args=GRPOConfig(output_dir=str(tmp_path), report_to="none"),
                    train_dataset=PROMPT_ROWS, **arguments)


def test_quantization_config_loads_a_model_path_as_in_trl(tmp_path, monkeypatch):
    """TRL's ``quantization_config`` argument is for a model given by name: it reaches the loader."""
    _loader_that_records(monkeypatch)
    marker = object()
    with pytest.raises(_Loaded) as loaded:
        GRPOTrainer(model="some/model", reward_funcs=_reward, args=GRPOConfig(output_dir=str(tmp_path),
                    report_to="none"), train_dataset=PROMPT_ROWS, quantization_config=marker,
                    reward_processing_classes=None)
    assert loaded.value.args[0]["quantization_config"] is marker
