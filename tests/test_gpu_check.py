"""`make gpu-check`'s engine part, dry: the checks and the speed table a GPU run makes, run on the CPU through the
engine's CUDA path (tests/fake_cuda.py, Triton on the interpreter, tiny shapes), so that a device session, which
has minutes, does not start by finding a typo."""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from benchmarks import gpu_check  # noqa: E402


def test_the_dry_run_passes_every_engine_check_and_fills_the_speed_table(tmp_path, capsys, monkeypatch):
    """On the unfused layers: the fused ones are the interpreter's slowest path, and tests/test_fused_layers.py,
    test_cuda_graphs.py and test_device_path.py run the engine through them (graphs, sleep, updates, scoring)."""
    monkeypatch.setenv("FP8ENGINE_CUDA_FUSION", "0")
    path = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--json", str(path)]) == 0, capsys.readouterr().out
    report = json.loads(path.read_text())["engine"]
    assert [c["check"] for c in report["engine_checks"]] == [
        "logprobs_vs_cpu_float32", "seeded_sampling_repeats", "update_weights_in_place", "batch_invariance_bf16",
        "batch_invariance_fp8", "lora_adapter", "cuda_graph_replay", "sleep_wake", "server_openai_client"]
    assert all(c["ok"] for c in report["engine_checks"]) and report["failures"] == []
    invariance = [c for c in report["engine_checks"] if c["check"].startswith("batch_invariance")]
    assert [c["scoring_equals_rollout"] for c in invariance] == [True, True]
    assert [(r["mode"], r["batch"]) for r in report["speed"]] == [
        ("bf16", 1), ("fp8", 1), ("bf16", 1), ("fp8", 1), ("bf16-bi", 1), ("fp8-bi", 1), ("fp8-head", 1)]
    assert [r["graphs"] for r in report["speed"][2:4]] == ["off: enforce_eager=True"] * 2
    graphs = next(c for c in report["engine_checks"] if c["check"] == "cuda_graph_replay")
    assert graphs["graphs"] == "decode" and graphs["replays"] >= 6, graphs  # buckets 4, 2 and 1
    assert graphs["sampler_replays"] == graphs["replays"], graphs  # every row greedy or tempered: the fused sampler
    assert all(r["ms_per_step"] > 0 and r["hbm_floor_ms"] > 0 for r in report["speed"])
    sleep = next(c for c in report["engine_checks"] if c["check"] == "sleep_wake")
    assert sleep["outputs_equal"] and sleep["graph_recaptures"] == 3 and len(sleep["cycles"]) == 3, sleep
    assert "9/9 engine checks ok" in capsys.readouterr().out


def test_a_check_that_raises_fails_alone_and_only_selects(capsys):
    """A device run is short and rare: a check that raises is a failed row with its error, the others still run,
    and --engine-only reruns the named ones."""
    from benchmarks import gpu_engine

    def broken():
        raise RuntimeError("expected self and mask to be on the same device")
    try:
        row = gpu_engine._guarded("logprobs_vs_cpu_float32", broken)
        assert row["check"] == "logprobs_vs_cpu_float32" and row["ok"] is False
        assert row["error"] == "RuntimeError: expected self and mask to be on the same device"
        assert "Traceback" in capsys.readouterr().err
        gpu_engine._ONLY[:] = ["speed_fp8"]
        assert gpu_engine._guarded("cuda_graph_replay", broken) == {"check": "cuda_graph_replay", "ok": True,
                                                                     "skipped": True}
        assert gpu_engine._guarded("speed_fp8_batch1", lambda: {"batch": 1})["batch"] == 1
    finally:
        gpu_engine._ONLY[:] = []


def test_gpu_perf_writes_a_json_per_section_and_skips_what_the_budget_leaves_out(tmp_path, capsys):
    """benchmarks/gpu_perf.py (issue 64's prepared device run), dry: its kernel sections on the stand-in device with
    tiny shapes, each to its own JSON as it finishes; a section that does not fit the budget is skipped, saying so.
    (Its checks and engine sections are gpu_engine's, dry-run above; they take minutes on the interpreter.)"""
    from benchmarks import gpu_perf
    out = tmp_path / "perf"
    assert gpu_perf.main(["--dry-run", "--out", str(out), "--sections", "bandwidth,gemm,attention,peers"]) == 0
    gemm = json.loads((out / "gemm.json").read_text())
    assert [(r["layer"], r["m"]) for r in gemm["rows"]] == [("tiny", 1), ("tiny", 4), ("tiny", 80)]
    assert all(r["fp8_us"] > 0 and r["bf16_matmul_us"] > 0 and r["config"] for r in gemm["rows"])
    # the TMA tiles past 64 rows, bit for bit the pointer loads
    tma = [(r["fp8_tma_us"] is not None, r["tma_bitwise"]) for r in gemm["rows"]]
    assert tma == [(False, None), (False, None), (True, True)] and gemm["tma_edges_bitwise"] is True
    # the swapped operands up to 16 rows, their result the default launch's
    swap = [(r["fp8_swap_us"] is not None, r["swap_close"]) for r in gemm["rows"]]
    assert swap == [(True, True), (True, True), (False, None)]
    attention = json.loads((out / "attention.json").read_text())
    assert {(r["context"], r["batch"], r["cache"]) for r in attention["rows"]} == {
        (c, b, k) for c in (32, 64) for b in (1, 2) for k in ("bfloat16", "float8_e4m3fn")}
    assert json.loads((out / "bandwidth.json").read_text())["read_gb_s"] > 0
    assert "not carried" in json.loads((out / "peers.json").read_text())["peers"]["vllm_triton_w8a8_block_fp8"]
    assert gpu_perf.main(["--dry-run", "--out", str(out), "--sections", "engine", "--budget-s", "10"]) == 0
    assert json.loads((out / "engine.json").read_text())["skipped"].startswith("budget: 0 s spent, ~175 s needed")
    assert "engine skipped" in capsys.readouterr().out
