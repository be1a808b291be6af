"""The benchmarks' shared parts: the memory, device-time and host-time profiles, and the results as
data (the rows' schema, every script writing rows, the committed rows reproducing the published ones
and docs/benchmarks.md's tables)."""

import json
import os
import re

import pytest
import torch

from tests.bench_helpers import ROOT, load_bench_module


def test_memory_profile_finds_the_blocks_alive_at_the_peak():
    """The two-pass replay against a brute-force one (copy of the live set after every event) on
    random alloc/free traces, including frees of blocks allocated before recording began."""
    mp = load_bench_module("memory_profile")
    gen = torch.Generator().manual_seed(0)
    sites = [[{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": f"/w/swiftune/layer{k}.py", "line": 10 + k, "name": f"f{k}"}] for k in range(5)]
    for trial in range(20):
        trace, live, next_addr = [], {}, 1000
        pre = {i: int(torch.randint(1, 50, (1,), generator=gen)) for i in range(3)}  # before recording
        for _ in range(200):
            if live and (torch.rand(1, generator=gen) < 0.45 or len(live) > 30):
                addr = list(live)[int(torch.randint(len(live), (1,), generator=gen))]
                trace.append({"action": "free_requested", "addr": addr, "size": live[addr]})
                trace.append({"action": "free_completed", "addr": addr, "size": live.pop(addr)})
            elif pre and torch.rand(1, generator=gen) < 0.05:
                addr, size = pre.popitem()
                trace.append({"action": "free_completed", "addr": addr, "size": size})
            else:
                size = int(torch.randint(1, 100, (1,), generator=gen))
                k = int(torch.randint(5, (1,), generator=gen))
                trace.append({"action": "alloc", "addr": next_addr, "size": size, "frames": sites[k]})
                live[next_addr] = size
                next_addr += 1
        # reference: level and live set after every event, the first maximum wins
        level, best, best_live, cur = 0, 0, {}, {}
        for ev in trace:
            if ev["action"] == "alloc":
                cur[ev["addr"]] = ev
                level += ev["size"]
            elif ev["action"] == "free_completed":
                level -= ev["size"]
                cur.pop(ev["addr"], None)
            if level > best:
                best, best_live = level, dict(cur)
        peak, alive = mp.blocks_at_peak(trace)
        assert peak == best and sorted(e["addr"] for e in alive) == sorted(best_live), trial
        report = mp.peak_breakdown(trace, bytes_before=10**9, top=2)
        by_site: dict = {}
        for ev in best_live.values():
            site = mp.allocation_site(ev["frames"])
            by_site[site] = by_site.get(site, 0) + ev["size"]
        want = sorted(by_site.values(), reverse=True)
        assert [round(s["gb"] * 1e9) for s in report["sites"][:2]] == want[:2]
        assert round(sum(s["gb"] for s in report["sites"]) * 1e9) == sum(want)
        assert report["step_peak_gb"] == (10**9 + best) / 1e9
    # the site is the innermost frame outside torch
    assert mp.allocation_site(sites[3]) == "f3 (layer3.py:13)"
    assert "at_oom" not in report  # nothing ran out


def test_memory_profile_says_what_was_alive_when_the_step_ran_out():
    """A trace with an ``oom`` event: the request, its site and the blocks alive at that event (not at
    the earlier peak), by site; events after it do not count."""
    mp = load_bench_module("memory_profile")
    f = [lambda k: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                    {"filename": f"/w/swiftune/layer{k}.py", "line": k, "name": f"f{k}"}]][0]
    trace = [{"action": "alloc", "addr": 1, "size": 50, "frames": f(1)},
             {"action": "alloc", "addr": 2, "size": 40, "frames": f(2)},  # the peak: 90
             {"action": "free_completed", "addr": 1, "size": 50},
             {"action": "alloc", "addr": 3, "size": 7, "frames": f(3)},
             {"action": "alloc", "addr": 4, "size": 5, "frames": f(3)},
             {"action": "oom", "addr": 0, "size": 60, "frames": f(4)},
             {"action": "alloc", "addr": 5, "size": 99, "frames": f(1)}]
    report = mp.peak_breakdown(trace, bytes_before=0, top=5)
    assert round(report["alive_at_peak_gb"] * 1e9) == 40 + 7 + 5 + 99  # the trace's peak comes after the oom
    oom = report["at_oom"]
    assert round(oom["request_gb"] * 1e9) == 60 and oom["site"] == "f4 (layer4.py:4)"
    assert round(oom["alive_gb"] * 1e9) == 52
    assert [(s["site"], round(s["gb"] * 1e9)) for s in oom["sites"]] == [("f2 (layer2.py:2)", 40),
                                                                        ("f3 (layer3.py:3)", 12)]
    assert "out of memory: 0.000 GB asked for at f4 (layer4.py:4)" in mp.format_breakdown(report)


def test_time_profile_sums_device_time_by_kind():
    """Per-kind sums and the top list against sums written out over random kernel times."""
    tp = load_bench_module("time_profile")
    gen = torch.Generator().manual_seed(1)
    names = {"attention": ["flash_fwd_kernel<...>", "triton_tem_fused_flex_attention_0", "fmha_cutlassF"],
             "matmul": ["nvjet_tst_128x256_64x4", "sm90_xmma_gemm_bf16bf16", "ampere_bf16_s16816gemm"],
             "copy host<->device": ["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"],
             "copy device": ["Memcpy DtoD (Device -> Device)", "Memset (Device)"],
             tp.TRITON: ["_rms_norm_fwd_kernel", "triton_poi_fused_mul_0"],
             tp.OTHER: ["void at::native::vectorized_elementwise_kernel<4>", "reduce_kernel<512>"]}
    events, want = [], {}
    for kind, ks in names.items():
        for n in ks:
            us = float(torch.randint(1, 10_000, (1,), generator=gen))
            events.append((n, us, int(torch.randint(1, 9, (1,), generator=gen))))
            want[kind] = want.get(kind, 0.0) + us
            assert tp.kind_of(n) == kind, n
    events.append(("cudaDeviceSynchronize", 0.0, 1))  # no device time: left out
    p = tp.summarise(events, top=4)
    total = sum(want.values())
    assert p["device_ms"] == pytest.approx(total / 1e3)
    assert {k["kind"]: k["ms"] for k in p["kinds"]} == pytest.approx({k: us / 1e3 for k, us in want.items()})
    assert [k["ms"] for k in p["kinds"]] == sorted((k["ms"] for k in p["kinds"]), reverse=True)
    assert sum(k["share"] for k in p["kinds"]) == pytest.approx(1.0)
    assert [t["ms"] for t in p["top"]] == sorted((us / 1e3 for _, us, _ in events), reverse=True)[:4]
    assert p["launches"] == sum(c for _, us, c in events if us > 0)
    assert "attention" in tp.format_profile(p, "x")
    # against a step's wall time: the share of it the device was busy
    p["step_wall_ms"] = 4 * p["device_ms"]
    assert "device busy 25%" in tp.format_profile(p, "x") and f"{p['launches']:,} kernels" in tp.format_profile(p)


def test_idle_gaps_of_a_trace_merge_streams_and_charge_gaps_to_the_wait_before_them():
    """``idle_gaps`` over a hand-written chrome trace: overlapping work on two streams is one busy
    stretch, holes shorter than ``min_us`` are not gaps, a gap opening as a synchronize (or a
    synchronous copy) returns is charged to it, an ``Async`` copy is not a wait; sums written out."""
    tp = load_bench_module("time_profile")

    def k(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        k("gemm_a", 0, 100), k("flash_b", 50, 100),            # two streams overlapping: busy 0-150
        k("memset", 160, 10, "gpu_memset"),                    # a 10 us hole: below min_us
        k("cudaStreamSynchronize", 100, 75, "cuda_runtime"),   # returns at 175, as the device drains
        k("rms_c", 400, 50),                                   # gap 170-400 (230 us), opened by the wait
        k("cudaMemcpyAsync", 440, 20, "cuda_runtime"),         # not a wait
        k("adam_d", 500, 30, "gpu_memcpy"),                    # gap 450-500 (50 us), no wait before it
        k("cudaMemcpy", 520, 20, "cuda_runtime"),              # a synchronous copy returning at 540
        k("embed_e", 1540, 60),                                # gap 530-1540 (1,010 us), opened by the copy
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 2000},  # not a complete event: ignored
    ]}
    g = tp.idle_gaps(trace, min_us=20, top=2)
    assert g["span_ms"] == pytest.approx(1.6) and g["gaps"] == 3
    assert g["busy_ms"] == pytest.approx((150 + 10 + 50 + 30 + 60) / 1e3)
    assert g["idle_ms"] == pytest.approx((230 + 50 + 1010) / 1e3)
    assert g["idle_after_sync_ms"] == pytest.approx((230 + 1010) / 1e3)
    assert [(t["ms"], t["after_sync"], t["before"], t["after"]) for t in g["top"]] == [
        (pytest.approx(1.01), True, "adam_d", "embed_e"), (pytest.approx(0.23), True, "memset", "rms_c")]
    assert tp.idle_gaps([], min_us=20)["gaps"] == 0  # a CPU-only trace: no device work
    p = tp.summarise([("gemm_a", 100.0, 1)])
    p["idle"] = g
    assert "device idle 1.3 ms of a 1.6 ms span in 3 gaps, 1.2 ms" in tp.format_profile(p)
    # an SFT record's profiled step: both idle sums become result rows
    from benchmarks import results

    ctx = results.Context(command="python -m benchmarks.sft --time-profile --out s.json", date="2026-12-04",
                          gpu="NVIDIA H200", versions={"torch": "2.11.0"})
    record = dict(mode="swiftune", model="qwen3-8b", batch=16, steps=3, tokens_per_s=1.0, peak_gb=1.0,
                  sec_per_step=1.0, padding_fraction=0.0, time_profile=p)
    rows = {r.metric: r.value for r in results.rows_from_sft([record], ctx)}
    assert rows["device_idle_ms"] == pytest.approx(1.29) and rows["device_idle_after_sync_ms"] == pytest.approx(1.24)


