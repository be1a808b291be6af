"""TRL's `trl sft` / `trl grpo` option names run unchanged on `swiftune sft` / `swiftune grpo`:
each alias parses to the same config as swiftune's own name (parse only: nothing trains), an
alias given together with its swiftune name is an error, `--help` lists the alias next to the
option, and a TRL option with no swiftune equivalent says what to do instead."""

import dataclasses

import pytest

from swiftune.cli import main
from swiftune.cli.arguments import CommandLineError
from swiftune.cli.grpo import parse_grpo_args
from swiftune.cli.sft import parse_sft_args

# (TRL's spelling, swiftune's spelling) of the same command line
SAME_OPTIONS = [
    (["--dataset_name", "org/rows"], ["--dataset", "org/rows"]),
    (["--dataset-name", "org/rows"], ["--dataset", "org/rows"]),
    (["--dataset_train_split", "train_sft"], ["--dataset_split", "train_sft"]),
    (["--dataset_test_split", "test_sft"], ["--eval_dataset_split", "test_sft"]),
    (["--use_peft"], ["--use_lora", "true"]),
    (["--use_peft", "true"], ["--use_lora", "true"]),
    (["--use_peft", "false"], ["--use_lora", "false"]),
    (["--torch_dtype", "bfloat16"], ["--dtype", "bfloat16"]),
    (["--dtype", "float32"], ["--dtype", "float32"]),
    # the LoRA names are swiftune's too; TRL passes target modules space-separated
    (["--lora_r", "8", "--lora_alpha", "32", "--lora_dropout", "0.05", "--lora_target_modules", "q_proj", "v_proj"],
     ["--lora_r=8", "--lora_alpha=32", "--lora_dropout=0.05", "--lora_target_modules=q_proj,v_proj"]),
]


def parsed(parse, argv):
    """``(model_args, config as a dict, builtin)``: what the command would run with."""
    model_args, config, builtin = parse(argv)
    return dataclasses.asdict(model_args), config.to_dict(), builtin


@pytest.mark.parametrize("parse", [parse_sft_args, parse_grpo_args], ids=["sft", "grpo"])
@pytest.mark.parametrize("trl, ours", SAME_OPTIONS, ids=lambda argv: " ".join(argv))
def test_trl_names_parse_to_the_same_config(parse, trl, ours):
    got, expected = parsed(parse, trl), parsed(parse, ours)
    assert got == expected
    assert got != parsed(parse, [])  # the option did change something


def test_a_trl_command_line_with_a_model(tmp_path):
    """A whole `trl sft` line (model path given: not the built-in run) reads as swiftune's."""
    model = str(tmp_path / "model")
    (tmp_path / "model").mkdir()
    trl = ["--model_name_or_path", model, "--dataset_name", "org/chat", "--dataset_train_split", "train",
           "--dataset_test_split", "validation", "--use_peft", "--lora_r", "32", "--lora_alpha", "16",
           "--lora_target_modules", "q_proj", "k_proj", "--torch_dtype", "bfloat16", "--output_dir", str(tmp_path)]
    model_args, config, builtin = parse_sft_args(trl)
    assert not builtin and model_args.model_name_or_path == model
    assert (model_args.dataset, model_args.dataset_split, model_args.eval_dataset_split) == \
        ("org/chat", "train", "validation")
    assert model_args.use_lora is True and model_args.lora_r == 32 and model_args.dtype == "bfloat16"
    assert model_args.lora_target_modules == ["q_proj", "k_proj"]


def test_trl_names_in_yaml(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("dataset_name: org/rows\ndataset_train_split: train_sft\nuse_peft: true\n"
                    "torch_dtype: bfloat16\nlora_target_modules: [q_proj, v_proj]\n")
    model_args, _, _ = parse_sft_args([str(path)])
    assert (model_args.dataset, model_args.dataset_split, model_args.use_lora, model_args.dtype) == \
        ("org/rows", "train_sft", True, "bfloat16")
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]
    # the command line overrides the file under either name
    model_args, _, _ = parse_sft_args([str(path), "--dataset", "org/other", "--use_lora", "false"])
    assert model_args.dataset == "org/other" and model_args.use_lora is False


@pytest.mark.parametrize("argv", [
    ["--dataset_name", "a", "--dataset", "b"],
    ["--dataset", "b", "--dataset_name", "b"],
    ["--use_peft", "--use_lora", "true"],
    ["--torch_dtype", "bfloat16", "--dtype", "bfloat16"],
    ["--dataset_train_split", "x", "--dataset_split", "y"],
    ["--dataset_test_split", "x", "--eval_dataset_split=y"],
])
def test_an_alias_and_its_name_together_are_refused(argv):
    with pytest.raises(CommandLineError, match="both set --") as info:
        parse_sft_args(argv)
    assert "TRL's name" in str(info.value)


def test_an_alias_and_its_name_in_one_yaml_are_refused(tmp_path, capsys):
    path = tmp_path / "both.yaml"
    path.write_text("dataset_name: a\ndataset: b\n")
    assert main(["sft", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "both set --dataset" in err[0] and str(path) in err[0]


def test_dataset_config_says_what_to_do_instead(capsys):
    assert main(["grpo", "--dataset_name", "org/math", "--dataset_config", "main"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dataset_config" in err[0] and "no swiftune equivalent" in err[0]
    assert "--dataset" in err[0].split("equivalent", 1)[1]


def test_typos_of_trl_names_get_suggestions(capsys):
    assert main(["sft", "--use_pef"]) == 2
    assert "--use_peft" in capsys.readouterr().err


def test_help_lists_the_trl_name_next_to_the_option(capsys):
    with pytest.raises(SystemExit) as info:
        parse_sft_args(["--help"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for ours, trl in [("--dataset", "--dataset_name"), ("--dataset_split", "--dataset_train_split"),
                      ("--eval_dataset_split", "--dataset_test_split"), ("--use_lora", "--use_peft"),
                      ("--dtype", "--torch_dtype")]:
        assert any(line.strip().startswith(ours + " ") and trl + " " in line for line in lines), (ours, trl)


def test_unsloth_checkpointing_name_is_offload_and_the_error_lists_it():
    from swiftune.cli.arguments import ModelArguments, gradient_checkpointing_mode
    from swiftune.errors import ConfigError

    assert gradient_checkpointing_mode(ModelArguments(use_gradient_checkpointing="unsloth")) == "offload"
    with pytest.raises(ConfigError, match="true, false, offload or unsloth"):
        gradient_checkpointing_mode(ModelArguments(use_gradient_checkpointing="sometimes"))
