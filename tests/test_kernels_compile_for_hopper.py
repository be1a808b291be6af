"""The MoE routing kernels, the split decode attention, decode_qkv's FP8 cache path, the GLU's row kernel, the
residual add + RMSNorm with its FP8 codes, the LoRA decode product, and the training RMSNorm and RoPE (one row
or token a program: the GPU's form, not the interpreter's tiles) compiled ahead of time for an H100/H200
(sm_90) on a machine without a GPU.

The CPU suite runs every kernel through the Triton interpreter, which checks what a kernel computes but not
that it compiles: types, shapes and layouts are only settled by the compiler. Triton compiles for a named
target without a device (its bundled ptxas included), so these kernels are compiled here for the GPU the
benchmarks run on, with the arguments the library launches them with.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from swiftune.kernels import decode_attention, glu, moe_decode, moe_route, moe_router  # noqa: E402

# the package exports functions of these names
decode_qkv = importlib.import_module("swiftune.kernels.decode_qkv")
rms_norm = importlib.import_module("swiftune.kernels.rms_norm")
lora_decode = importlib.import_module("swiftune.kernels.lora_decode")
rope = importlib.import_module("swiftune.kernels.rope")

HOPPER = GPUTarget("cuda", 90, 32)
def _expert_combine_signature(weights: str) -> dict:
    """expert_combine's signature with routing weights of type ``weights``."""
    return {"y_ptr": "*bf16", "slot_ptr": "*i64", "order_ptr": "*i64", "w_ptr": weights, "out_ptr": "*bf16",
            "hidden": "i32", "s_y": "i32", "s_o": "i32", "TOP_K": "constexpr", "BLOCK_H": "constexpr",
            "ROUND_BF16": "constexpr"}


ROUTER_TOPK_SIGNATURE = {
    "z_ptr": "*bf16", "w_ptr": "*bf16", "idx_ptr": "*i64", "num_experts": "i32", "stride_z": "i32", "stride_w": "i32",
    "stride_i": "i32", "TOP_K": "constexpr", "SOFTMAX_FIRST": "constexpr", "NORMALIZE": "constexpr",
    "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
EXPERT_PLACE_SIGNATURE = {
    "idx_ptr": "*i64", "hist_ptr": "*i32", "order_ptr": "*i64", "token_ptr": "*i64", "ends_ptr": "*i32",
    "slot_ptr": "*i64", "num_assign": "i32", "num_experts": "i32", "num_blocks": "i32", "TOP_K": "constexpr",
    "BLOCK_A": "constexpr", "BLOCK_E": "constexpr", "BLOCK_B": "constexpr", "BLOCK_K": "constexpr",
    "NO_EXPERT": "constexpr"}

def _split_attention_signature(cache: str) -> dict:
    """The split decode attention's signature over a cache of element type ``cache``."""
    return {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "cur_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32",
            "acc_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "sink_ptr": "*bf16", "out_ptr": "*bf16",
            "kv_heads": "i32", "kv_len": "i32", "chunk": "i32", "window": "i32", "scale": "fp32",
            **{f"s_{t}{a}": "i32" for t in "qkv" for a in ("b", "h", "g" if t == "q" else "l")},
            "s_sb": "i32", "s_sh": "i32", "s_ob": "i32", "s_oh": "i32", "s_og": "i32", "G": "constexpr",
            "D": "constexpr", "BLOCK_G": "constexpr", "BLOCK_N": "constexpr", "F32": "constexpr",
            "SCALED": "constexpr", "WHOLE": "constexpr", "HAS_SINKS": "constexpr"}


DECODE_QKV_SIGNATURE = {
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "wq_ptr", "wk_ptr", "cos_ptr", "sin_ptr", "qo_ptr"), "*bf16"),
    "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "slot_ptr": "*i64", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
    **dict.fromkeys(("sq_b", "sq_h", "sk_b", "sk_h", "sv_b", "sv_h", "sc_b", "sqo_b", "sqo_h", "skc_b", "skc_h",
                     "skc_s", "svc_b", "svc_h", "svc_s", "ss_b", "ss_h", "n_q_heads", "head_dim", "half"), "i32"),
    "eps": "fp32", "NORM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_HALF": "constexpr", "FP8": "constexpr"}