def test_host_profile_sums_own_time_by_library():
    """Per-group sums and the top list against sums written out over random own times; then the
    context manager over a real body: its own functions are found, with their call counts."""
    tp = load_bench_module("time_profile")
    gen = torch.Generator().manual_seed(2)
    files = {"swiftune": "/x/src/swiftune/models/forwards.py", "peft": "/v/site-packages/peft/tuners/lora/layer.py",
             "transformers": "/v/site-packages/transformers/models/qwen3/modeling_qwen3.py",
             "torch (Python)": "/v/site-packages/torch/utils/checkpoint.py", tp.BUILTIN: "~",
             "triton (launchers)": "/v/site-packages/triton/runtime/jit.py", tp.HOST_OTHER: "/usr/lib/python3.11/json/encoder.py"}
    entries, want = [], {}
    for i, (group, f) in enumerate(files.items()):
        for j in range(2):
            t = float(torch.rand(1, generator=gen))
            entries.append((f, 10 * i + j, f"fn{i}{j}", t, 3 + j))
            want[group] = want.get(group, 0.0) + t
        assert tp.host_group_of(f) == group, f
    p = tp.summarise_host(entries, top=3)
    assert p["host_ms"] == pytest.approx(1e3 * sum(want.values()))
    assert {g["group"]: g["ms"] for g in p["groups"]} == pytest.approx({g: 1e3 * t for g, t in want.items()})
    assert [t["ms"] for t in p["top"]] == sorted((1e3 * e[3] for e in entries), reverse=True)[:3]
    assert p["calls"] == sum(e[4] for e in entries) and sum(g["share"] for g in p["groups"]) == pytest.approx(1.0)

    def busy(n):
        return sum(i * i for i in range(n))

    r = {}
    with tp.host_time_profile(r):
        for _ in range(7):
            busy(20_000)
    hp = r["host_profile"]
    mine = [t for t in hp["top"] if t["function"].startswith("busy ")]
    assert mine and mine[0]["calls"] == 7 and 0 < hp["host_ms"] <= hp["wall_ms"] * 1.05
    assert "top functions" in tp.format_host_profile(hp, "x")


