"""The options of the training commands (``swiftune sft``, ``swiftune grpo``) and how they are read.

A command's options are the fields of dataclasses: :class:`ModelArguments` (what to train, on what
data, LoRA) and the trainer's config (``SFTConfig`` / ``GRPOConfig``, transformers'
``TrainingArguments`` plus the trainer's fields). transformers' ``HfArgumentParser`` turns the
fields into ``--key value`` options and their ``help`` metadata into ``--help``; a YAML file gives
the same keys. This module adds what a user needs on top: exact option names (no silent
abbreviations), list options taking space- or comma-separated values, ``none`` for optional
numbers, YAML lists and nulls, and every mistake as one :class:`CommandLineError` naming the
option and the fix, raised before any model or data loads.

TRL's ``trl sft`` / ``trl grpo`` option names are accepted where swiftune spells the same option
differently (``--dataset_name`` for ``--dataset``, ``--use_peft`` for ``--use_lora``, ...: the
``aliases`` of :class:`ModelArguments`' fields, listed in ``--help`` next to the option), so that a
TRL command line or YAML runs as it is; giving an alias and its swiftune name together is an error,
and a TRL name with no swiftune equivalent (:data:`TRL_UNSUPPORTED`) says what to do instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

logger = logging.getLogger(__name__)


def trl_alias(name: str) -> list[str]:
    """The option strings of TRL's name for a swiftune option (``--name`` and ``--name-with-hyphens``,
    as transformers' parser spells every field), for a field's ``aliases`` metadata."""
    return [f"--{name}", f"--{name.replace('_', '-')}"]


# TRL options that swiftune has no equivalent for: the message says what to do instead.
TRL_UNSUPPORTED: dict[str, str] = {
    "dataset_config": "swiftune loads a hub dataset without a configuration name; load that configuration "
                      "with datasets.load_dataset(name, config), save it with .to_json('rows.jsonl') and pass "
                      "--dataset rows.jsonl",
}


@dataclass
class ModelArguments:
    """What to train and on what data."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local path or hub name of a causal LM; none: the built-in tiny model."}
    )
    dataset: str | None = field(
        default=None,
        metadata={"help": "JSONL/JSON/Parquet path, or a hub dataset name (needs `datasets`); none: built-in data.",
                  "aliases": trl_alias("dataset_name")},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a hub dataset.",
                                                          "aliases": trl_alias("dataset_train_split")})
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Held-out rows (same formats as --dataset), evaluated every --eval_steps with "
                          "--eval_strategy steps; SFT reports eval_loss, GRPO eval_reward."},
    )
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of a hub eval dataset.",
                                                              "aliases": trl_alias("dataset_test_split")})
    dtype: str = field(default="auto", metadata={"help": "Model weights dtype: auto (bf16 on GPU), bf16 (bfloat16), "
                                                         "fp16 (float16), fp32 (float32).",
                                                 "aliases": trl_alias("torch_dtype")})
    load_in_4bit: bool = field(
        default=False, metadata={"help": "QLoRA: load the decoder's linear weights in 4-bit NF4 (bitsandbytes: "
                                         "pip install 'swiftune[qlora]'); LoRA adapters train on top."}
    )
    load_in_fp8: bool = field(
        default=False, metadata={"help": "The decoder's linear weights in FP8 (float8_e4m3fn, a scale per row; "
                                         "FP8 tensor cores on GPUs with compute capability >= 8.9); LoRA adapters "
                                         "train on top."}
    )
    use_lora: bool | None = field(
        # nargs "?" and const: a bare --use_lora (or TRL's --use_peft) means true
        default=None, metadata={"help": "Train LoRA adapters (default for real models) or the full model (false; "
                                        "default for the built-in tiny model).",
                                "aliases": trl_alias("use_peft"), "nargs": "?", "const": True}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Module names to adapt (space- or comma-separated; a list in YAML), or all-linear."},
    )
    lora_target_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Parameters to adapt besides the modules (PEFT's target_parameters, TRL's option): "
                          "mixture-of-experts weights stored as parameters, which all-linear does not reach, "
                          "e.g. mlp.experts.gate_up_proj mlp.experts.down_proj on gpt-oss."},
    )
    use_gradient_checkpointing: str = field(
        default="true", metadata={"help": "true, false, or offload (saved layer inputs in CPU memory; unsloth is the same)."}
    )
    offload_gpu_budget_gb: float | None = field(
        default=None, metadata={"help": "With --use_gradient_checkpointing offload: GB of GPU memory the kept "
                                        "layer inputs may take (default: as many as fit; 0: every one on the host, "
                                        "the least GPU memory)."}
    )
    tiled_mlp: bool | None = field(
        default=None, metadata={"help": "Run the MLP and LoRA projections in sequence tiles (a long row's MLP "
                                        "temporaries stay ~1 GiB). Default: with --use_gradient_checkpointing "
                                        "offload; false is faster for batches of short rows (LoRA only).",
                                "nargs": "?", "const": True}
    )
    offload_attention_output_layers: int = field(
        default=0, metadata={"help": "With --use_gradient_checkpointing offload: the last N decoder layers keep "
                                     "their attention outputs on the GPU through the recompute instead of running "
                                     "the attention again (long completions: faster steps for 2 x Hq x D bytes a "
                                     "token and layer; default 0)."}
    )
    offload_attention_outputs_on_host: bool = field(
        default=False, metadata={"help": "With --offload_attention_output_layers N: keep those outputs in pinned "
                                         "host memory instead of on the GPU (copied like the offloaded layer "
                                         "inputs; the GPU holds two layers' at a time)."}
    )


