"""Unsloth's documented SFT notebook flow as one script, run through Unsloth or through swiftune
with only the imports changed (``--impl unsloth|swiftune``).

The flow is the one of Unsloth's Llama / Qwen3 SFT notebooks: ``FastLanguageModel.from_pretrained``
(``model_name``, ``max_seq_length``, ``dtype``, ``load_in_4bit``), ``FastLanguageModel.get_peft_model``
(r=16 on the seven projections, ``use_gradient_checkpointing="unsloth"``, ``random_state``), chats
turned into a ``text`` column with the tokenizer's chat template, TRL's ``SFTTrainer`` and
``SFTConfig`` with the notebook's arguments, ``trainer.train()``, then
``FastLanguageModel.for_inference`` and a short ``generate``, and ``model.save_pretrained`` of the
adapter. What differs from a notebook: the model is a tiny random-init folder (no hub downloads;
``--save-model DIR`` writes one with plain transformers, in a process that never imports Unsloth),
the generation is greedy (comparable), Unsloth's ``get_chat_template`` is not called (the
folder's tokenizer brings its template; it is an Unsloth-only helper, not a name swiftune has). The
trainer gets ``tokenizer=tokenizer`` as the notebooks write it: Unsloth's patched trainer and
swiftune's take that name (TRL 1.16's asks for ``processing_class``).

    python tests/compat/unsloth_flow.py --save-model /tmp/tiny-qwen3 --family qwen3
    PYTHONPATH=src python tests/compat/unsloth_flow.py --impl swiftune --model /tmp/tiny-qwen3 --out-dir /tmp/sw
    PYTHONPATH=/tmp/site-unsloth python tests/compat/unsloth_flow.py --impl unsloth --model /tmp/tiny-qwen3 --out-dir /tmp/us

It prints one line ``RESULT {json}``: per-step losses, the logged metric names and ``num_tokens``,
the initial LoRA A and final LoRA tensors' norms and sums (the tensors themselves go to
``--out-dir``: ``lora_init.safetensors``, ``lora_final.safetensors`` and the adapter folder
``lora_model``), the prompt and the generated token ids. tests/compat/test_unsloth_flow.py runs it.

Unsloth patches transformers, PEFT and TRL when it is imported, so ``--impl unsloth`` imports it
before anything else of the Hugging Face stack (and this file imports none at module level).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Chats of a learnable toy task (a fixed reply pattern per question): the random-init model's loss
# falls within a few steps, so "training trains" can be checked.
NAMES = ("apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "honey", "ocean", "train", "maple",
         "zebra", "candle", "forest", "silver", "window")
PROMPT = [{"role": "user", "content": "Spell tiger."}]


def chat_rows() -> list[dict[str, Any]]:
    """The notebook's conversations (a ``conversations`` column of role/content turns)."""
    return [{"conversations": [{"role": "user", "content": f"Spell {w}."},
                               {"role": "assistant", "content": " ".join(w) + "."}]} for w in NAMES]


def save_tiny_model(path: str, family: str, seed: int = 0) -> str:
    """A random-init tiny ``family`` model (swiftune's tiny config: hidden 128, 2 layers, GQA 4/2
    heads of 32) in float32 and the project's byte-level tokenizer (chat template, pad token),
    written with plain transformers' ``save_pretrained``. Run it in a process that does not import
    Unsloth (``--save-model``): Unsloth's patches must not touch the saved weights."""
    import torch
    import transformers

    from swiftune.data.builtin import build_tokenizer, tiny_model_config

    torch.manual_seed(seed)
    config = tiny_model_config(family)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def import_library(impl: str) -> tuple[Any, Any, Any]:
    """``(FastLanguageModel, SFTTrainer, SFTConfig)`` the way each library's user imports them:
    this function is the only place where the two runs differ."""
    if impl == "unsloth":
        # The GPU machine has no network: Unsloth must not look for updates or report statistics.
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
            os.environ.setdefault(name, "1")
        from unsloth import FastLanguageModel  # first: it patches transformers, PEFT and TRL on import
        from trl import SFTConfig, SFTTrainer
    elif impl == "swiftune":
        from swiftune import FastLanguageModel, SFTConfig, SFTTrainer
    else:
        raise SystemExit(f"--impl must be unsloth or swiftune, not {impl!r}")
    return FastLanguageModel, SFTTrainer, SFTConfig