def test_step_context_callback_wraps_exactly_the_chosen_step():
    """The profilers' Trainer callback: the context is entered as step ``k`` begins and left as it
    ends (global_step counts finished steps, so step k begins at k - 1), once."""
    import contextlib
    from types import SimpleNamespace

    workload = load_bench_module("workload")
    events = []

    @contextlib.contextmanager
    def probe():
        events.append("enter")
        yield
        events.append("exit")

    cb = workload.step_context_callback(3, probe)
    for finished in range(6):  # the Trainer's order: begin at global_step = k - 1, end at k
        cb.on_step_begin(None, SimpleNamespace(global_step=finished), None)
        events.append(f"step {finished + 1}")
        cb.on_step_end(None, SimpleNamespace(global_step=finished + 1), None)
    assert events == ["step 1", "step 2", "enter", "step 3", "exit", "step 4", "step 5", "step 6"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_time_profile_puts_a_large_matmul_first():
    tp = load_bench_module("time_profile")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    r: dict = {}
    with tp.device_time_profile(r):
        for _ in range(5):
            a @ a
        a.float().sum()
    assert r["profile"]["kinds"][0]["kind"] == "matmul" and r["profile"]["kinds"][0]["share"] > 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timed_profile_finds_the_gap_a_host_wait_opens():
    """A step with a ``.item()`` followed by 20 ms of host work: the trace's runtime events name the wait,
    and the longest gap (about 20 ms, between the two matmuls' kernels) is charged to it."""
    import time

    tp = load_bench_module("time_profile")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    r: dict = {}
    with tp.timed_device_profile(r):
        (a @ a).float().sum().item()
        time.sleep(0.02)  # the host's own work, the device idle
        a @ a
    idle = r["profile"]["idle"]
    assert idle["gaps"] >= 1 and idle["top"][0]["after_sync"] and 15 < idle["top"][0]["ms"] < 200, idle
    assert idle["idle_after_sync_ms"] >= idle["top"][0]["ms"] and r["profile"]["step_wall_ms"] > 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_profile_names_the_line_that_held_the_peak():
    mp = load_bench_module("memory_profile")
    keep = torch.empty(2**20, device="cuda")  # allocated before: not part of the step
    r: dict = {}
    with mp.peak_profile(r):
        big = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
        del big
        small.zero_()
    top = r["peak_profile"]["sites"][0]
    assert "test_benchmark_scripts.py" in top["site"] and top["gb"] == pytest.approx(64 * 2**20 / 1e9, rel=0.01)
    assert r["peak_profile"]["before_step_gb"] >= keep.numel() * 4 / 1e9


# ------------------------------------------------------------------------------ results as data


def _row(**kw):
    from benchmarks.results import Row

    base = dict(tool="swiftune", mode="swiftune", model="qwen3-8b", settings={"batch": 16}, metric="tokens_per_s",
                value=1.0, unit="tok/s", gpu="NVIDIA H200", versions={"torch": "2.11.0"}, date="2026-12-01",
                command="python -m benchmarks.sft --out x.json")
    return Row(**{**base, **kw})


@pytest.mark.parametrize("bad", [dict(unit="GB"), dict(value=float("nan")), dict(value="7"), dict(tool="mine"),
                                 dict(versions={"transformers": "5"}), dict(versions={"torch": "2", "jax": "0"}),
                                 dict(date="01/12/2026"), dict(command="python3 benchmarks/sft.py"),
                                 dict(command="X=1 python3 benchmarks/sft.py"), dict(command="run python -m benchmarks.sft"),
                                 dict(metric="speed", unit="tok/s"), dict(settings=[16]), dict(model="")],
                         ids=lambda d: next(iter(d)))
def test_results_schema_refuses_a_row_that_breaks_it(tmp_path, bad):
    from benchmarks.results import read_rows, validate, write_rows

    validate(_row())
    validate(_row(command="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.vl grpo --out x.json"))
    with pytest.raises(ValueError):
        validate(_row(**bad))
    with pytest.raises(ValueError):
        write_rows(str(tmp_path / "bad.jsonl"), [_row(), _row(**bad)])
    good = tmp_path / "good.jsonl"
    write_rows(str(good), [_row(), _row(metric="peak_gb", unit="GB", value=19.4)])
    assert read_rows(str(good)) == [_row(), _row(metric="peak_gb", unit="GB", value=19.4)]
    good.write_text(good.read_text().replace('"unit": "GB"', '"unit": "GB", "extra": 1'))
    with pytest.raises(ValueError, match="fields"):
        read_rows(str(good))


def test_cuda_only_scripts_json_converts_to_valid_rows():
    """kernels, attention_backends, losses and tune_kernels need CUDA: their converters run on the
    committed JSON (or one written out here) instead, through the same path the scripts take."""
    from benchmarks import results

    ctx = results.Context(command="python -m benchmarks.kernels --out k.json", date="2026-12-01", gpu="NVIDIA H200",
                          versions={"torch": "2.11.0", "trl": "1.16.0"})
    for name in ("kernels_h200.json", "attention_backends_h200.json"):
        with open(os.path.join(ROOT, "docs", "results", name)) as f:
            rows = results.rows_from(json.load(f), ctx)
        assert rows and all(results.validate(r) is None for r in rows)
        assert all("trl" not in r.versions for r in rows)  # only where the tool used it
    losses = {"benchmark": "losses", "rows": [
        {"tokens": 8192, "loss": "ce", "method": "plain", "status": "ok", "ms": 42.5, "peak_bytes": 13.9e9},
        {"tokens": 131072, "loss": "ce", "method": "plain", "status": "oom"},
        {"tokens": 8192, "loss": "ce", "method": "swiftune", "status": "ok", "ms": 31.2, "peak_bytes": 1.35e9}]}
    rows = results.rows_from(losses, ctx)
    assert {(r.tool, r.metric, r.value) for r in rows} >= {("transformers+peft", "fits", 0), ("swiftune", "ms", 31.2)}
    tune = {"benchmark": "tune_kernels", "rows": [{"kernel": "glu_fwd", "settings": {"block": 1024}, "tb_per_s": 4.3}]}
    assert [r.value for r in results.rows_from(tune, ctx)] == [4.3]
    with pytest.raises(ValueError):
        results.rows_from({"something": "else"}, ctx)


def test_every_script_with_figures_writes_rows():
    """Each script that measures figures hands them to benchmarks.results (the smoke runs above
    check the rows of the ones that run on CPU)."""
    bench = os.path.join(ROOT, "benchmarks")
    for name in ("sft", "grpo", "longctx", "rollout", "kernels", "losses", "attention_backends", "loss_curve",
                 "tune_kernels", "merge_bisect", "grpo_e2e"):
        with open(os.path.join(bench, f"{name}.py")) as f:
            text = f.read()
        assert f'save("{name}", argv' in text, name
        assert "sys.path" not in text and "issue" not in text.lower(), name


def test_published_rows_are_the_committed_raw_results():
    """docs/results/results.jsonl is what the importer makes of the raw JSON today: neither can
    change without the other (after a change: python -m benchmarks.results import)."""
    from benchmarks.results import import_published, read_rows

    committed = read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl"))
    assert import_published(ROOT) == committed
    for r in committed:  # (an environment the run was given comes first: VAR=value python -m benchmarks....)
        assert re.fullmatch(r"(?:[A-Z][A-Z0-9_]*=\S+ )*python -m benchmarks\.\S+ .*", r.command), r.command
    # every Qwen3 figure measured without the q/k fix has been measured again (the last, the single 409,600-token
    # sequence, on 2026-12-02): no published row is marked
    assert not [r.settings["figure"] for r in committed if r.settings.get("before_qk_fix")]
    single = [r for r in committed if r.settings["figure"] == "longctx_sweep_qwen3-8b" and r.tool == "swiftune"
              and r.settings.get("run") == "one sequence"]
    assert single and {r.date for r in single} == {"2026-12-02"}
    new = [r for r in committed if r.settings["figure"] == "longctx_largest" and r.model == "qwen3-8b"
           and r.tool == "swiftune" and r.metric == "max_fit_tokens"]
    assert [(r.value, r.date) for r in new] == [(893952, "2026-12-01")]


def test_busy_share_of_the_unprofiled_steps_is_device_time_per_token_times_their_throughput():
    """``report.sft_busy``: with the profiled step's token slots, its device ms per token times the unprofiled
    run's steady tok/s (240 ms for 3,000 tokens at 10,000 tok/s: the device busy 80% of those steps); left blank
    for a padded batch (slots are not tokens there), for rows without slots, and when the profiled step captured
    graphs (its device time includes the eager run that capture makes)."""
    from benchmarks import report

    def fig(padding: float, slots: bool, captures: int = 0):
        def r(metric, value, unit, **settings):
            return _row(mode="swiftune_graphs", metric=metric, value=value, unit=unit,
                        settings={"batch": 16, "figure": "f", **settings})
        rows = [r("steady_tokens_per_s", 10_000.0, "tok/s"), r("tokens_per_s", 8_000.0, "tok/s"),
                r("padding_fraction", padding, "fraction"),
                r("device_ms", 240.0, "ms", profiled=True), r("profiled_step_wall_ms", 300.0, "ms", profiled=True)]
        if slots:
            rows += [r("profiled_step_token_slots", 3_000, "tokens", profiled=True),
                     r("profiled_step_captures", captures, "steps", profiled=True)]
        return report.Figure(rows)

    assert "| every step (host waits) | 10,000 | 8,000 | 240.0 | 300.0 | 80% | 80% |" in report.sft_busy(fig(0.0, True))
    assert "| 240.0 | 300.0 | 80% |  |" in report.sft_busy(fig(0.0, False))
    assert "| 240.0 | 300.0 | 80% |  |" in report.sft_busy(fig(0.1, True))
    assert "| 240.0 | 300.0 | 80% |  |" in report.sft_busy(fig(0.0, True, captures=3))


def test_profiled_sft_step_counts_the_token_slots_it_embeds(monkeypatch):
    """``benchmarks.sft._profiled_step`` counts the input ids the embedding sees inside the profiled step (from
    shapes: no device sync), and only there: its hook is gone afterwards."""
    import contextlib

    tp = load_bench_module("time_profile")
    sft = load_bench_module("sft")

    @contextlib.contextmanager
    def fake_profile(record):  # the CUDA profiler's place: the record it leaves
        yield
        record["profile"] = {"device_ms": 1.0}

    monkeypatch.setattr(tp, "timed_device_profile", fake_profile)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4))
    model.get_input_embeddings = lambda: model[0]
    captured = [5]
    record: dict = {"captures": lambda: captured[0]}  # graphed layers' running count of captures
    with sft._profiled_step(record, model):
        model(torch.zeros(1, 7, dtype=torch.long))
        model(torch.zeros(2, 3, dtype=torch.long))
        captured[0] += 2
    model(torch.zeros(1, 5, dtype=torch.long))  # after the step: not counted
    assert record["profile"] == {"device_ms": 1.0, "step_token_slots": 13, "step_captures": 2}
    assert not model[0]._forward_pre_hooks


