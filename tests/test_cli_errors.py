"""The command line's mistakes end in one line that names them: unknown options with the closest
valid names, local paths that do not exist (no Hub lookup), YAML lists, and `swiftune check`
saying what it compared (the Triton interpreter on a CPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from swiftune.cli import main
from swiftune.local_paths import looks_local, resolve_local_path
from swiftune.cli.arguments import CommandLineError, lora_targets, read_yaml_config
from swiftune.cli.sft import parse_sft_args

ENV_WITHOUT_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


# ----------------------------------------------------------------------------- unknown options


def test_unknown_option_names_the_closest_ones(capsys):
    assert main(["sft", "--lerning_rate", "1e-4"]) == 2
    line = one_line_error(capsys)
    assert "--lerning_rate" in line and "--learning_rate" in line


def test_abbreviations_are_not_silently_expanded(capsys):
    assert main(["sft", "--learning", "1e-4"]) == 2
    assert "unknown option --learning" in one_line_error(capsys)


def test_a_shortened_option_suggests_the_options_it_begins(capsys):
    # difflib alone offered --delta for --model
    assert main(["grpo", "--model", "x"]) == 2
    line = one_line_error(capsys)
    assert "unknown option --model; did you mean" in line and "--model_name_or_path" in line


def test_unknown_option_from_the_real_entry_point_exits_2_without_traceback():
    # Python warnings raised by other packages' imports (the GPU machine's torch and triton emit some) are
    # not swiftune's output: the process is asked to drop them, and what is left must be one line
    proc = subprocess.run([sys.executable, "-m", "swiftune.cli", "sft", "--lerning_rate", "1e-4"],
                          env={**ENV_WITHOUT_INTERPRETER, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--learning_rate" in lines[0], proc.stderr[-2000:]


def test_other_libraries_info_logs_stay_quiet():
    """The CLI shows swiftune's own INFO lines only: another library's INFO record at import (datasets reports
    which optional frameworks it found: the GPU machine has JAX) is not the command's output."""
    code = ("import logging, sys; from swiftune.cli import main; rc = main(['sft', '--lerning_rate', '1']); "
            "logging.getLogger('datasets.config').info('JAX version 0.0 available.'); "
            "logging.getLogger('swiftune.training').info('swiftune line'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], env={**ENV_WITHOUT_INTERPRETER, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "JAX version" not in proc.stderr and "swiftune line" in proc.stderr, proc.stderr[-2000:]


def test_bad_values_and_config_fields_end_in_one_line(capsys):
    assert main(["grpo", "--max_prompt_length", "0"]) == 2
    assert "max_prompt_length=0" in one_line_error(capsys)
    assert main(["grpo", "--sft_warmup_steps", "-1"]) == 2  # before any model is built
    assert "--sft_warmup_steps -1: must be a whole number of steps >= 0" in one_line_error(capsys)
    assert main(["sft", "--per_device_train_batch_size", "abc"]) == 2  # argparse's own message, one line
    assert "per_device_train_batch_size" in one_line_error(capsys)
    assert main(["sft", "--max_length", "5", "6"]) == 2
    assert "takes one value" in one_line_error(capsys)
    assert main(["sft", "stray"]) == 2
    assert "unexpected argument 'stray'" in one_line_error(capsys)


def _refuse_model_loads(monkeypatch) -> None:
    import swiftune.cli.grpo as grpo_cli

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the configuration error")

    monkeypatch.setattr(grpo_cli, "build_model", build_model)


def test_grpo_rewards_and_warm_up_of_the_users_run_are_checked_before_loading(tmp_path, monkeypatch, capsys):
    # the user's dataset is never scored by the toy task's reward without a word
    _refuse_model_loads(monkeypatch)
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main(["grpo", "--dataset", str(data)]) == 2
    line = one_line_error(capsys)
    assert f"--dataset {data}: name the reward functions" in line and "--reward_funcs" in line
    # a warm-up that only the built-in model and task take is refused with a model or dataset of the user's
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert main(["grpo", "--model_name_or_path", str(model_dir), "--sft_warmup_steps", "5"]) == 2
    assert "--sft_warmup_steps 5: the SFT warm-up trains the built-in tiny model" in one_line_error(capsys)
    assert main(["grpo", "--dataset", str(data), "--reward_funcs", "exact_match", "--sft_warmup_steps", "5"]) == 2
    assert "and --dataset replaces it" in one_line_error(capsys)
    # one weight per function, before the model loads
    assert main(["grpo", "--reward_funcs", "reverse,exact_match", "--reward_weights", "1"]) == 2
    assert "--reward_weights gives 1 weights for 2 reward functions" in one_line_error(capsys)


def test_sft_dtype_report_to_and_metrics_file_options(monkeypatch, capsys):
    assert main(["sft", "--dtype", "fp64"]) == 2  # was a load-time ValueError, exit 1
    assert "--dtype fp64: give one of auto, bf16" in one_line_error(capsys)
    model_args, config, _ = parse_sft_args(["--metrics_file", "none"])
    assert config.metrics_file is None  # off, not a file named "none"
    assert parse_sft_args(["--metrics_file", "steps.jsonl"])[1].metrics_file == "steps.jsonl"
    # an integration that is not installed: refused before loading (transformers raised after the model loaded)
    import transformers.integrations.integration_utils as integrations

    monkeypatch.setattr(integrations, "get_available_reporting_integrations", lambda: [])
    assert main(["sft", "--report_to", "tensorboard"]) == 2
    assert "report_to=['tensorboard'] names tensorboard, which is not installed here" in one_line_error(capsys)


def test_deferred_check_under_several_processes_is_refused_before_loading(monkeypatch, capsys):
    """Under torchrun the config knows the process count: a one-process option is a parse error (exit 2),
    not a ValueError from train() after the model loaded (exit 1)."""
    from swiftune.sft import SFTConfig

    assert parse_sft_args(["--deferred_nonfinite_check", "true"])[1].deferred_nonfinite_check
    monkeypatch.setattr(SFTConfig, "world_size", property(lambda self: 2))
    assert main(["sft", "--deferred_nonfinite_check", "true"]) == 2
    assert "runs in one process for now; this launch has 2" in one_line_error(capsys)
    assert parse_sft_args([])[1].world_size == 2  # without the option the launch is fine


def test_grpo_command_defaults_of_the_reward_and_warm_up():
    from swiftune.cli.grpo import builtin_warmup_steps, command_reward_spec, parse_grpo_args

    model_args, _, builtin = parse_grpo_args([])
    assert (command_reward_spec(model_args), builtin_warmup_steps(model_args, builtin)) == ("reverse", 60)
    model_args, _, builtin = parse_grpo_args(["--sft_warmup_steps", "0"])
    assert builtin_warmup_steps(model_args, builtin) == 0
    model_args.dataset = "rows.jsonl"  # the user's rows: no warm-up unless asked, and then refused
    assert builtin_warmup_steps(model_args, True) == 0
    model_args.reward_funcs = "final_answer"
    assert command_reward_spec(model_args) == "final_answer"


def test_given_epochs_replace_the_builtin_runs_step_count(tmp_path, capsys):
    """The built-in run's max_steps applies only where the user gives neither it nor num_train_epochs: given
    epochs train those epochs (transformers lets a max_steps > 0 win over them), in a YAML file too; epochs of 0
    with no step count are refused before loading."""
    from swiftune.cli.grpo import parse_grpo_args

    assert parse_sft_args([])[1].max_steps == 80
    _, config, builtin = parse_sft_args(["--num_train_epochs", "2"])
    assert builtin and (config.max_steps, config.num_train_epochs) == (-1, 2)
    assert parse_sft_args(["--num_train_epochs", "2", "--max_steps", "5"])[1].max_steps == 5
    assert parse_grpo_args(["--num_train_epochs", "1"])[1].max_steps == -1
    (tmp_path / "run.yaml").write_text("num_train_epochs: 3\n")
    assert parse_sft_args([str(tmp_path / "run.yaml")])[1].max_steps == -1
    assert main(["sft", "--num_train_epochs", "0"]) == 2
    assert "num_train_epochs" in one_line_error(capsys)


def test_none_means_no_limit_on_the_command_line():
    from swiftune.cli.grpo import parse_grpo_args

    _, config, _ = parse_grpo_args(["--max_prompt_length", "none"])
    assert config.max_prompt_length is None


def test_lora_options_of_a_full_fine_tuning_run_are_named_as_ignored(caplog):
    """LoRA options given other values than their defaults while the run fully fine-tunes (--use_lora false, or
    the built-in tiny model without --use_lora) are named in one warning, not silently dropped; with LoRA on, or
    at their defaults, nothing is said."""
    import logging

    with caplog.at_level(logging.WARNING, logger="swiftune.cli.arguments"):
        parse_sft_args(["--lora_r", "8", "--lora_target_modules", "q_proj,v_proj"])
    (record,) = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert record.getMessage().startswith("--lora_r 8, --lora_target_modules ['q_proj', 'v_proj'] ignored")
    assert "built-in tiny model's default" in record.getMessage() and "--use_lora true" in record.getMessage()
    for argv in (["--lora_r", "8", "--use_lora", "true"], ["--use_lora", "false"], ["--lora_r", "16"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="swiftune.cli.arguments"):
            parse_sft_args(argv)
        assert not [r for r in caplog.records if "ignored" in r.getMessage()], argv
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="swiftune.cli.arguments"):
        parse_sft_args(["--use_lora", "false", "--lora_alpha", "32"])
    assert any("--lora_alpha 32 ignored" in r.getMessage() and "--use_lora false" in r.getMessage()
               for r in caplog.records)



@pytest.mark.parametrize("argv", [["generate", "--bogus", "1"], ["generate", "--max_tokens", "abc"],
                                  ["plan", "--tokenz", "5"]])
def test_generate_and_plan_mistakes_end_in_one_line(capsys, argv):
    """``swiftune generate`` / ``plan`` parse with argparse too: a mistake is one line naming it, exit 2, as
    the training commands' (not argparse's usage block)."""
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"swiftune {argv[0]}: error:") and argv[1] in line and "--help lists the options" in line

