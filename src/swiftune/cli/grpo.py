"""``swiftune grpo``: the command, and its built-in toy task.

    swiftune grpo [CONFIG.yaml] [--key value ...]

Options are the fields of :class:`GRPOModelArguments` and of :class:`swiftune.GRPOConfig`
(transformers' ``TrainingArguments`` plus GRPO's); a YAML file gives the same keys and
command-line options override it.

With no ``--model_name_or_path`` it runs the built-in task, small enough for a CPU (on the GPU
when there is one): a random tiny Qwen3-shaped model first learns the format of the task with a
short SFT warm-up (swiftune's ``SFTTrainer``), then GRPO improves it with a checkable reward:

* task: ``"Reverse: {word}\\n"`` -> the word's letters in reverse order (3 to 5 letters from a-h);
* reward :func:`reverse_reward`: the fraction of positions where the completion has the right
  letter, over the longer of the two lengths (partial credit; 1.0 = exact).

It writes ``metrics.jsonl`` (one object a step: step, reward, reward_std, completion_length, kl,
loss, ...), ``reward.png`` and the model to ``output_dir``, and prints the mean reward over the
first and the last fifth of the run.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

# The command sits above both trainers: it is the one place that uses them together (the SFT
# warm-up before GRPO), which keeps the trainers themselves from importing each other.
from .arguments import ModelArguments, parse_command_args
from .runs import build_model, describe_training, load_eval_rows, load_rows, train_save_and_report

_ALPHABET = "abcdefgh"


@dataclass
class GRPOModelArguments(ModelArguments):
    """The options of ``swiftune sft``'s model arguments, plus rewards and the built-in warm-up."""

    reward_funcs: str | None = field(
        default=None,
        metadata={"help": "Comma-separated reward functions: built-in names (reverse, exact_match, final_answer) "
                          "or module:function import paths, or path/to/file.py:function. Required with "
                          "--dataset; without one the built-in reversal task uses reverse."},
    )
    sft_warmup_steps: int | None = field(
        default=None,
        metadata={"help": "Built-in model and task only: SFT steps on the reversal task before GRPO (0: none; "
                          "unset: 60 there, none elsewhere)."},
    )


# Settings of the built-in run: a tiny model, short prompts and completions, a high learning rate,
# so that the reward visibly rises within a short CPU run.
BUILTIN_GRPO_DEFAULTS = dict(
    output_dir="swiftune_output/grpo", max_steps=100, per_device_train_batch_size=64, num_generations=8,
    max_prompt_length=32, max_completion_length=8, learning_rate=1e-3, lr_scheduler_type="constant",
    warmup_steps=0, beta=0.04, temperature=1.0, loss_type="dapo", save_strategy="no",
    use_gradient_checkpointing="false",
)


# ----------------------------------------------------------------------------- the toy task

def builtin_reverse_dataset(num_rows: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"prompt": "Reverse: abc\\n", "answer": "cba"}`` (3-5 letters from a-h), deterministic."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        word = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(3, 5)))
        rows.append({"prompt": f"Reverse: {word}\n", "answer": word[::-1]})
    return rows


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return completion[-1].get("content", "") if completion else ""
    return str(completion)


def reverse_reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """Fraction of positions with the right character, over the longer of answer and completion."""
    out = []
    for completion, target in zip(completions, answer):
        text = _completion_text(completion).strip()
        hits = sum(a == b for a, b in zip(text, target))
        out.append(hits / max(len(text), len(target), 1))
    return out


def exact_match_reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the stripped completion equals ``answer``, else 0.0."""
    return [float(_completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else the last number in ``text``."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").strip())
    except (AttributeError, ValueError):
        return None


def final_answer_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer (last ``\\boxed{}``, else last number) equals ``answer``.

    Numbers compare numerically (``1,000`` == ``1000.0``), anything else as stripped strings.
    """
    out = []
    for completion, target in zip(completions, answer):
        got = _final_answer(_completion_text(completion))
        if got is None:
            out.append(0.0)
            continue
        a, b = _as_number(got), _as_number(str(target))
        out.append(float(a == b) if a is not None and b is not None else float(got == str(target).strip()))
    return out


BUILTIN_REWARDS = {"reverse": reverse_reward, "exact_match": exact_match_reward, "final_answer": final_answer_reward}


def resolve_reward_funcs(spec: str) -> list:
    """``"reverse,pkg.mod:fn,./my_rewards.py:fn"`` -> functions: built-in names, ``module:function``
    (an importable module) or ``path.py:function`` (a Python file, loaded as a module).

    A name that resolves to no function raises :class:`ConfigError` saying what to give instead."""
    funcs = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name in BUILTIN_REWARDS:
            funcs.append(BUILTIN_REWARDS[name])
        elif ":" in name:
            where, attr = name.rsplit(":", 1)
            module = _load_reward_module(where, name)
            if not callable(getattr(module, attr, None)):
                raise ConfigError(f"reward function {name!r}: {where} has no function {attr!r}; name a function "
                                  f"that {where} defines")
            funcs.append(getattr(module, attr))
        else:
            raise ConfigError(f"unknown reward function {name!r}: use one of {sorted(BUILTIN_REWARDS)}, "
                              "module:function or path/to/file.py:function")
    if not funcs:
        raise ConfigError("--reward_funcs names no function; give a built-in name (e.g. reverse), "
                          "module:function or path/to/file.py:function")
    return funcs