ROPE_SIGNATURE = {
    **dict.fromkeys(("q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "cos_ptr", "sin_ptr"), "*bf16"),
    **dict.fromkeys((f"s{t}_{a}" for t in ("q", "k", "qo", "ko") for a in "bhsd"), "i32"),
    **dict.fromkeys(("sc_b", "sc_s", "sc_d", "seq_len", "n_tokens", "n_q_heads", "n_k_heads", "half"), "i32"),
    **dict.fromkeys(("BACKWARD", "BLOCK_HQ", "BLOCK_HK", "BLOCK_D", "INT64", "TOKENS"), "constexpr")}

CASES = {
    "expert_sort's count, Qwen3-30B-A3B (128 experts)": (
        moe_route._expert_count_kernel,
        {"idx_ptr": "*i64", "hist_ptr": "*i32", "num_assign": "i32", "BLOCK_A": "constexpr", "BLOCK_E": "constexpr"},
        {"BLOCK_A": 64, "BLOCK_E": 128}, {}),
    "expert_sort's placement, Qwen3-30B-A3B (128 experts, top-8, 8 blocks)": (
        moe_route._expert_place_kernel,
        EXPERT_PLACE_SIGNATURE,
        {"TOP_K": 8, "BLOCK_A": 64, "BLOCK_E": 128, "BLOCK_B": 8, "BLOCK_K": 8, "NO_EXPERT": 2**30}, {}),
    "expert_sort's placement, the largest (256 experts, 64 blocks)": (
        moe_route._expert_place_kernel,
        EXPERT_PLACE_SIGNATURE,
        {"TOP_K": 8, "BLOCK_A": 64, "BLOCK_E": 256, "BLOCK_B": 64, "BLOCK_K": 8, "NO_EXPERT": 2**30},
        {"num_warps": 8}),
    "expert_combine, bf16 rows and weights": (
        moe_route._expert_combine_kernel,
        _expert_combine_signature("*bf16"),
        {"TOP_K": 8, "BLOCK_H": 1024, "ROUND_BF16": False}, {"enable_fp_fusion": False}),
    "expert_combine, explicit bf16 rounding (the interpreter's path, compiled here for its code)": (
        moe_route._expert_combine_kernel,
        _expert_combine_signature("*fp32"),
        {"TOP_K": 2, "BLOCK_H": 256, "ROUND_BF16": True}, {"enable_fp_fusion": False}),
    "moe_decode combine, explicit bf16 rounding": (
        moe_decode._moe_combine_kernel,
        {"y_ptr": "*bf16", "out_ptr": "*bf16", "s_yt": "i32", "s_yr": "i32", "s_ot": "i32", "hidden": "i32",
         "TOP_K": "constexpr", "BLOCK_H": "constexpr", "ROUND_BF16": "constexpr"},
        {"TOP_K": 8, "BLOCK_H": 1024, "ROUND_BF16": True}, {}),
    "moe_decode gate/up, Qwen3-30B-A3B layout at 64 tokens (64/64/4 tiles)": (
        moe_decode._moe_gate_up_kernel,
        {"x_ptr": "*bf16", "idx_ptr": "*i64", "w_ptr": "*bf16", "b_ptr": "*bf16", "h_ptr": "*bf16",
         **dict.fromkeys(("s_xt", "s_we", "s_wk", "s_wc", "s_be", "s_hm", "num_assign", "top_k", "hidden", "inter"),
                         "i32"), "alpha": "fp32", "limit": "fp32",
         **dict.fromkeys(("HAS_BIAS", "CLAMPED", "INTERLEAVED", "DOT_F32", "ROUND_BF16", "BLOCK_M", "BLOCK_N",
                          "BLOCK_K", "BLOCK_A"), "constexpr")},
        {"HAS_BIAS": False, "CLAMPED": False, "INTERLEAVED": False, "DOT_F32": False, "ROUND_BF16": False,
         "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_A": 64}, {"num_warps": 4}),
    "router top-k, softmax first (Qwen3-MoE)": (
        moe_router._router_topk_kernel,
        ROUTER_TOPK_SIGNATURE,
        {"TOP_K": 8, "SOFTMAX_FIRST": True, "NORMALIZE": True, "BLOCK_E": 128, "BLOCK_K": 8}, {}),
    "router top-k, top-k first (gpt-oss)": (
        moe_router._router_topk_kernel,
        ROUTER_TOPK_SIGNATURE,
        {"TOP_K": 4, "SOFTMAX_FIRST": False, "NORMALIZE": True, "BLOCK_E": 32, "BLOCK_K": 4}, {}),
    "split decode attention, bf16 cache, 8 query heads a K/V head, D 128": (
        decode_attention._split_kernel,
        _split_attention_signature("*bf16"),
        {"G": 8, "D": 128, "BLOCK_G": 16, "BLOCK_N": 64, "F32": False, "SCALED": False, "WHOLE": False,
         "HAS_SINKS": False}, {}),
    "split decode attention, one chunk a row written whole with gpt-oss's sinks, D 64": (
        decode_attention._split_kernel,
        _split_attention_signature("*bf16"),
        {"G": 8, "D": 64, "BLOCK_G": 16, "BLOCK_N": 64, "F32": False, "SCALED": False, "WHOLE": True,
         "HAS_SINKS": True}, {}),
    "split decode attention, FP8 cache with per-slot scales, D 128": (
        decode_attention._split_kernel,
        _split_attention_signature("*fp8e4nv"),
        {"G": 8, "D": 128, "BLOCK_G": 16, "BLOCK_N": 64, "F32": False, "SCALED": True, "WHOLE": False,
         "HAS_SINKS": False}, {}),
    "decode_qkv into an FP8 cache, Qwen3 (q/k norms), D 128": (
        decode_qkv._decode_qkv_kernel,
        DECODE_QKV_SIGNATURE,
        {"NORM": True, "BLOCK_D": 128, "BLOCK_HALF": 64, "FP8": True}, {}),
    "split decode attention, merge with gpt-oss's sinks": (
        decode_attention._merge_kernel,
        {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "sink_ptr": "*bf16", "out_ptr": "*bf16",
         "kv_heads": "i32", "splits": "i32", "s_ob": "i32", "s_oh": "i32", "s_og": "i32", "G": "constexpr",
         "D": "constexpr", "BLOCK_G": "constexpr", "HAS_SINKS": "constexpr"},
        {"G": 8, "D": 64, "BLOCK_G": 16, "HAS_SINKS": True}, {}),
    "SwiGLU on gate/up column halves (the stacked FP8 decode product)": (
        glu._glu_rows_fwd_kernel,
        {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "cols": "i32", "g_stride": "i32", "u_stride": "i32",
         "ACT": "constexpr", "BLOCK": "constexpr"},
        {"ACT": 0, "BLOCK": 1024}, {}),
    **{f"residual add + RMSNorm{', with its FP8 codes' if quantize else ''}, hidden 4096": (
        rms_norm._add_rms_fwd_kernel,
        {**dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "y_ptr", "s_ptr"), "*bf16"),
         "q_ptr": "*fp8e4nv" if quantize else "*bf16", "qs_ptr": "*fp32" if quantize else "*bf16",
         **dict.fromkeys(("n_cols", "stride_x", "stride_res", "stride_y", "stride_s", "stride_q"), "i32"),
         "eps": "fp32", "offset": "fp32", "BLOCK": "constexpr", "INT64": "constexpr", "QUANTIZE": "constexpr"},
        {"BLOCK": 4096, "INT64": False, "QUANTIZE": quantize}, {"num_warps": 8}) for quantize in (False, True)},
    **{f"LoRA decode product's x A^T parts, {adapter} adapters over bf16 (r 16, 8 rows)": (
        lora_decode._lora_down_kernel,
        {"x_ptr": "*bf16", "a_ptr": f"*{adapter}", "part_ptr": "*fp32",
         **dict.fromkeys(("M", "K", "R", "s_x", "s_a"), "i32"),
         **dict.fromkeys(("BLOCK_M", "BLOCK_K", "BLOCK_R", "F32"), "constexpr")},
        {"BLOCK_M": 16, "BLOCK_K": 128, "BLOCK_R": 16, "F32": adapter == "fp32"}, {"num_warps": 4})
       for adapter in ("fp32", "bf16")},
    **{f"LoRA decode product's h B^T added to y, {adapter} adapters over bf16 (r 16, 8 rows)": (
        lora_decode._lora_up_add_kernel,
        {"part_ptr": "*fp32", "b_ptr": f"*{adapter}", "y_ptr": "*bf16",
         **dict.fromkeys(("M", "N", "R", "k_blocks", "s_b", "s_y"), "i32"), "scaling": "fp32",
         **dict.fromkeys(("BLOCK_M", "BLOCK_R", "BLOCK_N", "F32"), "constexpr")},
        {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 128, "F32": adapter == "fp32"}, {"num_warps": 4})
       for adapter in ("fp32", "bf16")},
    **{f"RoPE of q and k, Qwen3-8B heads (32 q, 8 k, D 128), one token a program, {direction}": (
        rope._rope_qk_kernel, ROPE_SIGNATURE,
        {"BACKWARD": direction == "backward", "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": 64, "INT64": False,
         "TOKENS": 1}, {"num_warps": 8})
       for direction in ("forward", "backward")},
    "RMSNorm forward, Qwen3-8B hidden (4,096), one row a program": (
        rms_norm._rms_fwd_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*fp32",
         **dict.fromkeys(("n_rows", "n_cols", "stride_x", "stride_y"), "i32"), "eps": "fp32", "offset": "fp32",
         **dict.fromkeys(("BLOCK", "INT64", "ROWS"), "constexpr")},
        {"BLOCK": 4096, "INT64": False, "ROWS": 1}, {"num_warps": 8}),
    "RMSNorm backward, Qwen3-8B hidden (4,096), rows walked by each program": (
        rms_norm._rms_bwd_kernel,
        {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "r_ptr": "*fp32", "dx_ptr": "*bf16",
         "dw_part_ptr": "*fp32", **dict.fromkeys(("n_rows", "n_cols", "stride_dy", "stride_x", "stride_dx"), "i32"),
         "offset": "fp32", **dict.fromkeys(("BLOCK", "INT64", "ROWS"), "constexpr")},
        {"BLOCK": 4096, "INT64": False, "ROWS": 1}, {"num_warps": 8}),
}


def compile_for_sm90(case: str) -> str:
    kernel, signature, constexprs, options = CASES[case]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=HOPPER,
                              options=options)
    return compiled.asm["ptx"]


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one subprocess without ``TRITON_INTERPRET`` (set for this suite on a CPU machine:
    the kernels decorated under it are the interpreter's, which the compiler does not take): case -> the PTX's
    target line, or the error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case, compiled):
    assert compiled[case].startswith(".target sm_90"), compiled[case]  # sm_90a: Hopper with its wgmma


if __name__ == "__main__":
    results = {}
    for name in CASES:
        try:
            ptx = compile_for_sm90(name)
            results[name] = next((line.strip() for line in ptx.splitlines() if line.startswith(".target")), ptx[:200])
        except Exception as error:  # noqa: BLE001 - reported per case to the test
            results[name] = f"{type(error).__name__}: {str(error)[-1500:]}"
    print(json.dumps(results))
