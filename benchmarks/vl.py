"""Vision-language (Qwen3-VL) benchmarks: SFT on image-text rows and the GRPO policy step on image prompts.

Both run a random-init Qwen3-VL of the shape ``--model`` (``qwen3-vl-8b``: the real Qwen3-VL-8B config;
``tiny-vl``: a CPU smoke test; benchmarks/workload.py) with a processor built here, no download: swiftune's
byte-level tokenizer plus the vision special tokens, a chat template that writes each image part as
``<|vision_start|><|image_pad|><|vision_end|>``, and transformers' Qwen2-VL image processor with the vision
config's patch, temporal-patch and merge sizes and Qwen3-VL's normalisation (mean = std = 0.5). Every image
is ``--image-size`` square (448: a 28 x 28 patch grid, 196 merged tokens in the language model); a byte-level
text of ``n`` characters is ``n`` tokens, so text lengths follow the reference workload exactly.

**sft** (``python -m benchmarks.vl sft``): ``--batch`` rows a step, each one image + a user text + an
assistant answer whose total text length is drawn from the reference distribution (workload.sample_lengths;
a third of it the question). LoRA r=16 on the language model's seven projections (the same adapters in both
modes: those names exist only in the text decoder), gradient checkpointing, AdamW, bf16 on CUDA. Modes, each
in its own process:

  swiftune   swiftune.patch_model + SFTTrainer on the rows (padding-free: one row per batch,
             MultimodalCollator, images pre-processed when the dataset is built)
  trl        TRL 1.16's SFTTrainer with the processor (its VLM path: DataCollatorForVisionLanguageModeling,
             right padding to the longest row, images processed in the collator every step); TRL trains
             every text token of a messages row (its assistant-only loss needs transformers >= 5.18),
             swiftune the assistant turns: the compute is the same, only the label mask differs

**tok/s** counts the language model's non-padding tokens, text and image placeholders alike (an image is its
196 merged tokens, once), in both modes the same way: the collated batch's ``attention_mask`` sum (TRL) or
its ``num_tokens`` (swiftune, a padding-free row has no padding); ``tokens_per_s_excl_collate`` leaves out the
time spent inside the collator (TRL processes the images there; swiftune did it before the timed steps).
**peak GB** is ``torch.cuda.max_memory_allocated`` over the run.

**grpo** (``python -m benchmarks.vl grpo``): the policy loss + backward of ``--generations`` (G=2) samples of
one image prompt (one image + ``--prompt-tokens`` text tokens) and random completions, as GRPOTrainer runs it
on a Qwen3-VL policy (swiftune.rl.multimodal.VisionGRPO's policy row, shared prompt by default, chunked
log-probs whose saved hidden states are offloaded on CUDA as with ``GRPOConfig(offload_logits=True)``, dapo
loss, bf16 autocast); generation skipped. The model is saved once and loaded through
``swiftune.FastModel.from_pretrained`` (``--load-in-4bit``: QLoRA, passed on; if loading refuses it, the run
says so and reports it as such), LoRA r=16 on the seven projections, ``--checkpointing offload`` (layer inputs
beyond the GPU budget in pinned host memory). First the step at ``--completion-lengths`` (timed, the second
of two steps reported), then the largest completion per row that fits (``--gpu-budget-gb``, emulated with
``torch.cuda.set_per_process_memory_fraction``) by doubling and bisection to ``--bisect-tol`` (5%), within
``--time-budget`` seconds (the bracket is printed; ``--bisect-lo/--bisect-hi`` resume it).

    python -m benchmarks.vl sft --model qwen3-vl-8b --batch 16 --out vl_sft.json
    python -m benchmarks.vl grpo --model qwen3-vl-8b --load-in-4bit --gpu-budget-gb 24 \\
        --completion-lengths 32768 --out vl_grpo.json
    python -m benchmarks.vl sft --model tiny-vl --steps 3 --warmup 1        # CPU smoke tests
    python -m benchmarks.vl grpo --model tiny-vl --completion-lengths 64 --simulate-capacity 600
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from typing import Any

from benchmarks import child_env, module_command, results
from benchmarks.child_output import failure_summary
from benchmarks.memory_profile import format_breakdown, peak_profile

SFT_MODES = ["swiftune", "trl"]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# ChatML whose content is a string (swiftune's rows after it writes the image placeholders) or a list of
# parts (TRL's prepared messages): an image part is written as Qwen3-VL's template writes it
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


# ------------------------------------------------------------------------------ model and processor


def build_processor(model_name: str, transformers_processor: bool = False) -> Any:
    """The benchmark's processor for shape ``model_name`` (module doc): a ``swiftune.data.VisionProcessor``,
    or with ``transformers_processor`` a ``Qwen3VLProcessor`` of the same tokenizer and image processor (what
    TRL's VLM path requires: a ``ProcessorMixin``)."""
    import transformers

    from benchmarks.workload import model_config
    from swiftune.data.builtin import build_tokenizer
    from swiftune.data.multimodal import VisionProcessor

    vision = model_config(model_name).vision_config
    tokenizer = build_tokenizer(model_max_length=1 << 20)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    patch, merge = vision.patch_size, vision.spatial_merge_size
    with warnings.catch_warnings():  # without torchvision transformers falls back to its PIL processor, and says so
        warnings.simplefilter("ignore")
        # Qwen3-VL's preprocessor_config.json: mean = std = 0.5, pixels between 64K and 16M
        image_processor = transformers.Qwen2VLImageProcessor(
            patch_size=patch, merge_size=merge, temporal_patch_size=vision.temporal_patch_size,
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
            size={"shortest_edge": (patch * merge) ** 2, "longest_edge": 16777216})
        if not transformers_processor:
            return VisionProcessor(tokenizer, image_processor)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=vision.temporal_patch_size)
        return _processor_class()(image_processor=image_processor, tokenizer=tokenizer, video_processor=video,
                                  chat_template=CHAT_TEMPLATE)


