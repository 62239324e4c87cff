"""The throughput benchmark's rounds (alternating mode order, median run per mode) and the soak workload
(a live server under load, weight updates, disconnects and flushes)."""

import asyncio
import json

import httpx
import pytest

from fp8engine.benchmarks import soak, throughput
from fp8engine.entrypoints.cli import main


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


# ------------------------------------------------------------------ soak
def test_soak_updates_weights_under_load_without_errors_mixed_versions_or_leaks():
    """A short soak on the default model: every 3 s of traffic a pause("wait") + full-weight update."""
    config = soak.SoakConfig(minutes=0.25, clients=8, update_every_s=3.0, flush_every_s=4.0,
                             disconnect_fraction=0.3, seed=1)
    report = json.loads(json.dumps(soak.run(config)))  # what --json writes
    assert report["requests"] == sum(report["by_status"].values()) + sum(report["transport_errors"].values())
    assert report["by_status"] == {"200": report["requests"]} and report["transport_errors"] == {}
    assert report["server_errors"] == 0 and report["stream_errors"] == {}, report["first_errors"]
    assert report["completed"] + report["disconnected"] == report["requests"]
    assert report["completed"] >= 8 and report["disconnected"] >= 1
    assert report["mixed_version_choices"] == 0
    assert report["updates_applied"] >= 1 and report["updates_failed"] == 0
    assert report["final_weight_version"] == report["updates_applied"] == report["updates"][-1]["weight_version"]
    assert max(report["weight_versions_seen"]) >= 1  # requests after an update were served on its version
    assert report["admin_by_status"]["POST /update_weights 200"] == report["updates_applied"]
    assert report["admin_by_status"].get("POST /flush_cache 200", 0) == report["flushes"] >= 1
    assert report["kv_blocks_free"] == report["kv_blocks_total"] > 0
    assert 0 < report["rss_warmup_mib"] <= report["rss_peak_mib"] and report["rss_end_mib"] <= report["rss_peak_mib"]
    growth = 100 * (report["rss_end_mib"] - report["rss_warmup_mib"]) / report["rss_warmup_mib"]
    assert report["rss_growth_pct"] == pytest.approx(growth)
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"] <= report["latency_p99_s"]
    assert report["latency_p50_s"] <= report["latency_p99_s"]
    assert report["server_exit_code"] is None  # still running when the soak ended
    assert "mixed-version choices 0" in soak.format_table(report)


def test_soak_cli_options_reach_the_run_and_json(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_run(config):
        seen["config"] = config
        return {"workload": {"minutes": config.minutes}}

    monkeypatch.setattr(soak, "run", fake_run)
    monkeypatch.setattr(soak, "format_table", lambda report: "table")
    out = tmp_path / "soak.json"
    assert main(["bench", "--workload", "soak", "--minutes", "0.5", "--clients", "3", "--json", str(out)]) == 0
    assert seen["config"] == soak.SoakConfig(minutes=0.5, clients=3, model="default", dtype="bfloat16", device="auto")
    assert json.loads(out.read_text()) == {"workload": {"minutes": 0.5}}
    assert "table" in capsys.readouterr().out
    with pytest.raises(ValueError, match="minutes must be > 0, got 0.0"):
        soak.SoakConfig(minutes=0.0)


def test_a_stream_whose_chunks_change_weight_version_counts_as_mixed():
    def chunk(version: int, tokens: list[int]) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "weight_version": version, "token_ids": tokens}]})

    body = "\n\n".join([chunk(3, [1]), chunk(3, [2, 5]), chunk(4, [7]), "data: [DONE]"]) + "\n\n"
    tally = soak.Tally()
    asyncio.run(soak._read_events(httpx.Response(200, content=body.encode()), tally, 0.0, None))
    assert (tally.mixed_version_choices, tally.versions_seen, tally.output_tokens, tally.completed) == (1, {3, 4}, 4, 1)