# ----------------------------------------------------------------------------- YAML


def test_yaml_lists_and_nulls(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora_target_modules: [q_proj, v_proj]\nuse_lora: true\nmax_length: 128\n"
                    "max_tokens_per_batch: null\nreport_to: [none]\nlearning_rate: 1e-4\n")
    model_args, config, builtin = parse_sft_args([str(path), "--max_length", "64"])
    assert lora_targets(model_args.lora_target_modules) == ["q_proj", "v_proj"]
    assert config.max_length == 64  # the command line overrides the file
    assert config.max_tokens_per_batch is None and config.report_to == [] and config.learning_rate == 1e-4
    assert builtin


def test_list_options_take_commas_on_the_command_line():
    from swiftune.cli.grpo import parse_grpo_args

    model_args, _, _ = parse_sft_args(["--lora_target_modules", "q_proj,k_proj", "o_proj"])
    assert lora_targets(model_args.lora_target_modules) == ["q_proj", "k_proj", "o_proj"]
    assert lora_targets(parse_sft_args([])[0].lora_target_modules) == "all-linear"
    _, config, _ = parse_grpo_args(["--stop_token_ids", "1,2", "--reward_weights=1,0.5"])
    assert config.stop_token_ids == [1, 2] and config.reward_weights == [1.0, 0.5]


