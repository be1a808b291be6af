"""The prefill token cap of the two vision rollout engines (issue 28), against transformers.

A chunk of ``max_batch_size // G`` image prompts says nothing of its images' tokens, so both engines
split it further by ``max_prefill_tokens`` (text + image tokens of one prefill). What is checked:

* the chunks formed (:func:`split_by_prefill_tokens`) keep every prefill under the cap, keep the
  prompts in order and together, and a prompt above the cap runs alone with a log line;
* the prefills the engines really run (seen by hooks on the model: the left-padded batch of
  :class:`VisionRolloutEngine`, the packed row of :class:`VisionFastRolloutEngine`) obey the cap;
* the completions are still the reference's: transformers' own greedy ``generate`` of the
  unpatched ``Qwen3VLForConditionalGeneration`` on each prompt alone, and its forward's float64
  log-probs (fp32 on CPU, the tiny model of tests/test_qwen3_vl.py);
* bad caps are refused when the engine is built.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import swiftune
from swiftune.models.patching import causal_lm_of
from swiftune.rl.multimodal import VisionGRPO, VisionRolloutEngine
from swiftune.rl.rollout import SamplingParams
from swiftune.rl.rollout.vision_fast import (VisionFastRolloutEngine, auto_prefill_token_cap, prefill_bytes_per_token,
                                             prefill_tokens, split_by_prefill_tokens)

from tests.test_qwen3_vl import _model, _processor, _rel
from tests.test_vl_rollout_batched import G, _greedy, _reference_logps, _rows

ENGINES = {"transformers": VisionRolloutEngine, "fast": VisionFastRolloutEngine}
N_NEW = 8


@pytest.fixture(scope="module")
def setup():
    """The tiny Qwen3-VL (unpatched reference and patched policy), its three prompts with 0, 1 and 2
    images, and transformers' greedy generate of each prompt alone."""
    proc = _processor()
    base = _model(proc).eval()
    policy = swiftune.patch_model(copy.deepcopy(base), attention="reference", kernel_backend="reference")
    vision = VisionGRPO(policy, proc)
    prompts = [vision.encode(row) for row in _rows()]
    assert len({len(p.input_ids) for p in prompts}) == 3
    return proc, base, policy, vision, prompts, [_greedy(base, vision, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "left-padded"])
@pytest.mark.parametrize("copies", [1, 3])
def test_runs_obey_the_cap_in_order(padded, copies, caplog):
    """Random lengths and caps: the runs cover the prompts once, in order; each run's prefill is
    within the cap unless it is one prompt above it (then logged); and no run could take the next
    prompt without going over the cap (greedy, so no needless extra prefill)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 60, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        cap = int(torch.randint(1, 200, (1,), generator=gen))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="swiftune.rl.rollout.vision_fast"):
            runs = split_by_prefill_tokens(lengths, cap, padded=padded, copies=copies)
        assert [i for run in runs for i in run] == list(range(len(lengths)))
        oversized = 0
        for k, run in enumerate(runs):
            tokens = prefill_tokens(lengths[run.start:run.stop], padded=padded, copies=copies)
            if tokens > cap:
                assert len(run) == 1, (lengths, cap, runs)
                oversized += 1
            if k + 1 < len(runs):
                grown = prefill_tokens(lengths[run.start:run.stop + 1], padded=padded, copies=copies)
                assert grown > cap, (lengths, cap, runs)
        assert len([r for r in caplog.records if "above max_prefill_tokens" in r.getMessage()]) == oversized
    assert split_by_prefill_tokens([5, 7], None, padded=padded) == [range(2)]
    assert split_by_prefill_tokens([], 10, padded=padded) == []


def test_token_counts_are_the_engines_layouts():
    """Packed: the sum of the prompts; left-padded: rows x the longest; copies multiply both."""
    assert prefill_tokens([3, 5, 2], padded=False) == 10
    assert prefill_tokens([3, 5, 2], padded=True) == 15
    assert prefill_tokens([3, 5, 2], padded=True, copies=2) == 30


@pytest.mark.parametrize("engine_name", list(ENGINES))
@pytest.mark.parametrize("bad", [0, -4, True, 2.5, "big", "AUTO"])
def test_bad_caps_are_refused(setup, engine_name, bad):
    _, _, policy, vision, _, _ = setup
    with pytest.raises(ValueError, match="max_prefill_tokens must be a positive number of tokens"):
        ENGINES[engine_name](policy, vision.rope_index, vision.image_token_id, max_prefill_tokens=bad)


def test_auto_cap_is_none_off_cuda_and_the_estimate_counts_the_vision_tower(setup):
    """On CPU "auto" is no cap (free memory does not limit a chunk there); the per-token estimate of
    the VL model is its text decoder's plus its vision tower's (a larger vision tower, a larger estimate)."""
    _, base, policy, _, _, _ = setup
    assert auto_prefill_token_cap(policy, 0.5) is None
    config = causal_lm_of(base).config
    with_vision = prefill_bytes_per_token(config, 4)
    text_only = prefill_bytes_per_token(config.text_config, 4)
    assert with_vision > text_only > 0
    wider = config.to_dict()
    wider["vision_config"] = {**wider["vision_config"], "intermediate_size": 4 * config.vision_config.intermediate_size}
    assert prefill_bytes_per_token(wider, 4) > with_vision
    assert prefill_bytes_per_token(config, 2) * 2 == with_vision


class PrefillShapes:
    """The prefills a vision engine runs, seen on the multimodal model (``Qwen3VLModel``): the shape
    of each forward's ``input_ids`` of more than one token (decode steps feed one token per row)."""

    def __init__(self, model):
        stack = causal_lm_of(model).model
        self.shapes: list[tuple[int, int]] = []
        self.handle = stack.register_forward_pre_hook(self._call, with_kwargs=True)

    def _call(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            self.shapes.append(tuple(ids.shape))

    def remove(self) -> None:
        self.handle.remove()


@pytest.mark.parametrize("engine_name", list(ENGINES))
@pytest.mark.parametrize("cap_of", ["two-prompts", "each-alone"])
def test_capped_prefills_give_transformers_generate_per_prompt(setup, engine_name, cap_of, caplog):
    """The three prompts (0, 1 and 2 images, three lengths) under a cap that fits the two shorter
    prompts' prefill but not all three (or under a cap below every prompt: each alone, logged).
    Every prefill the engine runs is within the cap (or one prompt), there are as many as the split
    says, and every row is transformers' greedy generate of its prompt alone with its forward's
    log-probs."""
    _, base, policy, vision, prompts, greedy = setup
    lengths = [len(p.input_ids) for p in prompts]
    padded = engine_name == "transformers"
    if cap_of == "two-prompts":
        cap = max(prefill_tokens(lengths[1:], padded=padded), prefill_tokens(lengths[:1], padded=padded))
        assert cap < prefill_tokens(lengths, padded=padded)
    else:
        cap = min(lengths) - 1
    want_runs = split_by_prefill_tokens(lengths, cap, padded=padded)
    assert 1 < len(want_runs) <= len(prompts)
    engine = ENGINES[engine_name](policy, vision.rope_index, vision.image_token_id, max_prefill_tokens=cap)
    seen = PrefillShapes(policy)
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="swiftune.rl.rollout.vision_fast"):
            out = vision.generate(engine, prompts, G, SamplingParams(max_tokens=N_NEW, temperature=0.0,
                                                                     stop_token_ids=()))
    finally:
        seen.remove()
    assert len(seen.shapes) == len(want_runs), seen.shapes
    for (rows, width), run in zip(seen.shapes, want_runs):
        assert rows == (len(run) if padded else 1)  # left-padded rows / one packed row
        tokens = rows * width
        assert tokens == prefill_tokens(lengths[run.start:run.stop], padded=padded)
        assert tokens <= cap or len(run) == 1, (seen.shapes, cap)
    warned = [r for r in caplog.records if "above max_prefill_tokens" in r.getMessage()]
    assert len(warned) == (len(prompts) if cap_of == "each-alone" else 0)
    for k, prompt in enumerate(prompts):
        assert out.completion_ids[G * k:G * k + G] == [greedy[k]] * G, k
        want = _reference_logps(base, vision, prompt, greedy[k], 1.0)
        for j in range(G):
            assert _rel(out.logprobs[G * k + j].double(), want) < 1e-5, (k, j)


