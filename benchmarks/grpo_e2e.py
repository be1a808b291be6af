"""What a GRPO user waits for: one whole GRPOTrainer step, generation included, swiftune beside TRL's
and Unsloth's GRPOTrainer on the same random-init model and settings.

Each tool runs in its own child process (Unsloth patches transformers, PEFT and TRL on import):

  swiftune  ``swiftune.GRPOTrainer`` with its built-in rollout engine (the fast engine on CUDA), the
            model patched, LoRA r16 on all seven projections, gradient checkpointing
  trl       TRL's ``GRPOTrainer`` (generation through transformers ``generate``, ``use_vllm=False``),
            plain transformers (sdpa) + PEFT LoRA r16 on the same projections, gradient checkpointing
  unsloth   ``FastLanguageModel`` + Unsloth's patched ``GRPOTrainer`` without vLLM
            (``fast_inference=False``), its ``"unsloth"`` gradient checkpointing (wheels of
            ``<shared>/wheels/unsloth`` installed into a folder of their own)

The workload is the same for all three: ``--prompts`` (8) prompts of ``--prompt-tokens`` (256)
random token ids, ``--generations`` (G = 8) completions each, all 64 sampled in one generation per
optimizer step (``per_device_train_batch_size`` ``--micro-batch`` x ``gradient_accumulation_steps``
= prompts x G / micro-batch, TRL's ``steps_per_generation`` default), every completion run to
``--completion-tokens`` (4,096; no stop token: swiftune's engine is called without stop ids, TRL and
Unsloth get ``generation_kwargs={"min_new_tokens": L}``; the tokenizer's pad token is its eos, so that
no tool's completions hold the pad id: see :func:`e2e_tokenizer`), two reward functions (share of even token
ids, and the completion's length in words), ``beta`` 0 (TRL's default: no reference pass),
``loss_type="dapo"``, bf16. ``--steps`` (2) optimizer steps; the last is reported, split into
``generation`` (the tool's sampling call), ``scoring`` (rewards, old log-probs, advantages: the rest
of generate-and-score), ``policy`` (loss forward + backward of every micro-batch) and ``other``
(optimizer step, logging). Peak memory is ``max_memory_allocated`` over that step.

    python -m benchmarks.grpo_e2e --model qwen3-1.7b --modes swiftune trl --out grpo_e2e.json
    python -m benchmarks.grpo_e2e --model qwen3-1.7b --modes unsloth --shared .shared --out grpo_e2e_unsloth.json
    python -m benchmarks.grpo_e2e --model tiny --completion-tokens 32 --modes swiftune   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import child_env, module_command, results
from benchmarks.child_output import failure_summary, save_child_output

MODES = ("swiftune", "trl", "unsloth")
RESULT = "RESULT "


# ------------------------------------------------------------------------------------ workload


def e2e_tokenizer(vocab_size: int):
    """The word tokenizer with its pad token on eos (``t1``), for all three tools.

    A random-init model samples every id, the pad id included, about once per vocabulary-size tokens
    (~1.7 times in the 262,144 tokens of a 1.7B step). Unsloth's GRPO rebuilds its masks from the
    pad id (``input_ids != pad_token_id``, and the pad-id tokens moved to the row's end), so a sampled
    pad id in mid-completion shifts its rows: the likely cause of the gather index out of bounds that
    ended its 4,096-token run (not yet confirmed on a GPU). TRL and swiftune take each completion's
    length from the sampler instead. With pad on eos,
    the ``min_new_tokens`` that keeps TRL's and Unsloth's completions full length also keeps the pad id
    out of them, as a trained model's sampler would; swiftune's engine (no stop ids) may still sample
    the id, which it treats as any other token."""
    from benchmarks.workload import word_tokenizer

    return word_tokenizer(vocab_size, pad_token="t1")


def prompt_rows(args, vocab: int) -> list[dict]:
    """``--prompts`` plain-text prompts of the word tokenizer (``t{i}`` is token i): exact ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"prompt": " ".join(f"t{i}" for i in rng.integers(3, vocab, args.prompt_tokens))}
            for _ in range(args.prompts)]


