"""GRPO with image prompts on Qwen3-VL against transformers' own model, sample by sample.

The reference is the unpatched (PEFT LoRA) ``Qwen3VLForConditionalGeneration`` run on each sample
``prompt + completion`` alone (its own M-RoPE index, its own attention, its own vision tower),
its completion log-probs taken from its full logits in float64, and the GRPO loss written out in
plain PyTorch (clipped token ratios, the k3 KL to the adapters-disabled model, per-sequence mean,
batch mean). swiftune's side is one padding-free policy row of every sample
(:mod:`swiftune.rl.multimodal`) through the patched model and :func:`swiftune.rl.loss.grpo_loss`.
fp32 on CPU; the tiny model and processor are those of tests/test_qwen3_vl.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import swiftune
from swiftune.data.multimodal import IMAGE_TOKEN
from swiftune.rl.loss import grpo_loss
from swiftune.rl.multimodal import VisionGRPO, VisionRolloutEngine, prompt_messages
from swiftune.rl.policy import completion_logprobs
from swiftune.rl.rollout import SamplingParams
from swiftune.rl.rollout.vision_fast import VisionFastRolloutEngine

from tests.test_qwen3_vl import SEVEN, _image, _model, _processor, _rel

peft = pytest.importorskip("peft")


def _prompt_rows() -> list[dict]:
    """An image part with its image; a string prompt with TRL's ``images`` column (two images); a
    text-only prompt; each with a metadata column a reward function reads."""
    return [
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": _image(16, 24, 0)},
                                                 {"type": "text", "text": "what is it?"}]}], "images": None,
         "size": 16 * 24},
        {"prompt": [{"role": "user", "content": "two:"}], "images": [_image(24, 16, 1), _image(16, 16, 2)],
         "size": 24 * 16 + 16 * 16},
        {"prompt": [{"role": "user", "content": "say hi"}], "images": None, "size": 0},
    ]


@pytest.fixture(scope="module")
def setup():
    proc = _processor()
    base = _model(proc)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    return proc, base, reference


def _reference_logps(model, proc, prompt, completion) -> torch.Tensor:
    """transformers' model on ``prompt + completion`` alone: float64 log-probs of the completion."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.input_ids + completion], device=device)
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == proc.token_id(IMAGE_TOKEN)).int()}
    if prompt.pixel_values is not None:
        inputs.update(pixel_values=prompt.pixel_values.to(device), image_grid_thw=prompt.image_grid_thw.to(device))
    logits = model(**inputs).logits[0].double()
    p = len(prompt.input_ids)
    logps = torch.log_softmax(logits[p - 1:p - 1 + len(completion)], dim=-1)
    return logps.gather(1, torch.tensor(completion, device=device)[:, None])[:, 0]


def _reference_loss(logps, old, ref, advantages, eps: float, beta: float) -> torch.Tensor:
    """TRL's "grpo" loss per sample (lists of per-token tensors): the clipped surrogate plus
    beta * k3 KL, mean over each completion's tokens, mean over completions."""
    losses = []
    for lp, o, r, a in zip(logps, old, ref, advantages):
        ratio = torch.exp(lp - o)
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        if beta:
            per_token = per_token + beta * (torch.exp(r - lp) - (r - lp) - 1)
        losses.append(per_token.mean())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("beta,share,checkpointing", [(0.0, False, False), (0.1, False, False), (0.1, True, False),
                                                      (0.1, True, True)])