class CommandLineError(ConfigError):
    """A command line or YAML config the command cannot run; the message names the option and the fix.
    ``swiftune`` prints it as one line and exits with status 2."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose mistakes raise :class:`CommandLineError` (one line from ``swiftune``, as the
    training commands' mistakes) instead of printing the whole usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise CommandLineError(f"{message} (--help lists the options)")


def read_yaml_config(path: str) -> dict[str, Any]:
    """The option mapping of a YAML config file (``yaml.safe_load``: plain data only)."""
    import yaml

    if not os.path.isfile(path):
        raise CommandLineError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        raise CommandLineError(f"config file {path}{at}: not valid YAML: {getattr(e, 'problem', None) or e}") from e
    except UnicodeDecodeError as e:
        raise CommandLineError(f"config file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise CommandLineError(f"config file {path}: expected a mapping of option names to values, "
                               f"got a {type(config).__name__}")
    return config


@dataclass
class _Option:
    """What the parser knows about one destination (a dataclass field)."""

    action: argparse.Action
    allows_none: bool = False
    takes_str: bool = False
    list_typed: bool = False
    dict_typed: bool = False

    @property
    def multi(self) -> bool:  # argparse takes several values (a list[...] field)
        return self.action.nargs in ("+", "*")


#: optional text options whose none/null means None (off), as for the non-text ones
NONE_WORD_TEXT_OPTIONS = frozenset({"metrics_file"})


def _field_options(parser: argparse.ArgumentParser, classes: tuple) -> tuple[dict[str, str], dict[str, _Option]]:
    """``(option string -> dest, dest -> _Option)``, from the parser and the dataclasses' type hints."""
    import types
    import typing

    by_string = {opt: a.dest for a in parser._actions for opt in a.option_strings}
    options = {a.dest: _Option(a) for a in parser._actions if a.option_strings and a.dest != "help"}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in options or f.name not in hints:
                continue
            hint = hints[f.name]
            union = typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType)
            parts = typing.get_args(hint) if union else (hint,)
            origins = [typing.get_origin(t) or t for t in parts]
            opt = options[f.name]
            opt.allows_none = type(None) in parts
            # a text option reads none/null as text (a file may be named "none"), but for these
            opt.takes_str = str in parts and f.name not in NONE_WORD_TEXT_OPTIONS
            opt.list_typed = any(o in (list, tuple) for o in origins)
            opt.dict_typed = any(o is dict for o in origins)
    return by_string, options


def _unknown_option(name: str, valid: list[str], where: str = "") -> CommandLineError:
    import difflib

    if name in TRL_UNSUPPORTED:
        return CommandLineError(f"--{name}{where} (a TRL option) has no swiftune equivalent: {TRL_UNSUPPORTED[name]}")
    # a shortened name (--model for --model_name_or_path) is a prefix of what was meant, which
    # difflib's whole-string ratio misses (it offered --delta for --model)
    starts = [v for v in valid if v.startswith(name)]
    close = starts[:3] if starts else difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    hint = ("; did you mean " + " or ".join(f"--{c}" for c in close) + "?") if close else "; --help lists the options"
    return CommandLineError(f"unknown option --{name}{where}{hint}")