class Rewards:
    """The two reward functions, recording the completion lengths they saw (the step's own count)."""

    def __init__(self):
        self.lengths: list[int] = []

    def even_tokens(self, prompts, completions, completion_ids=None, **kwargs) -> list[float]:
        self.lengths = [len(ids) for ids in completion_ids]
        return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

    @staticmethod
    def words(prompts, completions, **kwargs) -> list[float]:
        return [len(str(c).split()) / 1000.0 for c in completions]

    def functions(self) -> list:
        fns = [self.even_tokens, self.words]
        for fn, name in zip(fns, ("even_tokens", "words")):
            getattr(fn, "__func__", fn).__name__ = name  # the tools log rewards/<name>
        return fns


class StepClock:
    """Wall time of named phases (CUDA-synchronised), cleared at the start of every optimizer step."""

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.phases: dict[str, float] = {}
        self.step: dict = {}

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            seconds = time.perf_counter() - t0
            self.phases[name] = self.phases.get(name, 0.0) + seconds
            # progress in the child's output (kept beside --out): how far a process that crashes got
            print(f"# {name}: {seconds:.2f} s", flush=True)

    def wrap(self, obj, attr: str, name: str) -> bool:
        """Time every call of ``obj.attr`` as phase ``name``; False where ``obj`` has no such method."""
        orig = getattr(obj, attr, None)
        if orig is None:
            return False

        def timed(*a, **kw):
            with self.phase(name):
                return orig(*a, **kw)

        setattr(obj, attr, timed)
        return True

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, a, state, control, **kw):
                clock.sync()
                clock.phases.clear()
                if clock.cuda:
                    clock.torch.cuda.reset_peak_memory_stats()
                clock.step["t0"] = time.perf_counter()

            def on_step_end(self, a, state, control, **kw):
                clock.sync()
                clock.step["s"] = time.perf_counter() - clock.step["t0"]
                clock.step["peak_gb"] = clock.torch.cuda.max_memory_allocated() / 1e9 if clock.cuda else 0.0
                clock.step["phases"] = dict(clock.phases)
                print(f"# step {state.global_step}: {clock.step['s']:.2f} s, peak {clock.step['peak_gb']:.1f} GB, "
                      + ", ".join(f"{k} {v:.2f} s" for k, v in clock.phases.items()), flush=True)

        return Clock()


def time_trainer(trainer, clock: StepClock, generate_owner, generate_attr: str) -> None:
    """Phases of TRL's method names (swiftune's trainer uses its own, passed by the caller)."""
    clock.wrap(generate_owner, generate_attr, "generation")
    for attr in ("_generate_and_score_completions", "_generate_and_score"):
        if clock.wrap(trainer, attr, "generate_and_score"):
            break
    clock.wrap(trainer, "compute_loss", "policy_forward")
    clock.wrap(trainer.accelerator, "backward", "policy_backward")


def step_record(args, mode: str, clock: StepClock, rewards: Rewards, extra: dict) -> dict:
    import torch

    p = clock.step["phases"]
    generation = p.get("generation", 0.0)
    scoring = p.get("generate_and_score", 0.0) - generation
    policy = p.get("policy_forward", 0.0) + p.get("policy_backward", 0.0)
    step_s = clock.step["s"]
    phases = {"generation": generation, "scoring": scoring, "policy": policy,
              "other": step_s - generation - scoring - policy}
    lengths = rewards.lengths
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "trl", "unsloth"):
        with contextlib.suppress(Exception):
            versions[name] = __import__(name).__version__
    return dict(benchmark="grpo_e2e", mode=mode, model=args.model, prompts=args.prompts, generations=args.generations,
                prompt_tokens=args.prompt_tokens, max_completion_length=args.completion_tokens,
                micro_batch=args.micro_batch, steps=args.steps, step_s=step_s, phases=phases,
                peak_gb=clock.step["peak_gb"], generated_tokens=sum(lengths), completions=len(lengths),
                all_full_length=bool(lengths) and all(n == args.completion_tokens for n in lengths),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                versions=versions, **extra)


def common_config(args, cuda: bool) -> dict:
    """The GRPOConfig fields the three tools share (TRL's names and meanings)."""
    completions = args.prompts * args.generations
    if completions % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide prompts x generations = {completions}")
    return dict(output_dir=tempfile.mkdtemp(prefix="grpo-e2e-"), max_steps=args.steps,
                per_device_train_batch_size=args.micro_batch,
                gradient_accumulation_steps=completions // args.micro_batch,
                num_generations=args.generations, max_completion_length=args.completion_tokens, temperature=1.0,
                beta=0.0, loss_type="dapo", learning_rate=1e-6, logging_steps=1, save_strategy="no",
                report_to="none", bf16=cuda, use_cpu=not cuda, seed=0, disable_tqdm=True,
                dataloader_pin_memory=False)


