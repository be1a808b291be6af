"""The routed experts' decode kernels (swiftune.kernels.moe_decode; issue 25's rollout target).

References, never swiftune: a float64 formula (each token's k experts, product by product), transformers'
own experts modules (Qwen3MoeExperts, MixtralExperts, GptOssExperts: their loop over experts) and, for
the engine, transformers' generate on the unpatched model. On the CPU the kernels run through the Triton
interpreter (tests/conftest.py); the CUDA cases compile them and capture them in a CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import swiftune.models.experts as experts_module
from swiftune.kernels.moe_decode import moe_decode, moe_decode_interpreted, moe_decode_reference
from swiftune.models import patch_model
from swiftune.models.families import FAMILIES
from swiftune.rl.rollout import FastRolloutEngine, SamplingParams
from tests.helpers import rel_err
from tests.test_moe_parity import tiny_moe
from tests.test_moe_rollout import PAD, PROMPTS, _hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the layouts of transformers' fused experts: Qwen3-MoE / Mixtral, and gpt-oss (transposed, interleaved
# gate/up columns, biases, clamped SwiGLU)
LAYOUTS = {
    "qwen3_moe": dict(transposed=False, interleaved=False, biased=False, activation="silu"),
    "gpt_oss": dict(transposed=True, interleaved=True, biased=True, activation="clamped_swiglu"),
}
ALPHA, LIMIT = 1.702, 0.8  # a low limit so the clamps bend for some of the random pre-activations


def _routing(tokens: int, experts: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct experts per token in random slot order: expert 0 in every token (all rows),
    expert 1 in token 0 only (one row; at T = 1 both have all rows), expert ``E - 1`` in none, the rest
    drawn at random from experts 2 .. E-2."""
    rows = []
    for t in range(tokens):
        pool = torch.randperm(experts - 3, generator=generator)[: k - 1 - (t == 0)] + 2
        chosen = torch.cat([torch.tensor([0] + ([1] if t == 0 else [])), pool])
        rows.append(chosen[torch.randperm(k, generator=generator)])
    return torch.stack(rows)