def _load_reward_module(where: str, spec: str):
    import importlib
    import importlib.util

    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(f"reward function {spec!r}: no file {where}; give the path of an existing "
                              "Python file")
        module_name = "swiftune_rewards_" + os.path.splitext(os.path.basename(where))[0]
        loader_spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)  # the user's own reward file, imported like any module
        return module
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise ConfigError(f"reward function {spec!r}: cannot import {where} ({e}); give an importable "
                          "module or path/to/file.py") from e


# ----------------------------------------------------------------------------- the command

def parse_grpo_args(argv: list[str]):
    """``(model_args, GRPOConfig, builtin)`` from a command line (YAML first, then options)."""
    from ..rl import GRPOConfig

    return parse_command_args(argv, (GRPOModelArguments, GRPOConfig), "swiftune grpo",
                              "GRPO with swiftune. " + (__doc__ or ""), BUILTIN_GRPO_DEFAULTS, "swiftune_output/grpo")


def sft_warmup(model, tokenizer, rows: list[dict], steps: int, config) -> None:
    """A short SFT on ``prompt -> answer`` so that GRPO starts from a model that knows the format. It runs
    where the GRPO run does (``config``'s device and distributed settings: under torchrun every process
    takes part, as in the GRPO run after it)."""
    from ..sft import SFTConfig, SFTTrainer

    data = [{"prompt": r["prompt"], "completion": r["answer"]} for r in rows]
    args = SFTConfig(
        output_dir=os.path.join(config.output_dir, "sft_warmup"), max_steps=steps, per_device_train_batch_size=16,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5, max_length=64, save_strategy="no",
        report_to="none", seed=config.seed, disable_tqdm=config.disable_tqdm, logging_steps=10, plot_loss=False,
        use_cpu=config.use_cpu, ddp_backend=config.ddp_backend,
    )
    SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer).train()


BUILTIN_WARMUP_STEPS = 60  # enough SFT for the tiny model to answer in the task's format


def builtin_warmup_steps(model_args: GRPOModelArguments, builtin: bool) -> int:
    """The SFT warm-up's steps: ``--sft_warmup_steps`` where it applies (the built-in model on the
    built-in task), :data:`BUILTIN_WARMUP_STEPS` there when unset, else 0. A warm-up asked for where it
    cannot apply (a model of the user's, or the user's dataset) raises :class:`ConfigError`: it would
    otherwise be skipped without a word."""
    steps = model_args.sft_warmup_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        raise ConfigError(f"--sft_warmup_steps {steps!r}: must be a whole number of steps >= 0 (0: no warm-up)")
    applies = builtin and model_args.dataset is None
    if steps is None:
        return BUILTIN_WARMUP_STEPS if applies else 0
    if steps > 0 and not applies:
        given = "--model_name_or_path" if not builtin else "--dataset"
        raise ConfigError(f"--sft_warmup_steps {steps}: the SFT warm-up trains the built-in tiny model on the "
                          f"built-in reversal task, and {given} replaces it; drop --sft_warmup_steps (or "
                          "warm your model up with swiftune sft first)")
    return steps


def command_reward_spec(model_args: GRPOModelArguments) -> str:
    """``--reward_funcs``, or ``reverse`` on the built-in reversal rows. The user's dataset needs its
    own: the toy task's reward would score its completions against whatever ``answer`` column it has
    (or fail at the first rollout without one), so it is refused before any model loads."""
    if model_args.reward_funcs is not None:
        return model_args.reward_funcs
    if model_args.dataset is None:
        return "reverse"
    raise ConfigError(f"--dataset {model_args.dataset}: name the reward functions that score its completions "
                      "with --reward_funcs (built-in exact_match or final_answer against an 'answer' column, "
                      "module:function, or path/to/file.py:function; comma-separated for several)")


def run_grpo(argv: list[str]) -> int:
    """``swiftune grpo``: train, save, and report the reward of the first and last fifth."""
    from ..rl import GRPOTrainer

    model_args, config, builtin = parse_grpo_args(argv)
    warmup_steps = builtin_warmup_steps(model_args, builtin)
    # resolved before any model is built, so that a mistyped reward function costs no model load
    reward_funcs = resolve_reward_funcs(command_reward_spec(model_args))
    if config.reward_weights is not None and len(config.reward_weights) != len(reward_funcs):
        raise ConfigError(f"--reward_weights gives {len(config.reward_weights)} weights for {len(reward_funcs)} "
                          "reward functions: give one weight per --reward_funcs entry, in the same order")
    rows = load_rows(model_args.dataset, model_args.dataset_split, builtin_reverse_dataset)

    def warm_up(model, tokenizer) -> None:
        if warmup_steps > 0:
            if config.process_index == 0:  # once under torchrun
                print(f"swiftune grpo: SFT warm-up, {warmup_steps} steps on the reversal task")
            sft_warmup(model, tokenizer, builtin_reverse_dataset(num_rows=2000, seed=config.seed + 1),
                       warmup_steps, config)

    model, tokenizer, use_lora = build_model(model_args, config, builtin, prepare_builtin=warm_up)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config,
                          train_dataset=rows, eval_dataset=load_eval_rows(model_args), processing_class=tokenizer)
    if trainer.is_world_process_zero():  # once under torchrun
        print(f"swiftune grpo: {len(trainer.train_dataset)} prompts, G={config.num_generations}, "
              f"{config.prompts_per_generation} prompts per generation, loss {config.loss_type}"
              f"{' (GSPO)' if config.importance_sampling_level == 'sequence' else ''}, beta {config.beta}, "
              f"{describe_training(use_lora, model_args.lora_r)}; device {trainer.args.device}")
    train_save_and_report(trainer, config, tokenizer, "reward", "reward.png")
    return 0