def _processor_class() -> type:
    """``Qwen3VLProcessor``, or where transformers cannot name the video processors' base class (no
    torchvision: ``transformers.VideoProcessorMixin`` is absent, and ``ProcessorMixin``'s type check of its
    arguments fails on a lookup) a subclass that skips that one check: the benchmark's rows have no video,
    and everything else is transformers' processor unchanged."""
    import transformers

    if hasattr(transformers, "VideoProcessorMixin"):
        return transformers.Qwen3VLProcessor

    class Qwen3VLProcessorWithoutVideoCheck(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return Qwen3VLProcessorWithoutVideoCheck


def vl_config(model_name: str, processor: Any):
    """The transformers config of shape ``model_name`` with the processor's vision token ids."""
    from benchmarks.workload import model_config
    from swiftune.data.multimodal import VisionProcessor

    config = model_config(model_name)
    tok = VisionProcessor.of(processor).tokenizer
    start, end, image, video = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    config.vision_start_token_id, config.vision_end_token_id = start, end
    config.image_token_id, config.video_token_id = image, video
    if len(tok) > config.text_config.vocab_size:
        raise ValueError(f"the shape's vocabulary ({config.text_config.vocab_size}) is smaller than the "
                         f"benchmark tokenizer's ({len(tok)})")
    return config


def random_vl_model(model_name: str, processor: Any, device, dtype):
    """A random-init Qwen3-VL of shape ``model_name`` (seed 0, sdpa) on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = vl_config(model_name, processor)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def random_image(size: int, seed: int):
    """A ``size`` x ``size`` RGB image of random pixels (Pillow)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def random_text(n: int, rng) -> str:
    """``n`` lowercase letters and spaces: ``n`` tokens of the byte-level tokenizer."""
    letters = "abcdefghijklmnopqrstuvwxyz "
    return "".join(letters[i] for i in rng.integers(0, len(letters), max(1, int(n))))


def image_text_rows(n: int, image_size: int, max_length: int, seed: int = 0) -> list[dict]:
    """``n`` SFT rows of TRL's layout: ``messages`` whose user turn is an image part and a question, the
    assistant an answer (text lengths of the reference workload, a third of each the question), and the
    row's image in its ``images`` column."""
    import numpy as np

    from benchmarks.workload import sample_lengths

    rng = np.random.default_rng(seed + 1)
    rows = []
    for i, length in enumerate(sample_lengths(n, seed=seed, max_length=max_length)):
        question = max(1, int(length) // 3)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": random_text(question, rng)}]},
            {"role": "assistant", "content": [{"type": "text", "text": random_text(int(length) - question, rng)}]}],
            "images": [random_image(image_size, seed * 100_003 + i)]})
    return rows