def _case(layout: str, tokens: int, dtype: torch.dtype, seed: int = 0, experts: int = 8, k: int = 3,
          hidden: int = 48, inter: int = 40):
    """Random inputs of one layout (sizes not multiples of the tiles, so the masks matter)."""
    g = torch.Generator().manual_seed(seed)
    spec = LAYOUTS[layout]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    gate_up = rand(experts, hidden, 2 * inter, scale=0.3) if spec["transposed"] else rand(experts, 2 * inter, hidden,
                                                                                       scale=0.3)
    down = rand(experts, inter, hidden, scale=0.3) if spec["transposed"] else rand(experts, hidden, inter, scale=0.3)
    inputs = dict(hidden=rand(tokens, hidden), top_k_index=_routing(tokens, experts, k, g),
                  top_k_weights=torch.rand(tokens, k, generator=g).to(dtype), gate_up_proj=gate_up, down_proj=down)
    options = dict(transposed=spec["transposed"], interleaved=spec["interleaved"], activation=spec["activation"],
                   swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    if spec["biased"]:
        options.update(gate_up_bias=rand(experts, 2 * inter, scale=0.5), down_bias=rand(experts, hidden, scale=0.5))
    return inputs, options


def _float64_formula(inputs: dict, options: dict) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the module docstring's math written out."""
    x, idx, r = (inputs[n].double() for n in ("hidden", "top_k_index", "top_k_weights"))
    idx = inputs["top_k_index"]
    gu, d = inputs["gate_up_proj"].double(), inputs["down_proj"].double()
    if not options["transposed"]:
        gu, d = gu.transpose(1, 2), d.transpose(1, 2)  # [E, H, 2I], [E, I, H]
    inter = d.shape[1]
    gate_cols = torch.arange(inter) * 2 if options["interleaved"] else torch.arange(inter)
    up_cols = gate_cols + 1 if options["interleaved"] else gate_cols + inter
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            pre = x[t] @ gu[e]
            if "gate_up_bias" in options:
                pre = pre + options["gate_up_bias"][e].double()
            gate, up = pre[gate_cols], pre[up_cols]
            if options["activation"] == "silu":
                h = gate / (1 + torch.exp(-gate)) * up
            else:
                gate = gate.clamp(max=LIMIT)
                h = (up.clamp(-LIMIT, LIMIT) + 1) * gate / (1 + torch.exp(-ALPHA * gate))
            y = h @ d[e]
            if "down_bias" in options:
                y = y + options["down_bias"][e].double()
            out[t] += r[t, j] * y
    return out


def _to(inputs: dict, options: dict, device: str) -> tuple[dict, dict]:
    def move(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    return {n: move(v) for n, v in inputs.items()}, {n: move(v) for n, v in options.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_kernel_equals_the_float64_formula(layout, tokens):
    """fp32: experts with all rows, one row and none, random slot orders, sizes off the tiles; the kernel
    (interpreted on the CPU, compiled on CUDA) equals the float64 formula per token, and so does the
    module's own reference loop."""
    inputs, options = _case(layout, tokens, torch.float32, seed=tokens)
    want = _float64_formula(inputs, options)
    assert want.abs().min(dim=1).values.gt(0).all()
    with torch.no_grad():
        on_device, on_device_options = _to(inputs, options, DEVICE)
        got = moe_decode(**on_device, **on_device_options, backend="triton")
    assert got.dtype == torch.float32 and got.shape == want.shape
    for t in range(tokens):  # every token: a dropped or misrouted row shows in its own row
        assert rel_err(got[t], want[t]) < 1e-5, t
    reference = moe_decode_reference(**inputs, **options)
    assert reference.dtype == torch.float32 and rel_err(reference, want) < 1e-6  # float64 math, fp32 result


@pytest.mark.parametrize("stack", ["untransposed", "strided_view"])
def test_interleaved_columns_from_a_stack_without_unit_column_stride(stack):
    """Interleaved gate/up columns are read as one contiguous tile; a stack whose columns are not
    contiguous (the untransposed ``[E, 2I, H]`` layout, or a transposed view of one) is copied to
    ``[E, H, 2I]`` first and gives the float64 formula's result all the same."""
    inputs, options = _case("gpt_oss", 7, torch.float32, seed=11)
    want = _float64_formula(inputs, options)
    if stack == "untransposed":  # gate_up [E, 2I, H], down [E, H, I]
        inputs = dict(inputs, gate_up_proj=inputs["gate_up_proj"].transpose(1, 2).contiguous(),
                      down_proj=inputs["down_proj"].transpose(1, 2).contiguous())
        options = dict(options, transposed=False)
    else:  # the same [E, H, 2I] values, column stride H
        inputs = dict(inputs, gate_up_proj=inputs["gate_up_proj"].transpose(1, 2).contiguous().transpose(1, 2))
        assert inputs["gate_up_proj"].stride(2) != 1
    with torch.no_grad():
        on_device, on_device_options = _to(inputs, options, DEVICE)
        got = moe_decode(**on_device, **on_device_options, backend="triton")
    assert max(rel_err(got[t], want[t]) for t in range(7)) < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_smaller_row_tile_loops_over_an_experts_rows(layout):
    """``block_m=16`` at 40 tokens: experts 0 (every token) and others hold more rows than the tile, so
    their programs loop over row blocks, reading their weights again; equal to the float64 formula per
    token. A tile that is not a power of two >= 16 is refused."""
    inputs, options = _case(layout, 40, torch.float32, seed=8)
    want = _float64_formula(inputs, options)
    with torch.no_grad():
        on_device, on_device_options = _to(inputs, options, DEVICE)
        got = moe_decode(**on_device, **on_device_options, backend="triton", block_m=16)
        assert max(rel_err(got[t], want[t]) for t in range(40)) < 1e-5
        for bad in (8, 24):
            with pytest.raises(ValueError, match="power of two >= 16"):
                moe_decode(**on_device, **on_device_options, backend="triton", block_m=bad)


def test_kernel_loops_over_row_blocks_beyond_one_tile():
    """100 tokens (past the wiring's 64, which the launcher still takes): expert 0 has 100 rows, more
    than one 64-row tile, so its programs loop over two row blocks; the scan over assignments takes
    five chunks. Equal to the float64 formula per token."""
    inputs, options = _case("gpt_oss", 100, torch.float32, seed=5, k=3)
    want = _float64_formula(inputs, options)
    with torch.no_grad():
        on_device, on_device_options = _to(inputs, options, DEVICE)
        got = moe_decode(**on_device, **on_device_options, backend="triton")
    assert max(rel_err(got[t], want[t]) for t in range(100)) < 1e-5


@pytest.mark.parametrize("layout,dtype", [("qwen3_moe", torch.bfloat16), ("gpt_oss", torch.bfloat16),
                                          ("qwen3_moe", torch.float16)])
@pytest.mark.parametrize("tokens", [7, 40])
def test_kernel_in_half_precision(layout, dtype, tokens):
    """bf16 / fp16 inputs (rounded h, y and per-add combine): within the 16-bit tolerance of the float64
    formula on the same (rounded) inputs; the output is in the activation dtype. 40 tokens take the
    launcher's tiles for more than 16 rows (gpt-oss's wider ones among them)."""
    inputs, options = _case(layout, tokens, dtype, seed=3)
    want = _float64_formula(inputs, options)
    with torch.no_grad():
        on_device, on_device_options = _to(inputs, options, DEVICE)
        got = moe_decode(**on_device, **on_device_options, backend="triton")
    assert got.dtype == dtype
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("big_first", [True, False])
def test_combine_adds_in_ascending_expert_order_rounding_each_add(big_first):
    """The combine's order and roundings, pinned with exact values: one token, three experts whose
    weighted outputs are exactly 256, 1 and 1 in bf16 (gate pre-activation 32, where silu(32) = 32 in
    float32; powers of two elsewhere). Added one by one in ascending expert id, each sum rounded to
    bf16, 256 + 1 + 1 stays 256 (257 ties to even), while 1 + 1 + 256 is 258; a float32 accumulator
    would give 258 both ways. The slots are listed in an order that is not the experts' order."""
    experts, hidden, inter = 6, 16, 16
    big, small = (1, [3, 5]) if big_first else (5, [1, 3])
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    x[0, 0] = 1
    gate_up = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    gate_up[:, :inter, 0] = 32  # gate columns: 32 -> silu = 32 exactly
    gate_up[:, inter, 0] = 1  # up column 0 only: h = [32, 0, ...]
    down = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    down[big, :, 0] = 8  # 32 * 8 = 256
    down[small, :, 0] = 1 / 32  # 32 / 32 = 1
    index = torch.tensor([[small[1], big, small[0]]])
    weights = torch.ones(1, 3, dtype=torch.bfloat16)
    with torch.no_grad():
        got = moe_decode(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE),
                         transposed=False, backend="triton").cpu()
    parts = {big: torch.tensor(256.0, dtype=torch.bfloat16), small[0]: torch.tensor(1.0, dtype=torch.bfloat16),
             small[1]: torch.tensor(1.0, dtype=torch.bfloat16)}
    want = parts[min(parts)]
    for e in sorted(parts)[1:]:
        want = want + parts[e]  # bf16 + bf16: rounded to bf16
    assert float(want) == (256.0 if big_first else 258.0)
    assert torch.equal(got, torch.full((1, hidden), float(want), dtype=torch.bfloat16))


def _experts_module(family: str, dtype: torch.dtype = torch.float32):
    """transformers' own experts module of a tiny config, random weights (and biases for gpt-oss)."""
    config = tiny_moe(family).config
    cls = {"qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts,
           "mixtral": transformers.models.mixtral.modeling_mixtral.MixtralExperts,
           "gpt_oss": transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts}[family]
    torch.manual_seed(11)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.to(dtype).eval(), config


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_kernel_equals_transformers_experts_module(family):
    """transformers' experts forward (its loop over experts, fp32) on softmax routing weights and
    top-k experts of random router logits equals the kernel on the module's own tensors."""
    module, config = _experts_module(family)
    spec = FAMILIES[family].experts
    k, tokens = config.num_experts_per_tok, 9
    hidden = torch.randn(tokens, config.hidden_size)
    weights, index = torch.randn(tokens, module.gate_up_proj.shape[0]).softmax(-1).topk(k, dim=-1)
    with torch.no_grad():
        want = module(hidden, index, weights)
        extra = dict(activation="clamped_swiglu", swiglu_alpha=module.alpha, swiglu_limit=module.limit,
                     gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias) if spec.biased else {}
        got = moe_decode(hidden.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), module.gate_up_proj.to(DEVICE),
                         module.down_proj.to(DEVICE), transposed=spec.transposed, interleaved=spec.interleaved,
                         backend="triton", **{n: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                                              for n, v in extra.items()})
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rollout_experts_forward_takes_the_kernel_for_decode_steps(family, monkeypatch):
    """Inside rollout_experts, a patched model's MoE block with kernel_backend='triton' runs the decode
    kernel for a few tokens (a spy counts the calls) and equals the unpatched block; a prefill-sized call,
    kernel_backend='reference', and autograd keep the grouped-GEMM path."""
    from swiftune.models.experts import default_decode_kernel_cap, rollout_experts

    calls = []
    real = experts_module.moe_decode
    monkeypatch.setattr(experts_module, "moe_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    reference = tiny_moe(family).to(DEVICE)
    cap = default_decode_kernel_cap(FAMILIES[family].experts)
    assert cap == (64 if family == "gpt_oss" else 16)  # the layout's cap, as measured (experts.py)
    for backend, tokens, expect_kernel, raised in (("triton", 5, True, None), ("triton", cap, True, None),
                                                   ("triton", cap + 1, False, None), ("triton", cap + 1, True, cap + 8),
                                                   ("triton", 5, False, 4), ("reference", 5, False, None)):
        if backend == "triton" and DEVICE == "cuda":
            backend = "auto"
        model = patch_model(copy.deepcopy(reference), attention="reference", kernel_backend=backend)
        block, ref_block = model.model.layers[0].mlp, reference.model.layers[0].mlp
        x = torch.randn(1, tokens, reference.config.hidden_size, device=DEVICE)
        calls.clear()
        with torch.no_grad():
            want = ref_block(x)
            with rollout_experts(model, FAMILIES[family], decode_kernel_max_tokens=raised):  # None: the default
                got = block(x)
        got = got[0] if isinstance(got, tuple) else got
        want = want[0] if isinstance(want, tuple) else want
        assert calls == ([tokens] if expect_kernel else []), (backend, tokens, raised)
        assert rel_err(got, want) < 1e-5
        if expect_kernel:
            kernel_model = model
    block = kernel_model.model.layers[0].mlp
    with rollout_experts(kernel_model, FAMILIES[family]):  # grad mode: never the no-backward kernel
        calls.clear()
        got = block(x[:, :3])
        got = got[0] if isinstance(got, tuple) else got
        assert calls == [] and got.requires_grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the engine's bf16 graph case is the CUDA test below")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_greedy_with_the_kernel_equals_generate(family, monkeypatch):
    """FastRolloutEngine on a tiny Qwen3-MoE (and gpt-oss: transposed, biased, clamped) with every
    Triton kernel forced (the interpreter on the CPU): the decode steps ran the experts' decode kernel,
    and the greedy tokens equal transformers' generate on the unpatched model, for every row."""
    calls = []
    real = experts_module.moe_decode
    monkeypatch.setattr(experts_module, "moe_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    reference = tiny_moe(family, seed=3, eos_token_id=None)
    sparse_layers = sum(hasattr(layer.mlp, "experts") for layer in reference.model.layers)
    policy = patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="triton").eval()
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4).generate(
        PROMPTS, 1, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=()))
    assert calls.count(len(PROMPTS)) == 5 * sparse_layers  # every decode step after the prefill took it
    assert out.completion_ids == [_hf_greedy(reference, p, 6) for p in PROMPTS]
    # the engine's cap: 0 sends every step to the grouped GEMM, same tokens; one below the rows' count too
    for cap in (0, len(PROMPTS) - 1):
        calls.clear()
        capped = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=4, moe_decode_max_tokens=cap).generate(
            PROMPTS, 1, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=()))
        assert calls == [] and capped.completion_ids == out.completion_ids, cap


