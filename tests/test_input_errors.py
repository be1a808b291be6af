"""Bad input ends in an error naming the function, row or file: reward functions that raise or
never return, chat rows with unknown roles or null content, non-UTF-8 and broken JSON files; empty
completions and assistant turns are dropped and counted, as docs/data.md says."""

import asyncio
import logging
import threading
import time

import pytest

from swiftune.data import DataFormatError, build_tokenizer, prepare_dataset
from swiftune.data.formatting import check_messages
from swiftune.rl import GRPOConfig
from swiftune.rl.rewards import RewardFunctionError, RewardTimeoutError, compute_rewards

PROMPTS = ["p0", "p0", "p1", "p1"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]
IDS = [[1], [2, 2], [3, 3, 3], [4, 4, 4, 4]]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# ----------------------------------------------------------------------------- rewards

def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_reward_exception_names_function_and_row():
    def parse_answer(prompts, completions, answer, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]  # row 2 ("ccc") divides by zero

    with pytest.raises(RewardFunctionError, match=r"'parse_answer' raised ZeroDivisionError.*row 2 \(completion 0 "
                                                  r"of prompt 1\).*'ccc'") as info:
        compute_rewards([length_reward, parse_answer], PROMPTS, COMPLETIONS, IDS, {"answer": list("wxyz")},
                        group_size=2, trainer_state=None)
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the original is chained
    assert "traceback is chained to this error (swiftune's commands print it with --traceback)" in str(info.value)


def test_async_reward_exception_is_wrapped():
    async def remote_judge(prompts, completions, **kwargs):
        if any(c == "bb" for c in completions):
            raise ConnectionError("judge unreachable")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'remote_judge' raised ConnectionError: judge unreachable on row 1"):
        compute_rewards([remote_judge], PROMPTS, COMPLETIONS, IDS)


def test_batch_only_failure_is_reported_without_a_row():
    def needs_groups(prompts, completions, **kwargs):
        if len(completions) % 2:
            raise KeyError("odd")
        raise ValueError("bad batch")

    with pytest.raises(RewardFunctionError, match=r"'needs_groups' raised ValueError: bad batch on the batch of 4 "
                                                  r"completions \(.*row 0 alone raised KeyError instead"):
        compute_rewards([needs_groups], PROMPTS, COMPLETIONS, IDS)


def test_reward_that_never_returns_times_out():
    release = threading.Event()

    def stuck_verifier(prompts, completions, **kwargs):
        release.wait(5)  # "forever" for the test; released at the end so no thread outlives it long
        return [0.0] * len(completions)

    t0 = time.perf_counter()
    try:
        with pytest.raises(RewardTimeoutError, match=r"'stuck_verifier' did not return within reward_timeout=0.5 s"):
            compute_rewards([length_reward, stuck_verifier], PROMPTS, COMPLETIONS, IDS, timeout=0.5)
    finally:
        release.set()
    assert time.perf_counter() - t0 < 2.5


def test_async_reward_that_never_returns_times_out():
    async def slow_async(prompts, completions, **kwargs):
        await asyncio.sleep(5)
        return [0.0] * len(completions)

    async def quick(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match="'slow_async' did not return within reward_timeout=0.5 s"):
        compute_rewards([quick, slow_async], PROMPTS, COMPLETIONS, IDS, timeout=0.5)
    assert time.perf_counter() - t0 < 2.5


def test_reward_timeout_lets_quick_functions_through():
    async def quick(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    rewards, per_func = compute_rewards([length_reward, quick], PROMPTS, COMPLETIONS, IDS, timeout=5.0)
    assert rewards.tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="positive"):
        compute_rewards([length_reward], PROMPTS, COMPLETIONS, IDS, timeout=0)