# -------------------------------------------------------------------------------------- children


def child_swiftune(args) -> dict:
    import torch

    from benchmarks.grpo import build_swiftune_model
    from swiftune import GRPOConfig, GRPOTrainer
    from swiftune.rl import TransformersRolloutEngine
    from swiftune.rl.rollout.fast import FastRolloutEngine

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_swiftune_model(args.model, device, True)
    engine_cls = FastRolloutEngine if cuda else TransformersRolloutEngine

    class FullLength(engine_cls):
        """The built-in engine with no stop token: every completion runs to max_completion_length."""

        def generate(self, prompt_ids, num_generations, params):
            return super().generate(prompt_ids, num_generations, dataclasses.replace(params, stop_token_ids=()))

    tokenizer = e2e_tokenizer(model.config.vocab_size)
    engine = FullLength(model, pad_token_id=tokenizer.pad_token_id, seed=0)
    clock, rewards = StepClock(cuda), Rewards()
    config = GRPOConfig(**common_config(args, cuda), max_prompt_length=args.prompt_tokens, metrics_file=None,
                        plot_rewards=False, gradient_checkpointing=False)  # already on (get_peft_model)
    trainer = GRPOTrainer(model, rewards.functions(), args=config,
                          train_dataset=prompt_rows(args, model.config.vocab_size),
                          processing_class=tokenizer, rollout_engine=engine)
    time_trainer(trainer, clock, engine, "generate")
    trainer.add_callback(clock.callback())
    trainer.train()
    # the fast engine's KV cache is in the step's peak (kept between steps when it is small next to the GPU);
    # TRL's and Unsloth's generate() allocate theirs during generation too, counted the same way
    kv_cache_gb = getattr(engine, "stats", {}).get("kv_cache_bytes", 0.0) / 1e9
    return step_record(args, "swiftune", clock, rewards, {"engine": type(engine).__mro__[1].__name__,
                                                           "kv_cache_gb": kv_cache_gb})


def trl_dataset(rows: list[dict]):
    """TRL's trainers take a ``datasets.Dataset`` only."""
    from datasets import Dataset

    return Dataset.from_list(rows)


def trl_config(args, cuda: bool, config_cls):
    return config_cls(**common_config(args, cuda), gradient_checkpointing=True, use_vllm=False,
                      generation_kwargs={"min_new_tokens": args.completion_tokens})


def train_trl_style(args, mode: str, model, tokenizer, trainer_cls, config_cls, cuda: bool) -> dict:
    """TRL's GRPOTrainer (or Unsloth's patched one) on the shared workload, timed per phase."""
    clock, rewards = StepClock(cuda), Rewards()
    trainer = trainer_cls(model=model, reward_funcs=rewards.functions(), args=trl_config(args, cuda, config_cls),
                          train_dataset=trl_dataset(prompt_rows(args, model.config.vocab_size)),
                          processing_class=tokenizer)
    time_trainer(trainer, clock, trainer, "_generate")
    trainer.add_callback(clock.callback())
    trainer.train()
    return step_record(args, mode, clock, rewards, {})