def _aliases(classes: tuple) -> dict[str, str]:
    """``alias option string -> dest``: the ``aliases`` metadata of the dataclasses' fields (TRL's names)."""
    return {alias: f.name for cls in classes for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


def _one_spelling(spelled: dict[str, str], dest: str, key: str, aliases: dict[str, str], where: str = "") -> None:
    """Refuse an option given under two names of which one is an alias (``--dataset_name`` and
    ``--dataset``): which value was meant is not clear. ``spelled`` maps each dest to its first spelling."""
    first = spelled.setdefault(dest, key)
    if first != key and (first in aliases or key in aliases):
        alias = key if key in aliases else first
        raise CommandLineError(f"{first} and {key}{where} both set --{dest} ({alias} is TRL's name for it); "
                               "give one of them")


def _split_commas(values: list[str]) -> list[str]:
    return [part.strip() for v in values for part in v.split(",") if part.strip()]


def _normalise_argv(argv: list[str], by_string: dict[str, str], options: dict[str, _Option],
                    valid: list[str], aliases: dict[str, str]) -> tuple[list[str], dict[str, Any], set[str]]:
    """``(argv, none_values, given)``: each option checked against the parser (exact names, no
    abbreviations; an alias and its option not both), list options' comma-separated values split,
    ``none``/``null`` for an optional non-text option recorded as None, and the set of destinations given."""
    out: list[str] = []
    nones: dict[str, Any] = {}
    given: set[str] = set()
    spelled: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or _is_number(token):
            after = f" (after {argv[i - 1]})" if i else ""
            raise CommandLineError(f"unexpected argument {token!r}{after}: options are --key value; a list option "
                                   "takes its values space- or comma-separated; a YAML config file comes first")
        key, eq, inline = token.partition("=")
        if key not in by_string:
            raise _unknown_option(key.lstrip("-").replace("-", "_"), valid)
        dest = by_string[key]
        _one_spelling(spelled, dest, key, aliases)
        option = options.get(dest)
        values = [inline] if eq else []
        i += 1
        while not eq and i < len(argv) and (not argv[i].startswith("-") or _is_number(argv[i])):
            values.append(argv[i])
            i += 1
        given.add(dest)
        if option is not None and len(values) == 1 and values[0].strip().lower() in ("none", "null") \
                and option.allows_none and not option.takes_str:
            nones[dest] = None
            continue
        if option is not None and option.multi:
            values = _split_commas(values)
        elif option is not None and len(values) > 1:
            raise CommandLineError(f"{key} takes one value, got {len(values)}: {' '.join(values)}")
        out.append(key)
        out.extend(values)
    return out, nones, given


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _yaml_items(config: dict[str, Any], path: str, by_string: dict[str, str], options: dict[str, _Option],
                valid: list[str], aliases: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """``(argv, direct)``: YAML values as command-line tokens (so that argparse converts and checks
    them as it does the command line; a TRL alias becomes its swiftune name), and the values that
    have no command-line spelling (None, a list or mapping for a field typed so) to set directly."""
    argv: list[str] = []
    direct: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in config.items():
        name = str(key).lstrip("-")
        dest = by_string.get(f"--{name}")
        if dest is None:
            raise _unknown_option(name.replace("-", "_"), valid, f" (in {path})")
        _one_spelling(spelled, dest, f"--{name}", aliases, f" (in {path})")
        option = options[dest]
        if value is None:
            if not option.allows_none:
                raise CommandLineError(f"{path}: {name}: null is not a value for this option; give one or remove "
                                       "the line to keep the default")
            direct[dest] = None
        elif isinstance(value, (list, tuple)):
            if option.multi:
                argv += [f"--{dest}", *(_scalar(v, path, name) for v in value)]
            elif option.list_typed:
                direct[dest] = list(value)
            else:  # a comma-separated option (lora_target_modules of old configs, reward_funcs)
                argv += [f"--{dest}={','.join(_scalar(v, path, name) for v in value)}"]
        elif isinstance(value, dict):
            if option.dict_typed:
                direct[dest] = value
            else:
                argv += [f"--{dest}={json.dumps(value)}"]
        else:
            argv += [f"--{dest}={_scalar(value, path, name)}"]
    return argv, direct


def _scalar(value: Any, path: str, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        raise CommandLineError(f"{path}: {name}: expected plain values, got a nested {type(value).__name__}")
    return str(value)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# A built-in default the user's own option replaces: the built-in run's max_steps would otherwise win over a
# given num_train_epochs (transformers' rule: max_steps > 0 ignores the epochs), training a fixed number of steps
# the user did not ask for.
_SUPERSEDES: dict[str, tuple[str, ...]] = {"max_steps": ("num_train_epochs",)}


def parse_command_args(argv: list[str], classes: tuple, prog: str, description: str,
                       builtin_defaults: dict[str, Any], default_output_dir: str):
    """``(model_args, config, builtin)`` from ``[CONFIG.yaml] [--key value ...]``.

    Command-line options override the YAML file. Without ``--model_name_or_path`` the command
    runs its built-in task, with ``builtin_defaults`` for every option the user did not give.
    Every mistake (an unknown option, a bad value, a config field out of range, a local model,
    dataset or checkpoint path that does not exist) raises :class:`CommandLineError` before any
    model or data is loaded.
    """
    from transformers import HfArgumentParser

    parser = HfArgumentParser(classes, prog=prog, description=description)
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter

    def error(message: str):  # argparse would print the whole usage (hundreds of options) and exit
        raise CommandLineError(message)

    parser.error = error
    by_string, options = _field_options(parser, classes)
    aliases = _aliases(classes)
    # typo suggestions know TRL's names too (--use_pef: did you mean --use_peft?)
    valid = sorted(set(options) | {a.lstrip("-").replace("-", "_") for a in aliases})
    yaml_argv: list[str] = []
    direct: dict[str, Any] = {}
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith((".yaml", ".yml")):
        path = argv[0]
        yaml_argv, direct = _yaml_items(read_yaml_config(path), path, by_string, options, valid, aliases)
        argv = argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        parser.parse_args(["--help"])  # prints the help and exits 0
    yaml_argv, yaml_nones, yaml_given = _normalise_argv(yaml_argv, by_string, options, valid, aliases)
    cli_argv, cli_nones, cli_given = _normalise_argv(argv, by_string, options, valid, aliases)
    direct = {k: v for k, v in {**direct, **yaml_nones}.items() if k not in cli_given}
    direct.update(cli_nones)
    given = yaml_given | cli_given | set(direct)
    builtin = "model_name_or_path" not in given
    prefix: list[str] = []
    if builtin:
        prefix = [f"--{k}={v}" for k, v in builtin_defaults.items()
                  if k not in given and not given & set(_SUPERSEDES.get(k, ()))]
    elif "output_dir" not in given:
        prefix = [f"--output_dir={default_output_dir}"]
    if "use_cpu" not in given and not _has_cuda():
        # without it, transformers leaves a torchrun launch on CPU out of its distributed mode: each process
        # trains alone (the second stopped at the first's output_dir lock); one process runs as before
        prefix.append("--use_cpu=true")
    namespace, remaining = parser.parse_known_args(args=prefix + yaml_argv + cli_argv)
    if remaining:
        raise CommandLineError(f"unexpected arguments: {' '.join(remaining)}")
    for dest, value in direct.items():
        setattr(namespace, dest, value)
    outputs = []
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            outputs.append(cls(**{k: v for k, v in vars(namespace).items() if k in names}))
        except (ValueError, TypeError) as e:
            raise CommandLineError(str(e)) from e
    model_args, config = outputs
    try:
        check_model_args(model_args)
    except ConfigError as e:
        raise CommandLineError(str(e)) from e
    warn_unused_lora_options(model_args)
    check_paths(model_args, config)
    # the launch's process count is known once the config exists (it sets up the distributed state): refused here,
    # before the model loads, rather than at train()
    if getattr(config, "deferred_nonfinite_check", False) and config.world_size > 1:
        raise CommandLineError(f"--deferred_nonfinite_check true runs in one process for now; this launch has "
                               f"{config.world_size}: drop it for multi-process training")
    return model_args, config, builtin


def check_tiled_mlp_with_lora(model_args: ModelArguments, use_lora: bool) -> None:
    """``--tiled_mlp`` is a LoRA option (``FastModel.get_peft_model``'s): refused for full fine-tuning."""
    if model_args.tiled_mlp is not None and not use_lora:
        raise ConfigError("--tiled_mlp applies to LoRA training (get_peft_model tiles the MLP and the adapted "
                          "projections); full fine-tuning runs the MLP untiled: drop --tiled_mlp or add --use_lora")


LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")


def warn_unused_lora_options(model_args: ModelArguments) -> list[str]:
    """A warning naming the LoRA options given other values than their defaults when the run fully fine-tunes
    (``--use_lora false``, or the built-in tiny model without ``--use_lora``): they would be ignored without a
    word, as TRL ignores its ``lora_*`` without ``--use_peft``. Not an error: a YAML file may keep LoRA settings
    beside ``use_lora: false``. Returns the options named."""
    full_finetune = model_args.use_lora is False or (
        model_args.use_lora is None and not model_args.model_name_or_path
        and not getattr(model_args, "load_in_fp8", False))
    if not full_finetune:
        return []
    defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in dataclasses.fields(model_args) if f.name in LORA_OPTIONS}
    given = [name for name in LORA_OPTIONS if getattr(model_args, name) != defaults[name]]
    if given:
        why = "--use_lora false" if model_args.use_lora is False else "the built-in tiny model's default"
        logger.warning("%s ignored: this run fully fine-tunes the model (%s); add --use_lora true to train LoRA "
                       "adapters with %s", ", ".join(f"--{n} {getattr(model_args, n)}" for n in given), why,
                       "them" if len(given) > 1 else "it")
    return given


#: the names --dtype takes (FastModel.from_pretrained's dtype strings; "auto": bf16 on a GPU that has it)
MODEL_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def check_model_args(model_args: ModelArguments) -> None:
    """The model arguments' values (:class:`ConfigError` naming the option), before anything loads."""
    gc = gradient_checkpointing_mode(model_args)
    budget = model_args.offload_gpu_budget_gb
    if budget is not None and gc != "offload":
        raise ConfigError("--offload_gpu_budget_gb needs --use_gradient_checkpointing offload")
    if budget is not None and not budget >= 0:
        raise ConfigError(f"--offload_gpu_budget_gb {budget}: must be >= 0 (0: every layer input on the host)")
    if model_args.use_lora is False:
        check_tiled_mlp_with_lora(model_args, use_lora=False)
    kept = model_args.offload_attention_output_layers
    if kept and gc != "offload":
        raise ConfigError("--offload_attention_output_layers needs --use_gradient_checkpointing offload")
    if isinstance(kept, bool) or not isinstance(kept, int) or kept < 0:
        raise ConfigError(f"--offload_attention_output_layers {kept!r}: must be a whole number of decoder layers "
                          ">= 0 (0: every layer recomputes its attention)")
    if model_args.offload_attention_outputs_on_host and not kept:
        raise ConfigError("--offload_attention_outputs_on_host needs --offload_attention_output_layers N (N >= 1: "
                          "the last N decoder layers keep their attention outputs, here on the host)")
    if model_args.dtype not in MODEL_DTYPES:
        raise ConfigError(f"--dtype {model_args.dtype}: give one of {', '.join(MODEL_DTYPES)}")
    if not model_args.lora_r >= 1:
        raise ConfigError(f"--lora_r {model_args.lora_r}: the LoRA rank must be >= 1, e.g. 16")
    if not model_args.lora_alpha > 0:
        raise ConfigError(f"--lora_alpha {model_args.lora_alpha}: must be > 0 (the scale is alpha / r), e.g. 16")
    if not 0 <= model_args.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout {model_args.lora_dropout}: must be in [0, 1), e.g. 0.0")
    lora_targets(model_args.lora_target_modules)
    lora_target_parameter_names(model_args.lora_target_parameters)
    if model_args.lora_target_parameters and model_args.lora_dropout:
        raise ConfigError(f"--lora_target_parameters with --lora_dropout {model_args.lora_dropout}: PEFT's adapters "
                          "on parameters take no dropout; give --lora_dropout 0")
    for flag, model, frozen in (("load_in_4bit", "a 4-bit model", "its NF4 weights take no gradient steps"),
                                ("load_in_fp8", "an FP8 model", "its e4m3 weights are frozen")):
        if not getattr(model_args, flag, False):
            continue
        if flag == "load_in_fp8" and getattr(model_args, "load_in_4bit", False):
            raise ConfigError("--load_in_fp8 and --load_in_4bit are exclusive: pick one")
        if model_args.use_lora is False:
            raise ConfigError(f"--{flag} true with --use_lora false: {model} cannot be fully fine-tuned ({frozen}); "
                              "drop --use_lora false to train LoRA adapters")
        if not model_args.model_name_or_path and flag == "load_in_4bit":
            raise ConfigError(f"--{flag} true needs --model_name_or_path (the built-in tiny model is not quantised "
                              "to 4 bits; --load_in_fp8 true quantises it to FP8)")


def check_paths(model_args: ModelArguments, config: Any) -> None:
    """Local-looking model, dataset and checkpoint paths that do not exist, and a resume with no complete
    checkpoint to resume from, before anything loads."""
    from ..local_paths import resolve_local_path

    try:
        for name in ("model_name_or_path", "dataset", "eval_dataset"):
            value = getattr(model_args, name, None)
            if value:
                setattr(model_args, name, resolve_local_path(value, f"--{name}"))
        resume = resume_target(getattr(config, "resume_from_checkpoint", None))
        if resume:  # no complete checkpoint to resume from: said now, not after the model and data have loaded
            from ..training.checkpoints import resolve_resume

            resolve_resume(resume, config.output_dir, warn=False)  # the trainer warns of what it skips
    except (FileNotFoundError, ValueError) as e:
        raise CommandLineError(str(e)) from e


def gradient_checkpointing_mode(model_args: ModelArguments) -> bool | str:
    """``--use_gradient_checkpointing`` as the model set-up takes it: True, False or ``"offload"``
    (``unsloth``, Unsloth's name for it, too)."""
    value = model_args.use_gradient_checkpointing
    gc = {"true": True, "false": False, "offload": "offload", "unsloth": "offload"}.get(str(value).lower())
    if gc is None:
        raise ConfigError(f"--use_gradient_checkpointing {value!r}: must be true, false, offload or unsloth "
                          "(Unsloth's name for offload)")
    return gc


def lora_targets(value: str | list[str]) -> str | list[str]:
    """``--lora_target_modules`` as PEFT takes it: ``"all-linear"`` or a list of module names."""
    names = _split_commas([value] if isinstance(value, str) else list(value))
    if not names:
        raise ConfigError("--lora_target_modules names no module; give module names or all-linear")
    if "all-linear" in names:
        if len(names) > 1:
            raise ConfigError(f"--lora_target_modules {','.join(names)}: all-linear already takes every linear "
                             "layer; give it alone or list module names")
        return "all-linear"
    return names


def lora_target_parameter_names(value: list[str] | None) -> list[str] | None:
    """``--lora_target_parameters`` as PEFT takes it: parameter names (or name suffixes), or None."""
    if value is None:
        return None
    names = _split_commas(list(value))
    if not names:
        raise ConfigError("--lora_target_parameters names no parameter; give parameter names such as "
                          "mlp.experts.gate_up_proj, or leave it out")
    if "all-linear" in names:
        raise ConfigError("--lora_target_parameters all-linear: all-linear is a --lora_target_modules value; "
                          "--lora_target_parameters takes parameter names such as mlp.experts.gate_up_proj")
    return names


def resume_target(value: str | bool | None) -> str | bool | None:
    """``--resume_from_checkpoint`` as the Trainer takes it: ``true``/``last`` = the newest checkpoint
    in ``output_dir``, ``false``/empty = start fresh, anything else a checkpoint folder."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in ("true", "yes", "1", "last", "latest"):
        return True
    if text.lower() in ("", "false", "no", "0", "none"):
        return None
    if not os.path.isdir(text):
        raise FileNotFoundError(f"--resume_from_checkpoint {text!r}: no such checkpoint folder "
                                "(give a checkpoint-N folder, or true for the newest one in output_dir)")
    return text