def test_grpo_loss_and_gradients_on_image_prompts(setup, beta, share, checkpointing):
    proc, _, reference = setup
    policy = swiftune.patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="reference")
    if checkpointing:  # the row layout and pixel values replayed in the recomputation
        from swiftune.training.loading import enable_gradient_checkpointing

        enable_gradient_checkpointing(policy, True)
        policy.train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in policy.modules())
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _prompt_rows()]
    assert prompts[1].image_grid_thw.shape[0] == 2 and prompts[2].pixel_values is None
    G = 2
    samples = [p for p in prompts for _ in range(G)]
    gen = torch.Generator().manual_seed(3)
    completions = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (5, 3, 6, 1, 4, 7)]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    eps = 0.2

    # reference: each sample alone through the unpatched model; old log-probs off by up to 0.5 so
    # that some ratios are clipped
    ref_logps = [_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)]
    with torch.no_grad(), reference.disable_adapter():
        ref_ref = [_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)]
    old = [lp.detach() + (torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.5) for lp in ref_logps]
    ratios = torch.exp(torch.cat(ref_logps).detach() - torch.cat(old))
    assert ((ratios < 1 - eps) | (ratios > 1 + eps)).any()  # the clip is exercised
    want = _reference_loss(ref_logps, old, ref_ref, advantages.double(), eps, beta)
    want.backward()

    row = vision.policy_row(samples, completions, share_prompt=share, group_ids=[i // G for i in range(len(samples))],
                            attention_backend="reference")
    assert row.position_ids.shape == (3, 1, row.num_tokens)
    if share:  # each group's prompt and images once, the shared-prompt attention on the text decoder
        assert row.layout.shared and "document_ids" not in row.model_inputs
        assert row.num_tokens == sum(len(p.input_ids) for p in prompts) + sum(len(c) - 1 for c in completions)
        assert row.model_inputs["image_grid_thw"].shape[0] == 3
    else:
        assert row.model_inputs["document_ids"][0].unique().numel() == len(samples)
        assert row.model_inputs["image_grid_thw"].shape[0] == G * 3  # every sample's images, in order
    logps, _ = completion_logprobs(policy, row, kernel_backend="reference")
    config = policy.get_base_model().config
    assert config.text_config._attn_implementation == ("swiftune_grpo" if share else "swiftune_packed")
    assert config.vision_config._attn_implementation == reference.get_base_model().config.vision_config._attn_implementation
    assert _rel(logps.detach(), torch.cat(ref_logps).detach()) < 1e-5
    with torch.no_grad(), policy.disable_adapter():
        ref_row = completion_logprobs(policy, row, kernel_backend="reference")[0]
    assert _rel(ref_row, torch.cat(ref_ref)) < 1e-5
    out = grpo_loss(logps, torch.cat(old).float(), advantages, row.seq_index, num_sequences=len(samples),
                    loss_type="grpo", epsilon=eps, beta=beta, ref_logps=ref_row if beta else None)
    out.loss.backward()
    assert torch.isfinite(out.loss) and _rel(out.loss.detach(), want.detach()) < 1e-5, (float(out.loss), float(want))
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert _rel(grads[name], g) < 1e-5, (name, _rel(grads[name], g))
        if g.abs().max() > 0:
            assert grads[name].abs().max() > 0, name
    reference.zero_grad(set_to_none=True)


def test_policy_row_needs_document_ids(setup):
    """Without document_ids the row's samples see each other: the parity above rests on them."""
    proc, base, _ = setup
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _prompt_rows()[:2]]
    completions = [[40, 41, 42], [43, 44, 45, 46]]
    row = vision.policy_row(prompts, completions, attention_backend="reference")
    with torch.no_grad():
        separate = completion_logprobs(policy, row, kernel_backend="reference")[0]
        row.model_inputs.pop("document_ids")
        mixed = completion_logprobs(policy, row, kernel_backend="reference")[0]
    assert _rel(mixed[:3], separate[:3]) < 1e-6 and _rel(mixed[3:], separate[3:]) > 1e-3


def test_rollout_engine_greedy_matches_transformers(setup):
    """VisionRolloutEngine (one prefill with the images, G rows decoded) on the patched model gives
    transformers' greedy generate of the unpatched model, for every copy of the group."""
    proc, base, _ = setup
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    engine = VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id)
    prompts = [vision.encode(row) for row in _prompt_rows()]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    out = vision.generate(engine, prompts, 2, params)
    assert len(out.completion_ids) == 6
    for k, p in enumerate(prompts):
        ids = torch.tensor([p.input_ids])
        kwargs = dict(input_ids=ids, mm_token_type_ids=(ids == vision.image_token_id).int(), max_new_tokens=6,
                      do_sample=False)
        if p.pixel_values is not None:
            kwargs.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        want = base.generate(**kwargs)[0, ids.shape[1]:].tolist()
        assert out.completion_ids[2 * k] == out.completion_ids[2 * k + 1] == want


def test_rollout_engine_never_samples_the_image_token(setup):
    """With the LM head pushed towards the image placeholder, the engine's greedy completions are
    transformers' greedy generate with that token banned (its own bad_words_ids processor)."""
    proc, base, _ = setup
    model = copy.deepcopy(base)
    vision_id = proc.token_id(IMAGE_TOKEN)
    with torch.no_grad():
        model.lm_head.weight[vision_id] = model.lm_head.weight[vision_id] * 50
    policy = swiftune.patch_model(copy.deepcopy(model), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    engine = VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id)
    prompt = vision.encode(_prompt_rows()[0])
    ids = torch.tensor([prompt.input_ids])
    common = dict(input_ids=ids, mm_token_type_ids=(ids == vision_id).int(), pixel_values=prompt.pixel_values,
                  image_grid_thw=prompt.image_grid_thw, max_new_tokens=5, do_sample=False)
    assert vision_id in model.generate(**common)[0, ids.shape[1]:].tolist()  # the push works
    want = model.generate(**common, bad_words_ids=[[vision_id]])[0, ids.shape[1]:].tolist()
    out = vision.generate(engine, [prompt], 1, SamplingParams(max_tokens=5, temperature=0.0))
    assert out.completion_ids[0] == want