def test_grpo_config_has_reward_timeout(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none").reward_timeout is None
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", reward_timeout=30.0).reward_timeout == 30.0


# ----------------------------------------------------------------------------- chat rows

def chat(*turns):
    return [{"role": r, "content": c} for r, c in turns]


@pytest.mark.parametrize("bad, message", [
    (chat(("user", "hi"), ("bot", "hello")), r"row 1: 'messages': message 1 has the unknown role 'bot'.*'assistant'"),
    (chat(("user", "hi"), ("assistant", None)), r"row 1: 'messages': message 1 \(assistant\) has content null"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"row 1: 'messages': message 1 .*content missing"),
    ([{"content": "hi"}], r"row 1: 'messages': message 0 has no 'role'"),
    (chat(("user", "hi"), ("assistant", 3)), r"row 1: 'messages': message 1 \(assistant\) has content of type int"),
])
def test_bad_messages_name_the_row(tokenizer, bad, message):
    rows = [{"messages": chat(("user", "a"), ("assistant", "b"))}, {"messages": bad}]
    with pytest.raises(DataFormatError, match=message):
        prepare_dataset(rows, tokenizer)


def test_bad_conversational_prompt_completion_names_the_row(tokenizer):
    rows = [{"prompt": chat(("user", "a")), "completion": chat(("assistant", "b"))},
            {"prompt": chat(("human", "a")), "completion": chat(("assistant", "b"))}]
    with pytest.raises(DataFormatError, match=r"row 1: 'prompt': message 0 has the unknown role 'human'.*'user'"):
        prepare_dataset(rows, tokenizer)


def test_tool_call_messages_may_have_null_content():
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    check_messages(chat(("user", "a")) + [call] + chat(("tool", "1"), ("assistant", "done")), "row 0")


# ----------------------------------------------------------------------------- empty completions

def test_empty_completions_and_assistant_turns_are_dropped_and_counted(tokenizer, caplog):
    rows = [{"prompt": "say hi", "completion": "hi"}, {"prompt": "say nothing", "completion": ""},
            {"prompt": "again", "completion": "ok"}]
    with caplog.at_level(logging.WARNING, logger="swiftune.data.formatting"):
        data = prepare_dataset(rows, tokenizer)
    assert len(data) == 2 and data.stats.num_dropped_no_trained_tokens == 1
    assert "1 of 3 rows had no trained tokens" in caplog.text
    # completion_only_loss=False trains the prompt too: nothing is empty then
    assert len(prepare_dataset(rows, tokenizer, completion_only_loss=False)) == 3

    conv = [{"prompt": chat(("user", "a")), "completion": chat(("assistant", ""))},
            {"prompt": chat(("user", "a")), "completion": chat(("assistant", "b"))}]
    data = prepare_dataset(conv, tokenizer)
    assert len(data) == 1 and data.stats.num_dropped_no_trained_tokens == 1

    messages = [{"messages": chat(("user", "a"), ("assistant", ""))},
                {"messages": chat(("user", "a"), ("assistant", ""), ("user", "b"), ("assistant", "c"))}]
    data = prepare_dataset(messages, tokenizer)
    assert len(data) == 1 and data.stats.num_dropped_no_trained_tokens == 1


# ----------------------------------------------------------------------------- files

def test_non_utf8_file_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9"):
        prepare_dataset(str(path), tokenizer)


def test_utf8_bom_is_accepted(tokenizer, tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b'\xef\xbb\xbf[{"text": "fine"}]')
    assert len(prepare_dataset(str(path), tokenizer)) == 1


def test_json_array_syntax_error_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"text": "one"},\n  {"text": "two",}\n]\n')
    with pytest.raises(DataFormatError, match=r"rows.json:3:\d+: not valid JSON"):
        prepare_dataset(str(path), tokenizer)


def test_json_rows_that_are_not_objects_are_named(tokenizer, tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"text": "one"}, ["two"]]')
    with pytest.raises(DataFormatError, match=r"rows.json: element 1 of the JSON array is a JSON list"):
        prepare_dataset(str(path), tokenizer)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "one"}\n"two"\n')
    with pytest.raises(DataFormatError, match=r"rows.jsonl:2 is a JSON str, not an object"):
        prepare_dataset(str(path), tokenizer)


# ----------------------------------------------------------------------------- GRPO prompts

@pytest.mark.parametrize("bad, needle", [
    ("", "row 2: the prompt is empty"),
    ("   ", "row 2: the prompt is empty"),
    ([], "row 2: the prompt is empty"),
    (None, "row 2: a prompt must be a string or a list of messages"),
    ([{"content": "no role"}], "row 2: a prompt must be a string or a list of messages"),
])
def test_grpo_prompts_are_checked_when_the_trainer_is_made(tokenizer, bad, needle):
    """A bad prompt is named by its row when the trainer is built, not when its generation comes
    (an empty one failed steps later, without the row, and lost the run's model)."""
    from transformers import AutoModelForCausalLM

    from swiftune.data import tiny_model_config
    from swiftune.rl import GRPOTrainer

    rows = [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}, {"prompt": bad}]
    model = AutoModelForCausalLM.from_config(tiny_model_config("qwen3"))
    args = GRPOConfig(output_dir="unused", report_to="none", num_generations=2, per_device_train_batch_size=2,
                      use_cpu=True)
    with pytest.raises(ValueError, match=needle):
        GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=rows, processing_class=tokenizer)
    with pytest.raises(ValueError, match=needle.replace("row 2", "eval_dataset row 2")):
        GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=rows[:2], eval_dataset=rows,
                    processing_class=tokenizer)
