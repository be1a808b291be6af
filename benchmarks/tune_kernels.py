"""Launch-parameter sweep for the kernels (development aid; the chosen values live in the kernels).

    python -m benchmarks.tune_kernels [--rows tune_kernels.rows.jsonl]
"""

import argparse
import importlib

import torch
import triton

from benchmarks import results

glu = importlib.import_module("swiftune.kernels.glu")
rms = importlib.import_module("swiftune.kernels.rms_norm")
rope = importlib.import_module("swiftune.kernels.rope")


def ms(fn):
    """Seconds per call (do_bench reports milliseconds)."""
    return triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3 / 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help="write each launch setting's TB/s as result rows here")
    args = p.parse_args(argv)
    swept = []

    def record(kernel, tb_s, **settings):
        swept.append({"kernel": kernel, "settings": settings, "tb_per_s": tb_s})

    dt = torch.bfloat16
    n = 65536 * 12288
    g, u, d = (torch.randn(n, device="cuda", dtype=dt) for _ in range(3))
    o1, o2 = torch.empty_like(g), torch.empty_like(g)
    copy = ms(lambda: o1.copy_(g))
    print(f"copy {2 * n * 2 / copy / 1e12:.2f} TB/s")
    for block in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            grid = (triton.cdiv(n, block),)
            f = ms(lambda: glu._glu_fwd_kernel[grid](g, u, o1, n, ACT=0, BLOCK=block, INT64=False, num_warps=warps))
            b = ms(lambda: glu._glu_bwd_kernel[grid](d, g, u, o1, o2, n, ACT=0, BLOCK=block, INT64=False,
                                                     num_warps=warps))
            print(f"glu block {block:5d} warps {warps:2d}: fwd {3 * n * 2 / f / 1e12:5.2f} TB/s  "
                  f"bwd {5 * n * 2 / b / 1e12:5.2f} TB/s")
            record("glu_fwd", 3 * n * 2 / f / 1e12, block=block, warps=warps)
            record("glu_bwd", 5 * n * 2 / b / 1e12, block=block, warps=warps)
    del g, u, d, o1, o2
    T, H = 262144, 4096
    x, dy = torch.randn(T, H, device="cuda", dtype=dt), torch.randn(T, H, device="cuda", dtype=dt)
    w = torch.randn(H, device="cuda", dtype=dt)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    r = torch.empty(T, device="cuda", dtype=torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for warps in (4, 8, 16):
        f = ms(lambda: rms._rms_fwd_kernel[(T,)](x, w, y, r, H, H, H, 1e-6, 0.0, BLOCK=4096, INT64=False,
                                                  num_warps=warps))
        print(f"rms fwd warps {warps:2d}: {2 * T * H * 2 / f / 1e12:5.2f} TB/s")
        record("rms_fwd", 2 * T * H * 2 / f / 1e12, warps=warps)
    for mult in (1, 2, 4, 8, 16):
        for warps in (4, 8, 16):
            p = sms * mult
            part = torch.empty(p, H, device="cuda", dtype=torch.float32)
            b = ms(lambda: rms._rms_bwd_kernel[(p,)](dy, x, w, r, dx, part, T, H, H, H, H, 0.0, BLOCK=4096,
                                                     INT64=False, num_warps=warps))
            print(f"rms bwd programs {mult:2d}xSM warps {warps:2d}: {3 * T * H * 2 / b / 1e12:5.2f} TB/s")
            record("rms_bwd", 3 * T * H * 2 / b / 1e12, programs_per_sm=mult, warps=warps)
    del x, dy, y, dx
    S = 131072
    q = torch.randn(1, S, 32, 128, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(1, S, 8, 128, device="cuda", dtype=dt).transpose(1, 2)
    c = torch.randn(1, S, 128, device="cuda", dtype=dt)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    byt = 2 * (q.numel() + k.numel()) * 2
    f = ms(lambda: rope._launch(q, k, qo, ko, c, c, backward=False))
    print(f"rope fwd: {byt / f / 1e12:5.2f} TB/s ({f * 1e3:.3f} ms)")
    record("rope_fwd", byt / f / 1e12)
    if args.rows:
        results.save("tune_kernels", argv, {"benchmark": "tune_kernels", "rows": swept}, None, args.rows)


if __name__ == "__main__":
    main()