def test_yaml_grpo_lists(tmp_path):
    from swiftune.cli.grpo import parse_grpo_args

    path = tmp_path / "grpo.yaml"
    path.write_text("reward_funcs: [reverse, exact_match]\nreward_weights: [1.0, 0.5]\nmax_prompt_length: null\n")
    model_args, config, _ = parse_grpo_args([str(path)])
    assert model_args.reward_funcs == "reverse,exact_match"
    assert config.reward_weights == [1.0, 0.5] and config.max_prompt_length is None


def test_yaml_unknown_key_names_the_file(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("lerning_rate: 1e-4\n")
    assert main(["sft", str(path)]) == 2
    line = one_line_error(capsys)
    assert "--lerning_rate" in line and str(path) in line and "--learning_rate" in line


def test_yaml_is_read_safely(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f'learning_rate: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(CommandLineError, match="not valid YAML"):
        read_yaml_config(str(path))
    assert not marker.exists()
    with pytest.raises(CommandLineError, match="does not exist"):
        read_yaml_config(str(tmp_path / "missing.yaml"))


# ----------------------------------------------------------------------------- local paths


@pytest.mark.parametrize("name, local", [
    ("./data.jsonl", True), ("/abs/model", True), ("~/models/qwen", True), ("train.parquet", True),
    ("rows.csv", True), ("runs/qwen/final", True), ("..", True),
    ("Qwen/Qwen3-0.6B", False), ("gpt2", False), ("HuggingFaceH4/ultrachat_200k", False),
])
def test_looks_local(name, local):
    assert looks_local(name) is local


def test_missing_local_dataset_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    from swiftune.cli.runs import load_rows

    class NoHub:
        def load_dataset(self, *a, **k):
            raise AssertionError("a local-looking path went to the Hub")

    monkeypatch.setitem(sys.modules, "datasets", NoHub())
    missing = str(tmp_path / "train.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(missing, "train", list)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows("./nope/rows", "train", list)
    # the command says so before it builds any model
    assert main(["sft", "--dataset", missing]) == 2
    line = one_line_error(capsys)
    assert "does not exist" in line and missing in line


def test_missing_local_model_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    import transformers

    from swiftune.training import FastModel

    seen = []

    def fake_config(name, *a, **k):
        seen.append(name)
        raise OSError("reached the Hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake_config)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FastModel.from_pretrained(str(tmp_path / "no" / "model"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FastModel.from_pretrained("./no-such-model")
    assert seen == []
    with pytest.raises(OSError, match="reached the Hub"):  # a Hub id is still looked up
        FastModel.from_pretrained("org/name")
    assert seen == ["org/name"]
    # ~ is expanded (transformers would take "~/m" for a malformed Hub id)
    (tmp_path / "m").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_local_path("~/m", "model") == str(tmp_path / "m")
    assert main(["sft", "--model_name_or_path", "./no-such-model"]) == 2
    assert "does not exist" in one_line_error(capsys)


def test_missing_checkpoint_folder_before_training(tmp_path, capsys):
    assert main(["sft", "--resume_from_checkpoint", str(tmp_path / "checkpoint-9")]) == 2
    assert "no such checkpoint folder" in one_line_error(capsys)


# ----------------------------------------------------------------------------- swiftune check


def test_check_under_the_interpreter_compares_triton_with_the_reference(capsys):
    """On a CPU the tests run with TRITON_INTERPRET=1 (conftest), on a GPU machine the kernels are compiled:
    either way the kernels themselves run, forward and backward."""
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert ("compiled for" if torch.cuda.is_available() else "Triton interpreter") in out and "float64" in out
    for name in ("swiglu", "geglu", "geglu_tanh", "rms_norm", "rms_norm_1+w", "rope_qk"):
        assert any(line.startswith(name + " ") and line.rstrip().endswith("ok") for line in out.splitlines()), name


@pytest.mark.parametrize("tolerance", ["-1", "0", "nan", "inf"])
def test_check_refuses_a_tolerance_nothing_can_pass_or_fail(tolerance, capsys):
    assert main(["check", "--tolerance", tolerance]) == 2
    assert f"--tolerance {float(tolerance):g}: give a relative error > 0" in capsys.readouterr().err


def test_check_finds_a_kernel_that_differs(monkeypatch, capsys):
    """What `check` compares is not the reference with itself: a perturbed reference fails."""
    import swiftune.kernels as kernels

    true_reference = kernels.swiglu_reference
    monkeypatch.setattr(kernels, "swiglu_reference", lambda g, u: true_reference(g, u) * 1.001)
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("swiglu ") and "FAIL" in line for line in out.splitlines())
    assert "MISMATCH" in out


def test_check_on_a_cpu_without_interpreter_runs_the_interpreter():
    """A fresh process on a CPU without TRITON_INTERPRET: `swiftune check` re-runs itself under the
    interpreter and says so, instead of comparing the reference with itself. On a GPU machine the same
    command checks the compiled kernels, in this process."""
    proc = subprocess.run([sys.executable, "-m", "swiftune.cli", "check"], env=ENV_WITHOUT_INTERPRETER,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if torch.cuda.is_available():
        assert f"compiled for {torch.cuda.get_device_name()}" in proc.stdout and "subprocess" not in proc.stdout
    else:
        assert "Triton interpreter" in proc.stdout and "subprocess" in proc.stdout
    assert "every kernel matches its reference" in proc.stdout


def test_ctrl_c_ends_in_one_line_and_status_130(monkeypatch, capsys):
    import swiftune.cli as cli
    from swiftune.training import TrainingInterrupted

    def interrupted(argv):
        raise TrainingInterrupted("saved checkpoint-3 in out/; resume with --resume_from_checkpoint true", 3, "out/checkpoint-3")

    monkeypatch.setitem(cli.COMMANDS, "sft", interrupted)
    assert cli.main(["sft"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("swiftune sft: interrupted: saved checkpoint-3") and "\n" not in err


def test_a_dataset_folder_loads_as_trl_sft_loads_it(tmp_path):
    """A folder of data files (datasets.load_dataset) or save_to_disk output (load_from_disk): it was read
    as a file of unknown type; the library names what to do with a folder."""
    import datasets

    from swiftune.cli.runs import load_rows
    from swiftune.data import DataFormatError, build_tokenizer, prepare_dataset

    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [dict(r) for r in load_rows(str(files), "train", list)] == rows
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert [dict(r) for r in load_rows(str(tmp_path / "saved"), "train", list)] == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    assert [dict(r) for r in load_rows(str(tmp_path / "splits"), "train", list)] == rows
    with pytest.raises(ValueError, match=r"has splits \['train'\], not 'test'"):
        load_rows(str(tmp_path / "splits"), "test", list)
    with pytest.raises(DataFormatError, match="is a folder, not a dataset file"):
        prepare_dataset(str(files), build_tokenizer())


def test_commands_on_a_machine_without_cuda_run_use_cpu(monkeypatch):
    """Without CUDA the commands set use_cpu (what puts a torchrun launch in transformers' distributed
    mode; without it each process trained alone); given, the user's value stays."""
    import swiftune.cli.arguments as arguments

    monkeypatch.setattr(arguments, "_has_cuda", lambda: False)
    assert parse_sft_args([])[1].use_cpu is True
    monkeypatch.setattr(arguments, "_has_cuda", lambda: True)
    assert parse_sft_args(["--use_cpu", "true"])[1].use_cpu is True


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_resume_without_a_complete_checkpoint_is_refused_before_loading(tmp_path, monkeypatch, capsys, command):
    """``--resume_from_checkpoint true`` with no complete checkpoint in output_dir, or a checkpoint folder a save
    left incomplete, ends in one line before any model is built (it was the Trainer's error after loading)."""
    import importlib

    module = importlib.import_module(f"swiftune.cli.{command}")
    monkeypatch.setattr(module, "build_model", lambda *a, **k: pytest.fail("the model was built before the check"))
    out = tmp_path / "run"
    assert main([command, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 2
    assert "no complete checkpoint in output_dir" in one_line_error(capsys)
    (out / "checkpoint-4").mkdir(parents=True)  # a save cut short: no trainer_state.json
    assert main([command, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-4")]) == 2
    assert "cannot be resumed from" in one_line_error(capsys)
    assert main([command, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 2
    assert "1 incomplete: checkpoint-4" in one_line_error(capsys)