def test_cap_counts_every_copy_on_caches_without_row_repeat(setup, monkeypatch):
    """Caches without ``batch_repeat_interleave`` prefill each prompt ``G`` times: the cap counts
    the ``G`` copies (a cap that fits one copy of the two short prompts fits neither with two)."""
    from swiftune.rl import multimodal, rollout

    _, base, policy, vision, prompts, greedy = setup
    for module in (rollout, multimodal):
        monkeypatch.setattr(module, "cache_supports", lambda cache, method: False)
    lengths = [len(p.input_ids) for p in prompts]
    cap = prefill_tokens(lengths[1:], padded=True)  # one copy of the two shorter prompts
    want_runs = split_by_prefill_tokens(lengths, cap, padded=True, copies=G)
    assert len(want_runs) == len(prompts)  # with the copies, no two prompts fit together
    engine = VisionRolloutEngine(policy, vision.rope_index, vision.image_token_id, max_prefill_tokens=cap)
    seen = PrefillShapes(policy)
    try:
        out = vision.generate(engine, prompts, G, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=()))
    finally:
        seen.remove()
    assert [rows for rows, _ in seen.shapes] == [G] * len(prompts)
    for k in range(len(prompts)):
        assert out.completion_ids[G * k:G * k + G] == [greedy[k][:5]] * G, k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_capped_fast_engine_with_cuda_graphs(setup):
    """On CUDA (fp32, TF32 off): the fast engine with CUDA graphs under a cap that splits the three
    prompts (the workspace and graphs of one sub-chunk reused or rebuilt for the next), and its
    default "auto" cap (resolved from free memory: a positive number of tokens); greedy rows equal
    transformers' generate of the unpatched CUDA model per prompt."""
    _, base, _, vision, prompts, _ = setup
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        reference = copy.deepcopy(base).cuda()
        policy = swiftune.patch_model(copy.deepcopy(base).cuda(), attention="auto", kernel_backend="auto")
        auto = auto_prefill_token_cap(policy, 0.2)
        assert auto is not None and auto >= 1
        lengths = [len(p.input_ids) for p in prompts]
        cap = prefill_tokens(lengths[1:], padded=False)
        assert len(split_by_prefill_tokens(lengths, cap, padded=False)) == 2
        params = SamplingParams(max_tokens=N_NEW, temperature=0.0, stop_token_ids=())
        for max_prefill in (cap, "auto"):
            engine = VisionFastRolloutEngine(policy, vision.rope_index, vision.image_token_id,
                                             max_prefill_tokens=max_prefill)
            out = vision.generate(engine, prompts, G, params)
            for k, prompt in enumerate(prompts):
                want = _greedy(reference, vision, prompt, N_NEW)
                assert out.completion_ids[G * k:G * k + G] == [want] * G, (max_prefill, k)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