def test_engine_refuses_a_bad_moe_decode_cap():
    model = tiny_moe("qwen3_moe")
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="whole number >= 0"):
            FastRolloutEngine(model, moe_decode_max_tokens=bad)


def test_bad_inputs_are_refused_with_the_fix_named():
    inputs, options = _case("qwen3_moe", 3, torch.float32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="transposed="):
            moe_decode(**inputs, **{**options, "transposed": True}, backend="triton")
        with pytest.raises(ValueError, match="top_k_weights"):
            moe_decode(**{**inputs, "top_k_weights": inputs["top_k_weights"][:, :1]}, **options)
        with pytest.raises(TypeError, match="cast them"):
            moe_decode(**{**inputs, "hidden": inputs["hidden"].bfloat16()}, **options)
        with pytest.raises(ValueError, match="activation"):
            moe_decode(**inputs, **{**options, "activation": "gelu"})
    with torch.no_grad():  # no tokens: an empty result, no launch
        empty = moe_decode(**{**inputs, "hidden": inputs["hidden"][:0], "top_k_index": inputs["top_k_index"][:0],
                              "top_k_weights": inputs["top_k_weights"][:0]}, **options)
    assert empty.shape == (0, inputs["hidden"].shape[1])
    weights = inputs["gate_up_proj"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no_grad"):
        moe_decode(**{**inputs, "gate_up_proj": weights}, **options)


def test_interpreter_flag_matches_the_machine():
    """The wiring's CPU condition: the kernels are interpreted exactly where there is no CUDA here."""
    assert moe_decode_interpreted() == (not torch.cuda.is_available())


@cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tokens", [8, 64])
def test_cuda_graph_replay_equals_eager_bf16(layout, tokens):
    """Compiled, bf16, Qwen3-30B-A3B's expert sizes (top-8, H 2048, I 768; 64 experts, with all rows,
    one row and none): within bf16 tolerance of the reference loop, and a CUDA-graph replay (no host
    sync in the launcher) equals the eager call bit for bit, as does a second eager call."""
    inputs, options = _case(layout, tokens, torch.bfloat16, experts=64, k=8, hidden=2048, inter=768)
    inputs, options = _to(inputs, options, "cuda")
    with torch.no_grad():
        eager = moe_decode(**inputs, **options)
        want = moe_decode_reference(**inputs, **options)
        assert rel_err(eager, want) < 1e-2
        assert torch.equal(moe_decode(**inputs, **options), eager)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_decode(**inputs, **options)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            replayed = moe_decode(**inputs, **options)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(replayed, eager)


@cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_engine_with_the_kernel_equals_generate_fp32(family, monkeypatch):
    """CUDA, fp32, no adapters: the engine's captured decode steps run the compiled decode kernel (the
    spy sees the calls made while capturing) and the greedy tokens equal transformers' generate on the
    unpatched model."""
    calls = []
    real = experts_module.moe_decode
    monkeypatch.setattr(experts_module, "moe_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    reference = tiny_moe(family, seed=8, eos_token_id=None).cuda()
    policy = patch_model(copy.deepcopy(reference), attention="reference", kernel_backend="auto").eval()
    out = FastRolloutEngine(policy, pad_token_id=PAD, kv_bucket=8, check_every=5,
                            attention_backend="reference").generate(
        PROMPTS, 2, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=()))
    assert out.stats["capture_s"] > 0 and calls
    for i, p in enumerate(PROMPTS):
        assert out.completion_ids[2 * i] == _hf_greedy(reference, p, 20), (family, i)