def test_prompt_messages_follow_trl():
    row = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what?"}],
           "image": "cat.png"}
    messages, images = prompt_messages(row)
    assert images == ["cat.png"]
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "what?"}]
    with pytest.raises(ValueError, match="conversational"):
        prompt_messages({"prompt": "a string", "image": "cat.png"})
    with pytest.raises(ValueError, match="video"):
        prompt_messages({"prompt": [{"role": "user", "content": "x"}], "videos": ["v.mp4"]})


FAST = dict(kernel_backend="reference", attention_backend="reference", report_to="none", save_strategy="no",
            logging_steps=1, seed=1, dataloader_pin_memory=False, disable_tqdm=True, use_cpu=True)


def test_grpo_trainer_one_step_on_image_prompts(setup, tmp_path):
    """GRPOTrainer on the LoRA Qwen3-VL policy with image prompts (image parts and TRL's ``images``
    column), shared-prompt rows (the default): the reward function sees the rows' metadata column,
    every LoRA tensor moves, the loss is finite; rollout_engine='fast' is the vision fast engine."""
    import json

    from swiftune import GRPOConfig, GRPOTrainer

    proc, _, reference = setup
    model = copy.deepcopy(reference)
    seen: dict[str, list] = {}

    def size_reward(prompts, completions, size, **kwargs):
        seen.setdefault("size", []).extend(size)
        seen.setdefault("completions", []).extend(completions)
        seen.setdefault("images", []).extend(kwargs.get("images", []))
        return [float(s) / 400.0 + 0.1 * len(c[0]["content"]) for s, c in zip(size, completions)]

    rows = _prompt_rows()[:2]
    args = GRPOConfig(output_dir=str(tmp_path / "vl"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, learning_rate=1e-2, beta=0.05, **FAST)
    fast = GRPOTrainer(copy.deepcopy(reference), size_reward, GRPOConfig(output_dir=str(tmp_path / "f"),
                       rollout_engine="fast", num_generations=2, per_device_train_batch_size=4, **FAST),
                       train_dataset=rows, processing_class=proc)
    assert isinstance(fast.rollout_engine, VisionFastRolloutEngine)  # tests/test_vl_fast_rollout.py checks it
    trainer = GRPOTrainer(model, size_reward, args=args, train_dataset=rows, processing_class=proc)
    assert isinstance(trainer.rollout_engine, VisionRolloutEngine) and args.share_prompt  # the default, G > 1
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    # each completion scored with its own row's column, prompt-major (G = 2)
    assert sorted(seen["size"]) == sorted([r["size"] for r in rows for _ in range(2)])
    assert sum(isinstance(x, list) and len(x) == 2 for x in seen["images"]) == 2  # TRL's images column, per completion
    assert len(seen["completions"]) == 4 and all(isinstance(c[0]["content"], str) for c in seen["completions"])
    with open(tmp_path / "vl" / "metrics.jsonl") as f:
        logs = [json.loads(line) for line in f]
    losses = [entry["loss"] for entry in logs if "loss" in entry]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses[0]))
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert moved and all("lora_" in n for n in moved)

    # the rollout buffer (vision rows included) survives a checkpoint: the same log-probs after loading
    from swiftune.rl.checkpoint import load_rollout_state, save_rollout_state
    from swiftune.rl.trainer import GRPOMicroBatch

    save_rollout_state(str(tmp_path / "ckpt"), 0, trainer._micro_step, trainer._buffer)
    _, loaded = load_rollout_state(str(tmp_path / "ckpt"), 0, "cpu", types=(GRPOMicroBatch,))
    with torch.no_grad():
        for mb, back in zip(trainer._buffer, loaded):
            assert back.row.model_inputs.keys() == mb.row.model_inputs.keys()
            assert torch.equal(completion_logprobs(model, back.row, kernel_backend="reference")[0],
                               completion_logprobs(model, mb.row, kernel_backend="reference")[0])
    metrics = trainer.evaluate(eval_dataset=rows)  # fresh rollouts of image prompts, their GRPO loss
    assert torch.isfinite(torch.tensor(metrics["eval_loss"])) and "eval_reward" in metrics


