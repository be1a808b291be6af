"""The training and sampling commands ask PyTorch for growable CUDA memory segments unless the user
chose allocator settings: a GRPO step on a 24 GB budget fitted a 14% longer completion with them
(docs/memory.md), and the benchmarks measured it so."""

import os

import pytest

import swiftune.cli as cli


@pytest.mark.parametrize("command", ["sft", "grpo", "generate"])
def test_commands_that_allocate_ask_for_expandable_segments(command):
    environ: dict[str, str] = {}
    cli.default_allocator_settings(command, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("command", ["plan", "check", "unknown"])
def test_commands_without_training_leave_the_allocator_alone(command):
    environ: dict[str, str] = {}
    cli.default_allocator_settings(command, environ)
    assert environ == {}


@pytest.mark.parametrize("own", ["max_split_size_mb:512", ""])
def test_the_users_own_allocator_settings_win(own):
    """Set or empty (PyTorch's default allocator, on purpose), the user's value stays."""
    environ = {"PYTORCH_CUDA_ALLOC_CONF": own}
    cli.default_allocator_settings("grpo", environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": own}


def test_main_sets_it_before_the_command_runs(monkeypatch):
    """The command module (which builds the model and touches CUDA) runs after the setting is in place."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    seen = {}

    def fake_grpo(argv):
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return 0

    monkeypatch.setitem(cli.COMMANDS, "grpo", fake_grpo)
    assert cli.main(["grpo"]) == 0
    assert seen["conf"] == "expandable_segments:True"