def image_tokens_of(processor: Any, image_size: int) -> int:
    """How many language-model tokens one ``image_size`` square image takes."""
    from swiftune.data.multimodal import VisionProcessor

    proc = VisionProcessor.of(processor)
    grid = proc.image_processor(images=[random_image(image_size, 0)], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod(-1).sum()) // proc.merge_size**2


# ------------------------------------------------------------------------------------------ sft


class CountingCollator:
    """Wraps a collator: per batch, the language model's non-padding tokens (text and image
    placeholders) and its token slots, and the time spent inside the collator. Batches are counted
    where the step that trains them is: the dataloader collates one batch ahead of the step."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens: list[int] = []
        self.slots: list[int] = []
        self.seconds = 0.0

    def __call__(self, examples):
        t0 = time.perf_counter()
        batch = self.inner(examples)
        self.seconds += time.perf_counter() - t0
        if "attention_mask" in batch:  # padded: the mask marks the real tokens
            self.tokens.append(int(batch["attention_mask"].sum()))
        else:  # swiftune's padding-free row: every token but a packed row's padding
            self.tokens.append(int(batch["num_tokens"]))
        self.slots.append(batch["input_ids"].numel())
        return batch


def timing_callback(warmup: int, counter: CountingCollator, record: dict):
    """Wall time and collator time from the end of step ``warmup`` to the end of the last step."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = (time.perf_counter(), counter.seconds, state.global_step)
            if state.global_step == warmup:
                record["start"] = now
            record["end"] = now

    return Timer()