def test_docs_tables_are_generated_from_the_committed_rows():
    """docs/benchmarks.md's tables are what benchmarks.report renders from the committed rows."""
    from benchmarks import report
    from benchmarks.results import read_rows

    page_path = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(page_path) as f:
        page = f.read()
    tables = report.render_tables(read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl")))
    assert report.rewrite(page, tables) == page, "run python -m benchmarks.report"
    assert {m.group("name") for m in report.BLOCK.finditer(page)} == set(tables)
    assert "| **swiftune** | 16 | 7,672 | 3.20 | 2.43 | 3.03 | 19.4 |" in tables["sft_qwen3-8b_b16"]
    # the busy share is the profiled step's device time over its own wall time (the profile and the timed run of
    # each mode are separate processes: their rows must not mix)
    assert "| every step (host waits) | 9,753 | 7,694 | 235.7 | 315.8 | 75% |  | 23.8 | 4.8 |" in \
        tables["sft_deferred_check_qwen3-8b"]
    assert "| deferred (on the device) | 9,874 | 7,398 | 237.2 | 283.4 | 84% |  | 5.2 | 1.1 |" in \
        tables["sft_deferred_check_qwen3-8b"]
    # both tools' QLoRA GRPO brackets on one 80 GB budget, each joined from several runs (benchmarks.merge_bisect)
    # (both brackets closed: swiftune's multiple is fit over fit)
    qlora = tables["qlora_grpo_80gb_qwen3-8b"]
    assert "| Qwen3-8B | Unsloth | each row after its own prompt | 90,112 | 94,208 | 4.5% |" in qlora
    assert "| Qwen3-8B | **swiftune** | one prompt shared by the rows | 337,920 | 354,816 | 5.0% |" in qlora
    assert qlora.split("\n")[3].endswith("| 3.75 |") and "x Unsloth |" in qlora.split("\n")[0]
    assert "on NVIDIA H100 80GB HBM3 and, for swiftune's first failure, NVIDIA H200 (" in qlora
    # a changed row changes the page
    rows = read_rows(os.path.join(ROOT, "docs", "results", "results.jsonl"))
    rows[0].value *= 2
    assert report.rewrite(page, report.render_tables(rows)) != page
    for stale in ("session", "/tmp/site", "python3 benchmarks/", "issue "):
        assert stale not in page.lower(), stale
    for png in set(re.findall(r"\(plots/([^)]+\.png)\)", page)):
        assert os.path.exists(os.path.join(ROOT, "docs", "plots", png)), png


def test_emulated_gpu_budget_passes_the_device_index(monkeypatch):
    """torch 2.11 refuses ``set_per_process_memory_fraction(f, torch.device("cuda"))`` (no index): the
    benchmarks' budget goes through one helper that passes the current device's index, capped at 1."""
    workload = load_bench_module("workload")
    calls = []

    class Props:
        total_memory = 150e9

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert workload.emulate_gpu_budget(24) == pytest.approx(0.16)
    assert workload.emulate_gpu_budget(400) == 1.0
    assert [d for _, d in calls] == [3, 3] and all(isinstance(d, int) for _, d in calls)


def test_fp8_layer_summary_with_q_k_v_and_gate_up_stacked():
    """``benchmarks.kernels.layer_summary``: a decoder layer's seven products as the model has them (q and o, k and v,
    gate and up twice each, down once), and with q/k/v and gate/up each one stacked product; each product takes its
    fastest FP8 path. Written-out sums on hand-made rows; an M without the stacked shapes has no stacked row."""
    import benchmarks.kernels as kb

    def row(name, m, bf16, weight_only, dot):
        return dict(shape=f"{name} N1 K1 M{m}", m=m, bf16_ms=bf16, ours_ms=weight_only, best_ms=weight_only,
                    dot_ms=dot, dot_best_ms=dot, scaled_mm_ms=float("nan"))

    rows = [row("q/o_proj", 64, 1.0, 0.9, 0.8), row("k/v_proj", 64, 0.5, 0.6, 0.45),
            row("gate/up_proj", 64, 2.0, 1.9, 1.5), row("down_proj", 64, 2.0, 1.8, 1.6),
            row("qkv_stacked", 64, 1.8, 1.7, 1.0), row("gate_up_stacked", 64, 3.9, 3.5, 2.6),
            row("q/o_proj", 8, 1.0, 0.5, 0.8), row("k/v_proj", 8, 0.5, 0.3, 0.45),
            row("gate/up_proj", 8, 2.0, 1.2, 1.5), row("down_proj", 8, 2.0, 1.3, 1.6)]
    plain = {r["m"]: r for r in kb.layer_summary(rows)}
    assert plain[64]["bf16_layer_ms"] == pytest.approx(2 * 1.0 + 2 * 0.5 + 2 * 2.0 + 2.0)
    assert plain[64]["fp8_layer_ms"] == pytest.approx(2 * 0.8 + 2 * 0.45 + 2 * 1.5 + 1.6)
    assert plain[8]["fp8_layer_ms"] == pytest.approx(2 * 0.5 + 2 * 0.3 + 2 * 1.2 + 1.3)
    stacked = kb.layer_summary(rows, stacked=True)
    assert [r["m"] for r in stacked] == [64] and stacked[0]["stacked"]
    assert stacked[0]["bf16_layer_ms"] == pytest.approx(1.8 + 1.0 + 3.9 + 2.0)
    assert stacked[0]["fp8_layer_ms"] == pytest.approx(1.0 + 0.8 + 2.6 + 1.6)
    assert "qkv_stacked:dot" in stacked[0]["paths"] and "k/v_proj" not in stacked[0]["paths"]


def test_sft_beside_trl_divides_by_each_shapes_own_baselines():
    """``report.sft_beside_trl``: each shape's rows over that shape's TRL and TRL + Liger tok/s, never another
    shape's; the Liger column blank where Liger has no row for the shape (it failed there)."""
    from benchmarks import report, results

    records = [dict(mode="trl_padding_free", model="a", tokens_per_s=1000.0),
               dict(mode="trl_liger", model="a", tokens_per_s=1250.0),
               dict(mode="swiftune", model="a", tokens_per_s=5000.0),
               dict(mode="trl_padding_free", model="b", tokens_per_s=2000.0),
               dict(mode="trl_liger", model="b", error="AttributeError: no hidden_dim"),
               dict(mode="swiftune", model="b", tokens_per_s=3000.0),
               # the same shape with adapters on its experts too: over its own baselines, not the shape's others
               dict(mode="trl_padding_free", model="a", tokens_per_s=500.0, lora_target_parameters=["x.e1", "x.e2"]),
               dict(mode="swiftune", model="a", tokens_per_s=1500.0, lora_target_parameters=["x.e1", "x.e2"])]
    for r in records:
        r.update(batch=16, peak_gb=50.0, sec_per_step=1.0, padding_fraction=0.0) if "error" not in r else None
    ctx = results.Context(command="c", date="d", gpu="g", versions={}, settings={"figure": "f"})
    text = report.sft_beside_trl(report.Figure(results.rows_from_sft(records, ctx)))
    lines = text.split("\n")[2:]
    assert len(lines) == 7
    assert "| a | **swiftune** | 16 | 5,000 | 5.00 | 4.00 |" in text
    assert "| a, LoRA also on x.e1, x.e2 | **swiftune** | 16 | 1,500 | 3.00 |  |" in text
    assert "| b | **swiftune** | 16 | 3,000 | 1.50 |  |" in text
    assert "| b | TRL, padding_free | 16 | 2,000 | 1.00 |  |" in text
    # a later call of shape a (setting "call"): its own rows, over its own call's TRL, never the first call's
    later = results.Context(command="c", date="d2", gpu="g", versions={}, settings={"figure": "f", "call": "later"})
    again = [dict(mode="trl_padding_free", model="a", tokens_per_s=800.0), dict(mode="swiftune", model="a",
                                                                                 tokens_per_s=2000.0)]
    for r in again:
        r.update(batch=16, peak_gb=50.0, sec_per_step=1.0, padding_fraction=0.0)
    both = report.sft_beside_trl(report.Figure(results.rows_from_sft(records, ctx) + results.rows_from_sft(again, later)))
    assert "| a (later) | **swiftune** | 16 | 2,000 | 2.50 |  |" in both
    assert "| a | **swiftune** | 16 | 5,000 | 5.00 | 4.00 |" in both


def test_sft_graphs_host_unsloth_compares_with_unsloths_longest_run():
    """``report.sft_graphs_host_unsloth``: each swiftune row's speed and peak over its own call's Unsloth padding-free
    row, and its steady and timed speed and peak over the Unsloth padding-free row of the most steps run (not the
    first Unsloth row, nor the packed one); Unsloth's rows carry no ratio."""
    from benchmarks import report, results

    def rows(call, run_steps, records):
        ctx = results.Context(command="c", date="d", gpu="g", versions={},
                              settings={"figure": "f", "call": call, "run_steps": run_steps})
        for r in records:
            r.update(model="m", batch=16, sec_per_step=1.0, padding_fraction=0.0)
        return results.rows_from_sft(records, ctx)

    fig = report.Figure(
        rows("A", 12, [dict(mode="unsloth", steps=8, tokens_per_s=4000.0, peak_gb=18.0),
                       dict(mode="unsloth_packed", steps=8, tokens_per_s=6000.0, peak_gb=21.0)])
        + rows("A", 70, [dict(mode="swiftune_host_graphs", steps=40, tokens_per_s=7500.0, peak_gb=18.3,
                              steady_tokens_per_s=9500.0, steps_capturing=9)])
        + rows("C", 66, [dict(mode="unsloth", steps=62, tokens_per_s=5000.0, peak_gb=18.6)]))
    text = report.sft_graphs_host_unsloth(fig)
    assert "x Unsloth's 66 steps, steady" in text
    # same call (A's Unsloth: 9,500 / 4,000, 18.3 / 18.0), then Unsloth's longest run (C)
    assert "| A | swiftune, graphed layers, inputs on the host | 70 | 40 (9 capturing) | 7,500 | 9,500 | 18.30 " \
           "| 2.38 | 1.02 | 1.90 | 1.50 | 0.98 |" in text
    assert "| A | Unsloth | 12 | 8 | 4,000 |  | 18.00 |  |  |  |  |  |" in text

def test_grpo_65k_beside_unsloth_divides_by_unsloths_step_and_marks_a_failed_trial():
    """``report.grpo_65k_beside_unsloth``: Unsloth's row first and without ratios; each swiftune row's speed is
    Unsloth's step time over its own and its GPU memory its peak over Unsloth's, labelled by where its kept
    attention outputs live; a trial that ran out of memory says so and carries no figures."""
    from benchmarks import report, results

    def data(mode, trial, **settings):
        return {"benchmark": "grpo_bisect", "model": "qwen3-8b", "rows": 2, "prompt_tokens": 256, **settings,
                "modes": {mode: {"mode": mode, "max_fit": None, "first_fail": None, "status": "fixed_only",
                                 "trials": [{"completion": 65536, "tokens": 131584, **trial}]}}}

    ctx = results.Context(command="c", date="d", gpu="g", versions={}, settings={"figure": "f"})
    swift = dict(share_prompt=True, swiftune_checkpointing="offload_all", attention_output_layers=36)
    rows = (results.rows_from(data("swiftune", dict(status="oom"), **swift), ctx)
            + results.rows_from(data("swiftune", dict(status="ok", s=30.0, first_s=60.0, peak_gb=30.0,
                                                     host_rss_gb=90.0), attention_outputs_on_host=True, **swift), ctx)
            + results.rows_from(data("unsloth", dict(status="ok", s=33.0, first_s=70.0, peak_gb=72.0)), ctx))
    lines = report.grpo_65k_beside_unsloth(report.Figure(rows)).splitlines()
    assert lines[2] == "| Unsloth GRPOTrainer policy step (its patched TRL) | 33.00 | 70.00 | 72.0 |  |  |  |"
    assert lines[3] == ("| **swiftune**, 36 layers' attention outputs kept in pinned host memory | 30.00 | 60.00 | 30.0 "
                        "| 90.0 | 1.10 | 0.42 |")
    assert lines[4] == "| **swiftune**, 36 layers' attention outputs kept on the GPU | out of memory |  |  |  |  |  |"


def test_largest_beside_multiple_is_an_upper_bound_when_the_baseline_never_failed():
    """``report.grpo_largest_beside``: with both brackets closed, swiftune's fit over the baseline's fit; with the
    baseline's open (every length it tried fitted), only the bound its first failure gives ("< F/B"), and
    nothing when swiftune has no failure either; the baseline's row says none of its lengths failed."""
    from benchmarks import report, results

    def table(base_first, ours_first):
        def mode(fit, first, tool):
            trials = [{"completion": fit, "tokens": 2 * fit, "status": "ok", "s": 10.0, "peak_gb": 70.0}]
            if first:
                trials.append({"completion": first, "tokens": 2 * first, "status": "oom"})
            return {"mode": tool, "max_fit": fit, "first_fail": first, "trials": trials}
        data = {"benchmark": "grpo_bisect", "model": "qwen3-8b", "rows": 2, "prompt_tokens": 256,
                "modes": {"unsloth": mode(100, base_first, "unsloth"), "swiftune": mode(300, ours_first, "swiftune")}}
        ctx = results.Context(command="c", date="d", gpu="g", versions={}, settings={"figure": "f"})
        return report.grpo_largest_beside(report.Figure(results.rows_from_grpo_bisect(data, ctx)))

    closed = table(105, 315)
    assert "| 100 | 105 | 5.0% |" in closed and closed.split("\n")[3].endswith("| 3.00 |")
    open_base = table(None, 315)
    assert "| 100 | none tried failed |  |" in open_base and open_base.split("\n")[3].endswith("| < 3.15 |")
    both_open = table(None, None)
    assert both_open.split("\n")[3].endswith("|  |") and "| 1.00 |" in both_open.split("\n")[2]