def child_trl(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.workload import random_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = random_model(args.model, device, torch.bfloat16 if cuda else torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    return train_trl_style(args, "trl", model, e2e_tokenizer(model.config.vocab_size), GRPOTrainer, GRPOConfig, cuda)


def save_checkpoint(args) -> None:
    """A plain transformers process (never Unsloth) writes the random-init model + word tokenizer."""
    import torch

    from benchmarks.workload import random_model

    model = random_model(args.model, torch.device("cpu"), torch.bfloat16)
    model.save_pretrained(args.save_checkpoint)
    e2e_tokenizer(model.config.vocab_size).save_pretrained(args.save_checkpoint)


def child_unsloth(args) -> dict:
    import importlib

    importlib.import_module("unsloth")  # first: it patches transformers, PEFT and TRL
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from unsloth import FastLanguageModel

    # Unsloth sizes its caches by max_seq_length; its notebooks leave room above prompt + completion, and so
    # does this (the next multiple of 1,024) rather than end generation exactly at the edge
    max_seq_length = -(-(args.prompt_tokens + args.completion_tokens) // 1024) * 1024
    model, tokenizer = FastLanguageModel.from_pretrained(
        args.model_dir, max_seq_length=max_seq_length, dtype=torch.bfloat16,
        load_in_4bit=False, fast_inference=False, local_files_only=True,
        offload_embedding=False)  # as the anchors: "auto" may move the embedding to host RAM; the others keep it
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none", use_gradient_checkpointing="unsloth",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return train_trl_style(args, "unsloth", model, tokenizer, GRPOTrainer, GRPOConfig, True)


CHILDREN = {"swiftune": child_swiftune, "trl": child_trl, "unsloth": child_unsloth}


# ---------------------------------------------------------------------------------------- parent


def run_child(mode: str, args, extra: list[str], env: dict) -> dict:
    """The record one child prints on its ``RESULT`` line, or an ``error`` record with its output's tail."""
    cmd = module_command("grpo_e2e", "--child", mode, *extra)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "model": args.model, "error": f"out of time ({args.timeout:.0f} s)"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            rec = json.loads(line[len(RESULT):])
            rec["wall_s"] = time.perf_counter() - t0
            return rec
    output = proc.stdout + proc.stderr
    log = save_child_output(args.out, mode, output)
    return {"mode": mode, "model": args.model, "error": f"exit {proc.returncode}: " + failure_summary(output),
            **({"log": log} if log else {})}


def workload_args(args) -> list[str]:
    return ["--model", args.model, "--prompts", str(args.prompts), "--generations", str(args.generations),
            "--prompt-tokens", str(args.prompt_tokens), "--completion-tokens", str(args.completion_tokens),
            "--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]


def unsloth_env_and_dir(args) -> tuple[dict, str]:
    """Unsloth's wheels installed into their own folder, and the model checkpoint it loads."""
    from benchmarks.unsloth_sft import anchor_env, install_wheels

    site = args.site or install_wheels(os.path.join(args.shared, "wheels", "unsloth"))
    model_dir = args.model_dir or tempfile.mkdtemp(prefix=f"grpo-e2e-{args.model}-")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        subprocess.run(module_command("grpo_e2e", "--save-checkpoint", model_dir, "--model", args.model),
                       env=child_env(), check=True)
    env = anchor_env(site)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env["PYTHONPATH"], child_env()["PYTHONPATH"]) if p)
    return env, model_dir


def print_table(records: list[dict]) -> None:
    print(f"\n{'mode':10} {'model':12} {'step s':>8} {'x swiftune':>10} {'gen s':>8} {'score s':>8} {'policy s':>8} "
          f"{'other s':>8} {'peak GB':>8} {'tokens':>8} full")
    ours = next((r["step_s"] for r in records if r.get("mode") == "swiftune" and "step_s" in r), None)
    for r in records:
        if "error" in r:
            print(f"{r['mode']:10} {r['model']:12} FAILED: {r['error'][:300]}")
            continue
        p = r["phases"]
        ratio = f"{r['step_s'] / ours:10.2f}" if ours else f"{'':10}"
        print(f"{r['mode']:10} {r['model']:12} {r['step_s']:8.1f} {ratio} {p['generation']:8.1f} {p['scoring']:8.1f} "
              f"{p['policy']:8.1f} {p['other']:8.1f} {r['peak_gb']:8.1f} {r['generated_tokens']:8d} "
              f"{r['all_full_length']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="a shape of benchmarks/workload.py (tiny: CPU smoke test)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["swiftune", "trl"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size (completions)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps; the last is reported")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per tool")
    p.add_argument("--shared", default=".shared", help="the shared folder (Unsloth's wheels)")
    p.add_argument("--site", default=None, help="a folder where Unsloth's wheels are installed already")
    p.add_argument("--model-dir", default=None, help="Unsloth: the random-init checkpoint (written if absent)")
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=None)
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--save-checkpoint", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.save_checkpoint:
        save_checkpoint(args)
        return 0
    if args.child:
        print(RESULT + json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0
    from swiftune.training.checkpoints import write_json_atomic

    records: list[dict] = []
    data = {"benchmark": "grpo_e2e", "rows": records}
    for mode in args.modes:
        env, extra = child_env(), workload_args(args)
        if mode == "unsloth":
            env, model_dir = unsloth_env_and_dir(args)
            extra += ["--model-dir", model_dir]
        rec = run_child(mode, args, extra, env)
        print(json.dumps(rec), flush=True)
        records.append(rec)
        if args.out:  # after every tool: a run stopped during a later tool keeps the finished ones
            write_json_atomic(args.out, data)
    print_table(records)
    results.save("grpo_e2e", argv, data, args.out, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