def run_sft_mode(mode: str, args) -> dict:
    """One SFT mode in this process (module doc)."""
    import torch
    from peft import LoraConfig

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    n_rows = args.steps * args.batch
    rows = image_text_rows(n_rows, args.image_size, args.max_text_length)
    proc = build_processor(args.model, transformers_processor=mode == "trl")
    model = random_vl_model(args.model, proc, device, dtype)
    common = dict(output_dir=f"/tmp/bench_vl_sft_{mode}", max_steps=args.steps, per_device_train_batch_size=args.batch,
                  learning_rate=1e-4, logging_steps=10_000, save_strategy="no", report_to="none", bf16=cuda,
                  dataloader_pin_memory=cuda, seed=0, disable_tqdm=True, use_cpu=not cuda)
    if mode == "trl":
        import datasets
        import trl

        lora = LoraConfig(r=16, lora_alpha=16, target_modules=SEVEN, lora_dropout=0.0, task_type="CAUSAL_LM")
        config = trl.SFTConfig(max_length=None, gradient_checkpointing=True, dataset_num_proc=None,
                               gradient_checkpointing_kwargs={"use_reentrant": False}, **common)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                                 peft_config=lora, processing_class=proc)
    elif mode == "swiftune":
        import swiftune

        swiftune.patch_model(model)
        model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, target_modules=SEVEN,
                                                  use_gradient_checkpointing=True)
        config = swiftune.SFTConfig(max_length=args.max_text_length + 4096, gradient_checkpointing=False, **common)
        trainer = swiftune.SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=proc)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {SFT_MODES}")
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    record: dict = {}
    trainer.add_callback(timing_callback(args.warmup, counter, record))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    (t0, col0, step0), (t1, col1, step1) = record["start"], record["end"]
    tokens = sum(counter.tokens[step0:step1])  # the batches of the timed steps (one batch a step)
    slots = sum(counter.slots[step0:step1])
    params = list(trainer.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    elapsed, collate = t1 - t0, col1 - col0
    return dict(mode=mode, model=args.model, batch=args.batch, finetune="lora r=16 (text decoder)",
                image_size=args.image_size, image_tokens_per_row=image_tokens_of(proc, args.image_size),
                steps=args.steps - args.warmup, tokens=tokens, tokens_all_steps=sum(counter.tokens[:step1]),
                tokens_per_s=tokens / elapsed,
                tokens_per_s_excl_collate=tokens / max(elapsed - collate, 1e-9),
                collate_s_per_step=collate / (args.steps - args.warmup),
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                sec_per_step=elapsed / (args.steps - args.warmup),
                padding_fraction=1 - tokens / max(slots, 1),
                trainable_fraction=trainable / sum(p.numel() for p in params))


def run_sft(args, argv) -> int:
    """Every mode of ``--modes`` in its own process; the table last."""
    rows = []
    for mode in args.modes:
        cmd = [*module_command("vl", "sft", "--one", mode), "--model", args.model, "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--image-size", str(args.image_size),
               "--max-text-length", str(args.max_text_length)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=args.mode_timeout)
        except subprocess.TimeoutExpired:
            rows.append(dict(mode=mode, model=args.model, batch=args.batch,
                             error=f"ran past --mode-timeout {args.mode_timeout} s"))
            print(json.dumps(rows[-1]), flush=True)
            continue
        found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        tail = failure_summary(proc.stderr or proc.stdout, 400)
        rows.append(found[0] if found else dict(mode=mode, model=args.model, batch=args.batch, error=tail))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["mode"] == "trl" and "error" not in r), None)
    print(f"\n# SFT on image-text rows, {args.model} shape, batch {args.batch}, one {args.image_size}x{args.image_size} "
          "image per row, LoRA r=16 on the text decoder's projections")
    print(f"{'mode':<10} {'tok/s':>9} {'x trl':>6} {'tok/s excl collate':>18} {'collate s':>9} {'peak GB':>8} "
          f"{'x trl GB':>8} {'s/step':>7} {'padding':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<10} FAILED: {r['error'][:200]}")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        memory = r["peak_gb"] / base["peak_gb"] if base and base["peak_gb"] else float("nan")
        print(f"{r['mode']:<10} {r['tokens_per_s']:9.0f} {ratio:6.2f} {r['tokens_per_s_excl_collate']:18.0f} "
              f"{r['collate_s_per_step']:9.3f} {r['peak_gb']:8.1f} {memory:8.2f} {r['sec_per_step']:7.2f} "
              f"{r['padding_fraction']:8.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    results.save("vl", argv, rows, args.out, args.rows, warmup=args.warmup, image_size=args.image_size,
                 max_text_length=args.max_text_length)
    return 0 if all("error" not in r for r in rows) else 1


# ----------------------------------------------------------------------------------------- grpo