def test_full_finetuning_reference_copy_on_shared_image_rows(setup, tmp_path):
    """Full fine-tuning with beta > 0: the trainer's frozen reference copy gives the unpatched
    model's per-sample log-probs on a shared-prompt image row."""
    from swiftune import GRPOConfig, GRPOTrainer

    proc, base, _ = setup
    args = GRPOConfig(output_dir=str(tmp_path / "full"), num_generations=2, per_device_train_batch_size=2, beta=0.1,
                      **FAST)
    trainer = GRPOTrainer(copy.deepcopy(base), lambda prompts, completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=_prompt_rows()[:1], processing_class=proc)
    assert trainer.ref_model is not None
    prompt = trainer.vision.encode(_prompt_rows()[0])
    completions = [[40, 41, 42], [50, 51]]
    row = trainer.vision.policy_row([prompt, prompt], completions, share_prompt=True, group_ids=[0, 0],
                                    attention_backend="reference")
    assert row.layout.shared
    with torch.no_grad():
        want = torch.cat([_reference_logps(base, proc, prompt, c) for c in completions])
    assert _rel(trainer.reference_logprobs(row), want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [False, True])
def test_gpu_grpo_parity_on_image_prompts(setup, dtype, share):
    """On CUDA: compiled kernels and the automatic attention (packed, or the shared-prompt flex / sdpa
    backends) of the patched LoRA policy against the fp32 unpatched reference per sample (TF32 off):
    the GRPO loss (beta 0.1) and every LoRA gradient; fp32 to 1e-4, bf16 to 2e-2 (gradients 1e-1)."""
    proc, _, peft_reference = setup
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = copy.deepcopy(peft_reference).cuda()
        policy = swiftune.patch_model(copy.deepcopy(peft_reference).to("cuda", dtype), attention="auto",
                                      kernel_backend="auto")
        vision = VisionGRPO(policy, proc)
        prompts = [vision.encode(row) for row in _prompt_rows()]
        samples = [p for p in prompts for _ in range(2)]
        gen = torch.Generator().manual_seed(3)
        completions = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (5, 3, 6, 1, 4, 7)]
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], device="cuda")

        lp = [_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)]
        with torch.no_grad(), reference.disable_adapter():
            rr = [_reference_logps(reference, proc, p, c) for p, c in zip(samples, completions)]
        old = [x.detach() for x in lp]
        want = _reference_loss(lp, old, rr, advantages.double(), 0.2, 0.1)
        want.backward()
        row = vision.policy_row(samples, completions, share_prompt=share, group_ids=[i // 2 for i in range(6)],
                                attention_backend="auto", device="cuda")
        if "pixel_values" in row.model_inputs:
            row.model_inputs["pixel_values"] = row.model_inputs["pixel_values"].to(dtype)
        logps, _ = completion_logprobs(policy, row)
        with torch.no_grad(), policy.disable_adapter():
            ref_row = completion_logprobs(policy, row)[0]
        out = grpo_loss(logps, torch.cat(old).float(), advantages, row.seq_index, num_sequences=6, loss_type="grpo",
                        epsilon=0.2, beta=0.1, ref_logps=ref_row)
        out.loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # The loss is a mean of per-token terms of size ~1 and both signs (advantages +-), which cancel to ~2e-3
    # here: the error is measured against the terms' scale, not against the cancelled total.
    scale = max(1.0, float(want.detach().abs()))
    assert torch.isfinite(out.loss) and float((out.loss.detach().double() - want.detach()).abs()) < tol * scale
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    for name, g in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        if g.abs().max() > 0:
            assert _rel(grads[name].float(), g.float()) < tol * (5 if dtype == torch.bfloat16 else 1), name


def test_grpo_trainer_reuses_image_rollouts(setup, tmp_path):
    """num_iterations=2: the second step reuses the generation, its old log-probs computed on the same
    image rows without gradient, equal to the unpatched model's per-sample log-probs before the step."""
    from swiftune import GRPOConfig, GRPOTrainer

    proc, _, reference = setup
    model = copy.deepcopy(reference)
    args = GRPOConfig(output_dir=str(tmp_path / "it"), max_steps=2, num_iterations=2, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=3, learning_rate=1e-2, **FAST)
    trainer = GRPOTrainer(model, lambda prompts, completions, size, **kw: [float(s) for s in size], args=args,
                          train_dataset=_prompt_rows()[:1], processing_class=proc)
    trainer.train()
    mb = trainer._buffer[0]
    assert mb.old_logps is not None and mb.row.model_inputs is not None
    prompt = trainer.vision.encode(_prompt_rows()[0])
    ids, spans = mb.row.input_ids[0].tolist(), mb.row.spans
    completions = [ids[cs:ce] + [int(mb.row.targets[mb.row.seq_index == i][-1])] for i, (_, _, cs, ce) in
                   enumerate(spans)]
    with torch.no_grad():
        want = torch.cat([_reference_logps(reference, proc, prompt, c) for c in completions])
    assert _rel(mb.old_logps, want) < 1e-5  # the policy before the first step: the reference weights
