"""The throughput benchmark's rounds: alternating mode order, median run per mode."""

from fp8engine.benchmarks import throughput


def test_rounds_alternate_order_and_report_the_median(monkeypatch):
    calls = []
    speeds = {"bf16": iter([100.0, 300.0, 200.0]), "fp8-kv": iter([150.0, 120.0, 400.0])}

    def fake_run_engine(mode, spec, model, dtype, device, progress):
        calls.append(mode)
        return {"mode": mode, "output_tok_s": next(speeds[mode]), "preemptions_total": 0}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    report = throughput.run("quick", ["bf16", "fp8-kv"], rounds=3, progress=False)
    assert calls == ["bf16", "fp8-kv", "fp8-kv", "bf16", "bf16", "fp8-kv"]
    bf16, fp8 = report["results"]
    assert (bf16["output_tok_s"], fp8["output_tok_s"]) == (200.0, 150.0)
    assert bf16["output_tok_s_rounds"] == [100.0, 300.0, 200.0]
    assert fp8["ratio_vs_first"] == 0.75
    assert "median of 3 rounds" in throughput.format_table(report)