def load_policy(args, checkpoint: str, device):
    """The policy as a user loads it: ``FastModel.from_pretrained`` (``load_in_4bit`` passed on), LoRA r=16
    on the seven projections with ``--checkpointing``. Returns ``(model, None)`` or ``(None, refusal)``
    when loading refuses the request (a ``ValueError`` / ``NotImplementedError``: its message)."""
    import torch

    import swiftune

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:  # (on CUDA it loads onto this process's GPU)
        model, _ = swiftune.FastModel.from_pretrained(checkpoint, dtype=dtype, load_in_4bit=args.load_in_4bit)
    except (ValueError, NotImplementedError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"
    nf4 = count_4bit_linears(model)
    if args.load_in_4bit and nf4 == 0:  # accepted but not applied: not a QLoRA figure
        return None, "FastModel.from_pretrained(load_in_4bit=True) returned a model without any 4-bit linear layer"
    gc_mode = {"offload": "offload", "gpu": True}[args.checkpointing]
    model = swiftune.FastModel.get_peft_model(model, r=16, lora_alpha=16, target_modules=SEVEN,
                                              use_gradient_checkpointing=gc_mode)
    return model.train(), None


def count_4bit_linears(model) -> int:
    """How many bitsandbytes ``Linear4bit`` layers ``model`` has (0 without bitsandbytes)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def policy_step(model, vision, prompt, L: int, args, device) -> int:
    """The policy loss + backward of G samples ``prompt + completion_i`` (random completions of ``L``);
    returns the policy row's token count."""
    import torch

    from swiftune.rl import completion_logprobs, grpo_loss
    from swiftune.training.lora_casting import lora_input_casting

    G = args.generations
    g = torch.Generator().manual_seed(L)
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else 256
    comps = torch.randint(3, min(vocab, 256), (G, L), generator=g).tolist()  # byte ids: never a vision token
    row = vision.policy_row([prompt] * G, comps, share_prompt=args.share_prompt, group_ids=[0] * G, device=device)
    adv = torch.linspace(1.0, -1.0, G, device=device)  # sum 0, like group advantages
    cuda = device.type == "cuda"
    # GRPOTrainer(bf16=True): the step under bf16 autocast (accelerate), LoRA inputs left in bf16
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(lora_input_casting(model, enabled=False))
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        logps, _ = completion_logprobs(model, row, offload=args.offload_logits and cuda)
        loss = grpo_loss(logps, None, adv, row.seq_index, num_sequences=G, loss_type="dapo").loss
        del logps
        loss.backward()
    return int(row.num_tokens)


def run_grpo_trials(args) -> dict:
    """This process: save the random model, load it as a user would, time the fixed lengths, then search."""
    import tempfile

    import torch

    from benchmarks.grpo import OutOfTime, _is_oom, search_max_fit
    from benchmarks.workload import emulate_gpu_budget, host_rss, reset_cuda_memory
    from swiftune.rl.multimodal import VisionGRPO

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    start = time.perf_counter()
    proc = build_processor(args.model)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="bench_vl_ckpt_")
    if not os.path.exists(os.path.join(checkpoint, "config.json")):  # built on the GPU (fast), before the budget
        base = random_vl_model(args.model, proc, device, torch.bfloat16 if cuda else torch.float32)
        partial = checkpoint.rstrip("/") + ".partial"  # renamed when complete: a run cut short leaves no half folder
        base.save_pretrained(partial)
        proc.tokenizer.save_pretrained(partial)
        proc.image_processor.save_pretrained(partial)
        if os.path.isdir(checkpoint):  # (mkdtemp's empty folder)
            os.rmdir(checkpoint)
        os.replace(partial, checkpoint)
        del base
        reset_cuda_memory(cuda)
    print(f"# checkpoint {checkpoint} ready after {time.perf_counter() - start:.0f} s", flush=True)
    if cuda and args.gpu_budget_gb is not None:  # a smaller GPU, emulated
        emulate_gpu_budget(args.gpu_budget_gb)
    out = dict(mode="swiftune_vl", label=mode_label(args), trials=[], max_fit=None, first_fail=None)
    model, refusal = load_policy(args, checkpoint, device)
    if args.checkpoint is None:  # a temporary copy (17.5 GB for the 8B shape): the model is in memory now
        shutil.rmtree(checkpoint, ignore_errors=True)
    if refusal is not None:
        out.update(status="refused", error=refusal)
        print(f"# FastModel.from_pretrained refused the request (load_in_4bit={args.load_in_4bit}): {refusal}",
              flush=True)
        return out
    out["nf4_linears"] = count_4bit_linears(model)
    out["weights_gb"] = torch.cuda.memory_allocated() / 1e9 if cuda else 0.0
    print(f"# loaded after {time.perf_counter() - start:.0f} s: {out['nf4_linears']} 4-bit linear layers, "
          f"{out['weights_gb']:.1f} GB on the GPU", flush=True)
    vision = VisionGRPO(model, proc)
    image = random_image(args.image_size, 0)

    def encode(text: str):
        return vision.encode({"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                                      {"type": "text", "text": text}]}]})

    def text_tokens(p) -> int:
        return sum(t != vision.image_token_id for t in p.input_ids)

    markup = text_tokens(encode("q")) - 1  # the chat template's tokens: the text makes up the rest of prompt_tokens
    prompt = encode("q" * max(1, args.prompt_tokens - markup))
    out["prompt_text_tokens"] = text_tokens(prompt)
    out["prompt_image_tokens"] = len(prompt.input_ids) - out["prompt_text_tokens"]
    out["prompt_row_tokens"] = len(prompt.input_ids)
    trials = out["trials"]

    def trial(L: int, repeats: int = 1, record: bool = True) -> dict:
        P, G = len(prompt.input_ids), args.generations
        row: dict = {"mode": "swiftune_vl", "completion": L,  # (the row's own count once it is built)
                     "tokens": P + G * L if args.share_prompt else G * (P + L)}
        failure = None
        t0 = time.perf_counter()
        try:
            for i in range(repeats):
                if cuda:
                    reset_cuda_memory(synchronize=True, reset_peak=True)
                t0 = time.perf_counter()
                if args.simulate_capacity and row["tokens"] > args.simulate_capacity:
                    raise MemoryError(f"simulated: {row['tokens']} tokens > --simulate-capacity {args.simulate_capacity}")
                mem_profiled = cuda and record and i == repeats - 1 and L == args.memory_profile_completion
                with peak_profile(row) if mem_profiled else contextlib.nullcontext():  # (a slower step)
                    row["tokens"] = policy_step(model, vision, prompt, L, args, device)
                if cuda:
                    torch.cuda.synchronize()
                model.zero_grad(set_to_none=True)
                if i < repeats - 1:
                    row["first_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - out of memory (GPU or the offload's host budget): does not fit
            if not (_is_oom(e) or type(e).__name__ == "CheckpointBudgetError"):
                raise
            failure = str(e).splitlines()[0][:400]
        row["s"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        row["status"] = "ok" if failure is None else "oom"
        if failure is None:
            row["tokens_per_s"] = row["tokens"] / row["s"]
        else:
            row["error"] = failure
        if cuda:
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            row["reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
            reset_cuda_memory()
        row["host_rss_gb"] = host_rss() / 1e9
        if record:
            trials.append(row)
            print("TRIAL " + json.dumps(row), flush=True)  # (what a run cut short by the device's limit leaves)
            if row.get("peak_profile"):
                print(f"# memory at the peak of the step at {L}\n{format_breakdown(row['peak_profile'])}", flush=True)
        return row

    def estimate(L: int) -> float:  # the next trial's time from the largest finished one (quadratic: attention)
        ok = [t for t in trials if t["status"] == "ok"]
        if not ok:
            return 0.0
        ref = max(ok, key=lambda t: t["completion"])
        return ref["s"] * max(1.0, L / ref["completion"]) ** 2

    def fits(L: int) -> bool:
        done = [t for t in trials if t["completion"] == L]
        if done:  # a fixed length the search reaches again
            return done[-1]["status"] == "ok"
        if time.perf_counter() - start + estimate(L) > args.time_budget:
            raise OutOfTime
        return trial(L)["status"] == "ok"

    out["warmup"] = trial(min(args.completion_lengths or [args.bisect_start]) // 4 or 16, record=False)  # kernels compile
    for L in args.completion_lengths or []:
        trial(L, repeats=2)
    if args.fixed_only:
        out["status"] = "fixed_only"
        ok = [t["completion"] for t in trials if t["status"] == "ok"]
        bad = [t["completion"] for t in trials if t["status"] != "ok"]
        out["max_fit"], out["first_fail"] = (max(ok) if ok else None), (min(bad) if bad else None)
    else:
        lo, hi, status = search_max_fit(fits, args.bisect_start, args.bisect_max, args.bisect_tol,
                                        args.bisect_granularity, args.bisect_lo, args.bisect_hi)
        out.update(max_fit=lo, first_fail=hi, status=status)
    out["wall_s"] = time.perf_counter() - start
    return out


def mode_label(args) -> str:
    return (f"swiftune, Qwen3-VL policy row ({'shared' if args.share_prompt else 'unshared'} prompt), "
            f"{'QLoRA (NF4) ' if args.load_in_4bit else ''}LoRA r=16, {args.checkpointing} checkpointing"
            f"{', offloaded log-prob hidden states' if args.offload_logits else ''}")


def run_grpo(args, argv) -> int:
    """The trials (in this process: one mode), then the table last."""
    try:
        mode = run_grpo_trials(args)
    except Exception as e:  # noqa: BLE001 - a failed run is a row of the report, not a lost one
        import traceback

        traceback.print_exc()
        mode = dict(mode="swiftune_vl", label=mode_label(args), status="crashed", trials=[], max_fit=None,
                    first_fail=None, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:600])
    data = dict(benchmark="grpo_bisect", model=args.model, prompt_tokens=mode.get("prompt_row_tokens", args.prompt_tokens),
                rows=args.generations, tolerance=args.bisect_tol, share_prompt=args.share_prompt,
                swiftune_checkpointing=args.checkpointing, load_in_4bit=args.load_in_4bit, offload_logits=args.offload_logits,
                gpu_budget_gb=args.gpu_budget_gb, image_size=args.image_size, modes={"swiftune_vl": mode},
                cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    print(f"\n# GRPO policy loss + backward on image prompts, {args.model} shape, G={args.generations}, one "
          f"{args.image_size}x{args.image_size} image ({mode.get('prompt_image_tokens')} tokens) + "
          f"{mode.get('prompt_text_tokens')} text tokens, {mode['label']}, GPU budget {args.gpu_budget_gb or 'all'} GB")
    print(f"{'completion':>10} {'tokens':>9} {'status':>8} {'s':>8} {'first s':>8} {'peak GB':>8} {'host GB':>8}")
    for t in mode["trials"]:
        fmt = lambda k, spec: format(t[k], spec) if isinstance(t.get(k), (int, float)) else "-"  # noqa: E731
        print(f"{t['completion']:>10} {t['tokens']:>9} {t['status']:>8} {fmt('s', '8.2f')} {fmt('first_s', '8.2f')} "
              f"{fmt('peak_gb', '8.1f')} {fmt('host_rss_gb', '8.1f')}")
    print(f"largest completion per row that fits: {mode.get('max_fit')} (first that does not: {mode.get('first_fail')}; "
          f"search {mode['status']})" + (f"\nNOT MEASURED: {mode['error']}" if mode.get("error") else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    results.save("vl", argv, data, args.out, args.rows, image_size=args.image_size,
                 load_in_4bit=args.load_in_4bit or None, gpu_budget_gb=args.gpu_budget_gb)
    return 0 if mode["status"] not in ("crashed", "refused") else 1


# ----------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)
    for name in ("sft", "grpo"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="qwen3-vl-8b", help="a Qwen3-VL shape of benchmarks/workload.py (tiny-vl: CPU)")
        s.add_argument("--image-size", type=int, default=None, help="side of every (square) image (448; tiny-vl 64)")
        s.add_argument("--out", default=None, help="write the JSON here")
        s.add_argument("--rows", default=None, help="result rows (JSON Lines; default: the --out path with .rows.jsonl)")
    sft = sub.choices["sft"]
    sft.add_argument("--modes", nargs="+", choices=SFT_MODES, default=SFT_MODES)
    sft.add_argument("--batch", type=int, default=16)
    sft.add_argument("--steps", type=int, default=10)
    sft.add_argument("--warmup", type=int, default=3)
    sft.add_argument("--max-text-length", type=int, default=1024, help="longest text of a row (reference workload)")
    sft.add_argument("--mode-timeout", type=int, default=280, help="seconds each mode's process may take")
    sft.add_argument("--one", choices=SFT_MODES, help=argparse.SUPPRESS)
    grpo = sub.choices["grpo"]
    grpo.add_argument("--generations", type=int, default=2, help="G: samples of the image prompt per step")
    grpo.add_argument("--prompt-tokens", type=int, default=256, help="text tokens of the prompt, besides the image")
    grpo.add_argument("--completion-lengths", type=int, nargs="*", default=None,
                      help="fixed completion lengths timed first (two steps each, the second reported)")
    grpo.add_argument("--fixed-only", action="store_true", help="no search: the fixed lengths only")
    grpo.add_argument("--no-share-prompt", dest="share_prompt", action="store_false",
                      help="every sample carries its prompt and image (default: the group's prompt once)")
    grpo.add_argument("--checkpointing", choices=["offload", "gpu"], default="offload",
                      help="offload: the layer inputs the GPU budget cannot hold in pinned host memory; gpu: all on it")
    grpo.add_argument("--no-offload-logits", dest="offload_logits", action="store_false",
                      help="keep the log-prob loss's saved hidden states on the GPU (GRPOConfig.offload_logits=False)")
    grpo.add_argument("--load-in-4bit", action="store_true", help="QLoRA: passed to FastModel.from_pretrained")
    grpo.add_argument("--gpu-budget-gb", type=float, default=None, help="emulate a GPU of this many GB (1e9 bytes)")
    grpo.add_argument("--checkpoint", default=None, help="where the random model is saved (default: a temp folder)")
    grpo.add_argument("--bisect-start", type=int, default=None, help="first completion of the search (16384; tiny 64)")
    grpo.add_argument("--bisect-max", type=int, default=None, help="largest completion tried (2**20; tiny 4096)")
    grpo.add_argument("--bisect-tol", type=float, default=0.05)
    grpo.add_argument("--bisect-granularity", type=int, default=None, help="lengths are multiples of it (256; tiny 16)")
    grpo.add_argument("--bisect-lo", type=int, default=None, help="resume: a completion known to fit")
    grpo.add_argument("--bisect-hi", type=int, default=None, help="resume: a completion known not to fit")
    grpo.add_argument("--time-budget", type=float, default=480.0, help="seconds for loading, trials and search")
    grpo.add_argument("--memory-profile-completion", type=int, default=None,
                      help="the trial at this completion records the caching allocator's history; what is alive "
                           "at its peak, by allocation site, is printed and kept in the JSON (benchmarks/memory_profile.py)")
    grpo.add_argument("--simulate-capacity", type=int, default=None,
                      help="smoke tests: trials above this many tokens count as out of memory")
    return p


def input_error(args) -> str | None:
    """What is wrong with the arguments, before any model is built (None: nothing)."""
    from benchmarks.workload import model_config

    vision = model_config(args.model).vision_config
    side = vision.patch_size * vision.spatial_merge_size
    if args.image_size < side:
        return f"--image-size must be at least {side} (one merged patch of the {args.model} vision tower)"
    if args.bench == "sft":
        if args.batch < 1 or args.steps < 1 or args.max_text_length < 2:
            return "--batch and --steps must be at least 1, --max-text-length at least 2"
        if args.warmup < 1 or args.warmup >= args.steps:
            return "--warmup must be at least 1 and smaller than --steps (the timed steps come after it)"
        return None
    if args.generations < 1 or args.prompt_tokens < 1:
        return "--generations and --prompt-tokens must be at least 1"
    if any(n < 2 for n in args.completion_lengths or []):
        return "every --completion-lengths value must be at least 2 tokens"
    if args.fixed_only and not args.completion_lengths:
        return "--fixed-only measures --completion-lengths only: give at least one"
    if args.gpu_budget_gb is not None and args.gpu_budget_gb <= 0:
        return "--gpu-budget-gb must be positive"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    tiny = args.model.startswith("tiny")
    from benchmarks.workload import MODEL_SHAPES

    if MODEL_SHAPES.get(args.model, {}).get("model_type") != "qwen3_vl":
        vl = [n for n, s in MODEL_SHAPES.items() if s.get("model_type") == "qwen3_vl"]
        print(f"benchmarks.vl: --model {args.model!r} is not a Qwen3-VL shape; choose one of {vl}", file=sys.stderr)
        return 2
    if args.image_size is None:
        args.image_size = 64 if tiny else 448
    error = input_error(args)
    if error:
        print(f"benchmarks.vl {args.bench}: {error}", file=sys.stderr)
        return 2
    import torch

    if not tiny and not torch.cuda.is_available():
        print("benchmarks.vl: real shapes need a CUDA device (use --model tiny-vl on CPU)", file=sys.stderr)
        return 2
    if args.bench == "sft":
        if args.one:
            print("RESULT " + json.dumps(run_sft_mode(args.one, args)), flush=True)
            return 0
        return run_sft(args, argv)
    for name, tiny_value, real_value in (("bisect_start", 64, 16384), ("bisect_max", 4096, 2**20),
                                         ("bisect_granularity", 16, 256)):
        if getattr(args, name) is None:
            setattr(args, name, tiny_value if tiny else real_value)
    return run_grpo(args, argv)


if __name__ == "__main__":
    sys.exit(main())