def tensor_stats(tensors: dict) -> dict[str, list[float]]:
    """``name -> [L2 norm, sum]`` in float64, a checksum that survives JSON."""
    return {n: [float(t.double().norm()), float(t.double().sum())] for n, t in sorted(tensors.items())}


def lora_tensors(model, which: str = "lora_") -> dict:
    """Float32 CPU copies of the parameters whose name contains ``which`` (``clone``: on a float32 CPU
    model ``.float().cpu()`` would return the live parameter, which training then changes)."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if which in n}


def notebook(impl: str, model_name: str, out_dir: str, max_steps: int, learning_rate: float, load_in_4bit: bool,
             optim: str, max_seq_length: int = 256, max_new_tokens: int = 12) -> dict[str, Any]:
    """Unsloth's SFT notebook, step for step; returns what the ``RESULT`` line reports."""
    FastLanguageModel, SFTTrainer, SFTConfig = import_library(impl)
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    dtype = None  # None for auto detection: bf16 on a GPU that has it, else float32 (swiftune) / float16
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_name,
        max_seq_length=max_seq_length,
        dtype=dtype,
        load_in_4bit=load_in_4bit,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
    )
    lora_init = lora_tensors(model, "lora_A")

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False) for convo in convos]
        return {"text": texts}

    dataset = Dataset.from_list(chat_rows())
    dataset = dataset.map(formatting_prompts_func, batched=True)

    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        eval_dataset=None,
        args=SFTConfig(
            dataset_text_field="text",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            warmup_steps=2,
            max_steps=max_steps,
            learning_rate=learning_rate,
            logging_steps=1,
            optim=optim,
            weight_decay=0.001,
            lr_scheduler_type="linear",
            seed=3407,
            output_dir=os.path.join(out_dir, "outputs"),
            report_to="none",
        ),
    )
    started = time.perf_counter()
    trainer_stats = trainer.train()
    train_s = time.perf_counter() - started
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]

    FastLanguageModel.for_inference(model)
    inputs = tokenizer.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt").to(model.device)
    outputs = model.generate(**inputs, max_new_tokens=max_new_tokens, use_cache=True, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()

    lora_final = lora_tensors(model)
    save_file(lora_init, os.path.join(out_dir, "lora_init.safetensors"))
    save_file(lora_final, os.path.join(out_dir, "lora_final.safetensors"))
    model.save_pretrained(os.path.join(out_dir, "lora_model"))
    tokenizer.save_pretrained(os.path.join(out_dir, "lora_model"))
    return {
        "impl": impl,
        "model": model_name,
        "load_in_4bit": load_in_4bit,
        "device": str(model.device),
        "dtype": str(model.get_input_embeddings().weight.dtype),
        "losses": [h["loss"] for h in logs],
        "num_tokens": [h.get("num_tokens") for h in logs],
        "metric_names": sorted(set().union(*(h.keys() for h in logs))) if logs else [],
        "global_step": trainer_stats.global_step,
        "lora_init": tensor_stats(lora_init),
        "lora_final": tensor_stats(lora_final),
        "prompt_ids": prompt_ids,
        "generated_ids": outputs[0, len(prompt_ids):].tolist(),
        "train_s": round(train_s, 2),
        "versions": {"torch": torch.__version__, **library_versions(impl)},
    }


def library_versions(impl: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "peft", "trl", "unsloth" if impl == "unsloth" else "swiftune"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["unsloth", "swiftune"], help="which library the notebook imports")
    parser.add_argument("--model", help="the tiny model folder (from --save-model)")
    parser.add_argument("--out-dir", help="where the LoRA tensors, the adapter and the trainer's output go")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=2e-3,
                        help="the notebook's 2e-4 moves a random-init tiny model too little to see in 6 steps")
    parser.add_argument("--optim", default="adamw_8bit", help="the notebook's (bitsandbytes' 8-bit AdamW)")
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA, as the notebook's default")
    parser.add_argument("--save-model", metavar="DIR", help="only write a tiny random-init model to DIR and exit")
    parser.add_argument("--family", default="qwen3", choices=["qwen3", "llama"], help="with --save-model")
    args = parser.parse_args(argv)
    if args.save_model:
        print(save_tiny_model(args.save_model, args.family))
        return 0
    if not (args.impl and args.model and args.out_dir):
        parser.error("--impl, --model and --out-dir are needed (or --save-model DIR)")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    result = notebook(args.impl, args.model, args.out_dir, args.max_steps, args.learning_rate, args.load_in_4bit,
                      args.optim)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
