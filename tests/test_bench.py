"""The throughput benchmark's rounds (alternating mode order, median run per mode), its shape flags, the
llama.cpp baseline (against a stub llama-batched-bench that checks its arguments and prints llama.cpp's
formats), the vLLM baseline (against a stub venv python that answers as vllm_runner.py does, and the runner
itself against a stub vllm module), replica counts through RolloutCluster, and the soak workload (a live server
under load, weight updates, disconnects and flushes)."""

import asyncio
import importlib.util
import json
import os
import re
import stat
import sys
import textwrap
import types

import httpx
import pytest
import torch

from fp8engine.bench import in_flight, llama_cpp, replicas, soak, throughput, vllm_baseline, vllm_runner
from fp8engine.entrypoints.cli import main
from fp8engine.weights.loader import iter_safetensors


def test_rounds_alternate_order_and_report_the_median(monkeypatch):
    calls = []
    speeds = {"bf16": iter([100.0, 300.0, 200.0]), "fp8-kv": iter([150.0, 120.0, 400.0])}

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        calls.append(mode)
        return {"mode": mode, "output_tok_s": next(speeds[mode]), "preemptions_total": 0}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    report = throughput.run("quick", ["bf16", "fp8-kv"], rounds=3, progress=False)
    assert calls == ["bf16", "fp8-kv", "fp8-kv", "bf16", "bf16", "fp8-kv"]
    bf16, fp8 = report["results"]
    assert (bf16["output_tok_s"], fp8["output_tok_s"]) == (200.0, 150.0)
    assert bf16["output_tok_s_rounds"] == [100.0, 300.0, 200.0]
    assert fp8["ratio_vs_first"] == 1.5  # the rounds' ratios 1.5, 0.4, 2.0: paired, not 150 / 200
    assert (bf16["spread"], fp8["spread"]) == ((300 - 100) / 200, (400 - 120) / 150)
    text = throughput.format_table(report)
    assert "median of 3 rounds" in text and text.splitlines()[2].split()[3] == "spread"
    assert [line.split()[3] for line in text.splitlines()[3:5]] == ["100.0%", "186.7%"]


def test_each_mode_is_warmed_up_on_the_timed_batch_once_and_reused_every_round(monkeypatch, capsys):
    """An engine is built and warmed up on the very prompts and sampling parameters it is then timed on, on its first
    round only; every round then starts from a new weight version (prefix cache flushed, KV scales recalibrated)."""
    built, generated, updates = [], [], []

    class Counting(throughput.LLMEngine):
        def __init__(self, config):
            built.append(config.quantization)
            super().__init__(config)

        def generate(self, prompts, params=None, **kw):
            generated.append((len(prompts), params.max_tokens, params.n))
            return super().generate(prompts, params, **kw)

        def update_weights(self, weights, **kw):
            updates.append(self.weight_version)
            return super().update_weights(weights, **kw)

    monkeypatch.setattr(throughput, "LLMEngine", Counting)
    spec = throughput.shaped("decode", output_len=6)
    report = throughput.run(spec, ["bf16", "fp8-linear"], rounds=3, progress=False)
    assert built == [None, "fp8"]
    assert generated == [(1, 6, 1)] * 8  # per mode a warm-up, then three timed runs of the same batch
    assert len(updates) == 6 and all(r["output_tokens"] == 6 for r in report["results"])
    assert "what it means: one sequence decodes" in throughput.format_table(report)


def test_interleaved_modes_take_turns_of_n_steps_and_count_only_their_own(monkeypatch):
    """--interleave: the round's modes run together, N engine steps each in turn, the order reversing every turn and
    every round; each mode's tokens and seconds are its own run's."""
    steps = []

    class Counting(throughput.LLMEngine):
        def step(self, finished_only=False):
            steps.append("f" if self.config.quantization else "b")
            return super().step(finished_only)

    monkeypatch.setattr(throughput, "LLMEngine", Counting)
    spec = throughput.shaped("decode", output_len=6)
    report = throughput.run(spec, ["bf16", "fp8-linear"], rounds=2, progress=False, interleave=4)
    warm = "b" * 6 + "f" * 6  # each engine warmed up alone on the timed batch: 6 steps for 6 tokens
    assert "".join(steps) == warm + "bbbb" + "ffff" + "ff" + "bb" + "ffff" + "bbbb" + "bb" + "ff"
    assert [r["output_tokens"] for r in report["results"]] == [6, 6] and report["interleave"] == 4
    assert all(len(r["output_tok_s_rounds"]) == 2 for r in report["results"])
    assert "the modes taking turns every 4 engine steps" in throughput.format_table(report)
    with pytest.raises(ValueError, match="interleave must be >= 0"):
        throughput.run(spec, ["bf16"], interleave=-1, progress=False)


def test_vllm_runs_with_tcmalloc_preloaded_where_installed(monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(vllm_baseline, "TCMALLOC", ("/nonexistent/libtcmalloc.so", str(lib)))
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    assert vllm_baseline.child_env([0])["LD_PRELOAD"] == f"{lib}:/other.so"
    monkeypatch.setattr(vllm_baseline, "TCMALLOC", ("/nonexistent/libtcmalloc.so",))
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in vllm_baseline.child_env([0])


def test_reports_name_the_cpu_and_the_instruction_sets_the_kernels_choose_between(monkeypatch):
    """Tables from different machines are told apart by their header: the CPU's model and which of the kernels'
    instruction sets it lists (no AMX here, or AMX that the rows' linear_backend shows was used)."""
    machine = throughput.machine_info()
    flags = throughput.cpu_flags()
    assert machine["cpu_features"] == [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile",
                                                   "amx_bf16") if f in flags]
    assert throughput.machine_words({"cpu": "Xeon", "cpu_features": ["avx2", "avx512_bf16"],
                                     "processor": "x86_64"}) == "Xeon (avx2 avx512_bf16)"
    assert throughput.machine_words({"cpu": None, "cpu_features": [], "processor": "x86_64"}) == "x86_64"
    monkeypatch.setattr(throughput, "run_engine", lambda mode, *args, **kw: {"mode": mode, "output_tok_s": 10.0})
    report = throughput.run("quick", ["bf16"], progress=False)
    assert throughput.machine_words(report["machine"]) in throughput.format_table(report).splitlines()[0]


# ------------------------------------------------------------------ shape flags
def test_shape_flags_override_the_workload_and_reach_the_engine_and_the_report(monkeypatch, tmp_path, capsys,
                                                                                tokenizer):
    seen = []

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        seen.append((spec, prompts, torch.get_num_threads()))
        return {"mode": mode, "output_tokens": 30, "seconds": 0.5, "output_tok_s": 60.0}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    out = tmp_path / "report.json"
    threads = torch.get_num_threads()
    assert main(["bench", "--workload", "rl-short", "--num-prompts", "3", "--n", "2", "--prompts", "random",
                 "--input-len", "7", "--output-len", "5", "--threads", "1", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # set for the runs only
    [(spec, prompts, run_threads)] = seen
    assert (spec.name, spec.num_prompts, spec.n, spec.max_tokens, spec.prompts, spec.input_len) == (
        "rl-short", 3, 2, 5, "random", 7)
    assert run_threads == 1 and [len(p) for p in prompts] == [7, 7, 7]
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    assert all(0 <= t < len(tokenizer) and t not in special for p in prompts for t in p)
    assert prompts == throughput.random_prompt_ids(tokenizer, 3, 7) != throughput.random_prompt_ids(tokenizer, 3, 7, 1)
    report = json.loads(out.read_text())
    assert report["shape"] == {"prompts": "random", "num_prompts": 3, "n": 2, "input_len": 7.0, "input_len_min": 7,
                               "input_len_max": 7, "output_len": 5, "threads": 1}
    assert report["machine"]["threads"] == 1 and report["workload"]["max_tokens"] == 5
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("workload rl-short: 3 random prompts of 7 tokens x n=2 x 5 output tokens, 1 thread,")


def test_chat_prompts_report_their_lengths_as_the_engine_renders_them(tokenizer):
    spec = throughput.shaped("quick", num_prompts=3)
    prompts = throughput.prompt_ids(spec, tokenizer)
    text = tokenizer.decode(prompts[1])
    assert "Sam has 24 apples and buys 8 more" in text and text.endswith("assistant\n")
    shape = throughput.shape_of(spec, prompts, 2)
    assert shape["input_len"] == sum(map(len, prompts)) / 3
    assert (shape["input_len_min"], shape["input_len_max"]) == (min(map(len, prompts)), max(map(len, prompts)))


@pytest.mark.parametrize("argv,message", [
    (["--num-prompts", "0"], "--num-prompts must be an integer >= 1, got 0"),
    (["--n", "-2"], "--n must be an integer >= 1, got -2"),
    (["--output-len", "0"], "--output-len (max_tokens) must be an integer >= 1, got 0"),
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--prompts", "random"], "--prompts random needs --input-len N"),
    (["--prompts", "random", "--input-len", "-1"], "--input-len must be an integer >= 1, got -1"),
    (["--input-len", "8"], "--input-len 8 sets the length of random prompts; chat prompts have their own lengths"),
    (["--replicas", "2,0"], "--replicas must be an integer >= 1, got 0"),
    (["--replicas", "1,2", "--baseline", "hf"], "--replicas compares replica counts of one mode"),
    (["--interleave", "-1"], "interleave must be >= 0 engine steps, got -1"),
    (["--interleave", "4", "--replicas", "1,2"], "--interleave times engine modes side by side"),
    (["--workload", "sync", "--n", "2", "--threads", "1"], "--n, --threads: for the throughput workloads"),
    (["--baseline", "hf", "--gguf", "m.gguf"], "--gguf and --llama-bin are for --baseline llama.cpp"),
    (["--baseline", "llama.cpp", "--gguf", "m.gguf"], "--baseline llama.cpp needs --llama-bin DIR"),
    (["--baseline", "llama.cpp", "--llama-bin", "nowhere"], "--llama-bin 'nowhere' is not a directory"),
    (["--baseline", "llama.cpp", "--llama-bin", "."], "no llama-batched-bench in --llama-bin '.' nor in its bin/"),
    (["--vllm-python", "python"], "--vllm-python is for --baseline vllm"),
    (["--baseline", "vllm"], "--baseline vllm needs --vllm-python PATH"),
    (["--baseline", "vllm", "--vllm-python", "nowhere/python"], "--vllm-python 'nowhere/python' is not a file"),
    (["--baseline", "hf,vllm,hf", "--vllm-python", "python"], "choose each at most once"),
])
def test_bad_bench_flags_exit_2_naming_the_flag_before_any_model_loads(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(throughput, "run_engine", lambda *args, **kw: pytest.fail("ran the engine"))
    monkeypatch.setattr(throughput, "prompt_ids", lambda *args: pytest.fail("loaded the tokenizer"))
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_replica_list_that_is_not_integers_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--replicas", "1,two"])
    assert exc.value.code == 2
    assert "argument --replicas: '1,two' is not a comma-separated list of integers" in capsys.readouterr().err


# ------------------------------------------------------------------ llama.cpp baseline
STUB = """\
#!{python}
# A stand-in for llama.cpp's llama-batched-bench: checks its arguments as llama.cpp parses them, prints the
# start-up line and then its markdown table, or JSON lines with --output-format jsonl, with times from the shape.
import json, os, sys
args, flags, i = sys.argv[1:], {{}}, 0
while i < len(args):
    if args[i] == "-pps":
        flags["-pps"], i = True, i + 1
    else:
        flags[args[i]], i = args[i + 1], i + 2
json.dump(args, open(os.path.join(os.path.dirname(__file__), "args.json"), "w"))
known = {{"-m", "-c", "-npp", "-ntg", "-npl", "-t", "--output-format", "-pps"}}
if set(flags) - known or not os.path.isfile(flags["-m"]):
    sys.exit(f"error: bad arguments {{args}}")
pp, tg, pl, threads, ctx = (int(flags[k]) for k in ("-npp", "-ntg", "-npl", "-t", "-c"))
shared = "-pps" in flags
n_kv = (pp if shared else pl * pp) + pl * tg
print(f"main: n_kv_max = {{ctx}}, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = {{int(shared)}}, "
      f"n_gpu_layers = -1, n_threads = {{threads}}, n_threads_batch = {{threads}}", file=sys.stderr)
if n_kv > ctx:  # llama-batched-bench skips a point that does not fit
    sys.exit(0)
t_pp, t_tg = 0.002 * (pp if shared else pl * pp), 0.05 * tg
row = dict(pp=pp, tg=tg, pl=pl, n_kv=n_kv, t_pp=t_pp, speed_pp=(pp if shared else pl * pp) / t_pp, t_tg=t_tg,
           speed_tg=pl * tg / t_tg, t=t_pp + t_tg, speed=n_kv / (t_pp + t_tg))
if flags.get("--output-format") == "jsonl":
    print(json.dumps(dict(n_kv_max=ctx, n_batch=2048, n_ubatch=512, flash_attn=0, is_pp_shared=int(shared),
                          n_gpu_layers=-1, n_threads=threads, n_threads_batch=threads, **row)))
else:
    print("|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |" % (
        "PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"))
    print("|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|" % ("------", "------", "----", "------",
          "--------", "--------", "--------", "--------", "--------", "--------"))
    print("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |" % tuple(row.values()))
"""


@pytest.fixture()
def llama_bin(tmp_path):
    """A directory with bin/llama-batched-bench (the stub) and a GGUF file for it to open."""
    bin_dir = tmp_path / "llama" / "bin"
    bin_dir.mkdir(parents=True)
    stub = bin_dir / "llama-batched-bench"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    return bin_dir.parent


def stub_args(llama_bin) -> list[str]:
    return json.loads((llama_bin / "bin" / "args.json").read_text())


def test_llama_cpp_row_from_the_binary_beside_a_real_engine_run(llama_bin, tmp_path, capsys):
    """B = 2 prompts x n=2 = 4 sequences of 8 random prompt tokens, 4 output tokens each, one thread."""
    out = tmp_path / "report.json"
    assert main(["bench", "--num-prompts", "2", "--n", "2", "--prompts", "random", "--input-len", "8",
                 "--output-len", "4", "--threads", "1", "--no-progress", "--baseline", "llama.cpp",
                 "--gguf", str(tmp_path / "model.gguf"), "--llama-bin", str(llama_bin), "--json", str(out)]) == 0
    assert stub_args(llama_bin) == ["-m", str(tmp_path / "model.gguf"), "-c", "48", "-npp", "8", "-ntg", "4",
                                    "-npl", "4", "-t", "1", "--output-format", "jsonl"]
    engine, llama = json.loads(out.read_text())["results"]
    assert (engine["mode"], engine["output_tokens"], llama["mode"], llama["output_tokens"]) == (
        "bf16", 16, "llama.cpp", 16)
    t_pp, t_tg = 0.002 * 4 * 8, 0.05 * 4
    assert llama["seconds"] == pytest.approx(t_pp + t_tg)
    assert llama["output_tok_s"] == pytest.approx(16 / (t_pp + t_tg))
    assert llama["ratio_vs_first"] == pytest.approx(llama["output_tok_s"] / engine["output_tok_s"])
    own = llama["llama_cpp"]
    assert (own["pp"], own["tg"], own["pl"], own["n_threads"], own["prompt_shared"]) == (8, 4, 4, 1, False)
    assert (own["speed_pp"], own["speed_tg"]) == (pytest.approx(32 / t_pp), pytest.approx(16 / t_tg))
    text = capsys.readouterr().out
    assert "llama.cpp" in text.splitlines()[3] and "prefill 500.0 tok/s" in text


def test_llama_cpp_comes_last_and_is_compared_with_the_first_mode(llama_bin, tmp_path, monkeypatch, tokenizer):
    """Two modes, one chat prompt x n=3: the three sequences share one prefill (-pps) of the prompt's length."""
    speeds = {"bf16": 100.0, "fp8-kv": 150.0}

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        return {"mode": mode, "output_tokens": 18, "seconds": 18 / speeds[mode], "output_tok_s": speeds[mode]}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    spec = throughput.shaped("quick", num_prompts=1, n=3, output_len=6)
    report = throughput.run(spec, ["bf16", "fp8-kv"], "llama.cpp", threads=1, gguf=str(tmp_path / "model.gguf"),
                            llama_bin=str(llama_bin / "bin"))
    length = len(throughput.prompt_ids(spec, tokenizer)[0])
    assert stub_args(llama_bin)[:11] == ["-m", str(tmp_path / "model.gguf"), "-c", str(3 * (length + 6)), "-npp",
                                         str(length), "-ntg", "6", "-npl", "3", "-t"]
    assert stub_args(llama_bin)[-1] == "-pps"
    t = 0.002 * length + 0.05 * 6
    assert [(r["mode"], r["ratio_vs_first"]) for r in report["results"]] == [
        ("bf16", 1.0), ("fp8-kv", 1.5), ("llama.cpp", pytest.approx(18 / t / 100.0))]
    assert report["results"][2]["llama_cpp"]["prompt_shared"] is True
    assert "shared by all" in throughput.format_table(report)


def test_llama_cpp_runs_in_every_round_alternating_with_the_modes(llama_bin, tmp_path, monkeypatch):
    """Three rounds: the baseline is one more mode in the alternating order (a drifting machine shifts it as
    it shifts the modes), and its row is its median round."""
    calls = []

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        calls.append(mode)
        return {"mode": mode, "output_tokens": 8, "seconds": 1.0, "output_tok_s": 8.0}

    def fake_llama(*args, **kwargs):
        calls.append("llama.cpp")
        speed = [50.0, 30.0, 40.0][calls.count("llama.cpp") - 1]
        return {"mode": "llama.cpp", "output_tokens": 8, "seconds": 8 / speed, "output_tok_s": speed}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    monkeypatch.setattr(llama_cpp, "runner", lambda gguf, llama_bin: fake_llama)
    spec = throughput.shaped("quick", num_prompts=1, n=1, output_len=8)
    report = throughput.run(spec, ["bf16", "fp8-kv"], "llama.cpp", threads=1, rounds=3,
                            gguf=str(tmp_path / "model.gguf"), llama_bin=str(llama_bin / "bin"))
    assert calls == ["bf16", "fp8-kv", "llama.cpp", "llama.cpp", "fp8-kv", "bf16", "bf16", "fp8-kv", "llama.cpp"]
    row = report["results"][2]
    assert (row["mode"], row["output_tok_s"], row["output_tok_s_rounds"]) == ("llama.cpp", 40.0, [50.0, 30.0, 40.0])
    assert row["ratio_vs_first"] == 5.0


def test_the_ratio_to_the_best_peer_is_taken_round_by_round(llama_bin, tmp_path, monkeypatch):
    """Each round's fastest mode over that round's fastest peer, not the ratio of the rows' medians (each row
    takes its own middle round): here the medians give 120 / 60 = 2.0x, the rounds 1.5x, 2.5x and 1.25x."""
    speeds = {"bf16": iter([90.0, 150.0, 100.0]), "fp8-kv": iter([120.0, 100.0, 125.0]),
              "llama.cpp": iter([80.0, 60.0, 100.0])}

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        return {"mode": mode, "output_tokens": 8, "seconds": 1.0, "output_tok_s": next(speeds[mode])}

    def fake_llama(*args, **kwargs):
        return {"mode": "llama.cpp", "output_tokens": 8, "seconds": 1.0, "output_tok_s": next(speeds["llama.cpp"])}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    monkeypatch.setattr(llama_cpp, "runner", lambda gguf, llama_bin: fake_llama)
    spec = throughput.shaped("quick", num_prompts=1, n=1, output_len=8)
    report = throughput.run(spec, ["bf16", "fp8-kv"], "llama.cpp", threads=1, rounds=3,
                            gguf=str(tmp_path / "model.gguf"), llama_bin=str(llama_bin / "bin"))
    versus = report["versus_best_peer"]
    assert [(r["mode"], r["peer"], r["ratio"]) for r in versus["rounds"]] == [
        ("fp8-kv", "llama.cpp", 1.5), ("bf16", "llama.cpp", 2.5), ("fp8-kv", "llama.cpp", 1.25)]
    assert versus["median"] == 1.5
    assert [r["output_tok_s"] for r in report["results"]] == [100.0, 120.0, 80.0]
    assert ("best mode / best peer, round by round: 1.50x (fp8-kv / llama.cpp), 2.50x (bf16 / llama.cpp), "
            "1.25x (fp8-kv / llama.cpp)") in throughput.format_table(report)
    speeds["bf16"] = iter([50.0])
    assert "versus_best_peer" not in throughput.run(spec, ["bf16"], rounds=1, progress=False)  # no peer, no ratio


def test_parse_reads_llama_cpp_markdown_table_and_json_lines():
    table = textwrap.dedent("""\
        main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, n_gpu_layers = 99

        |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
        |-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
        |   128 |    128 |    1 |    256 |    0.108 |  1186.64 |    3.079 |    41.57 |    3.187 |    80.32 |
        |   128 |    128 |    2 |    512 |    0.198 |  1295.19 |    5.029 |    50.90 |    5.227 |    97.95 |
        """)
    rows = llama_cpp.parse(table)
    assert rows == [
        dict(pp=128, tg=128, pl=1, n_kv=256, t_pp=0.108, speed_pp=1186.64, t_tg=3.079, speed_tg=41.57, t=3.187,
             speed=80.32),
        dict(pp=128, tg=128, pl=2, n_kv=512, t_pp=0.198, speed_pp=1295.19, t_tg=5.029, speed_tg=50.90, t=5.227,
             speed=97.95)]
    line = ('{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, '
            '"n_gpu_layers": 99, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 1, "n_kv": 256, '
            '"t_pp": 0.108000, "speed_pp": 1186.640000, "t_tg": 3.079000, "speed_tg": 41.570000, "t": 3.187000, '
            '"speed": 80.320000}')
    [row] = llama_cpp.parse("llama_perf_context_print: load time = 1.0 ms\n" + line + "\n{not json\n")
    assert (row["n_threads"], row["pl"], row["t"]) == (2, 1, 3.187)


def test_a_llama_cpp_binary_that_fails_or_prints_no_row_is_an_error(llama_bin, tmp_path):
    binary = llama_cpp.find_binary(str(llama_bin))
    with pytest.raises(RuntimeError, match=r"exited with status 1: .*\n.*error: bad arguments"):
        llama_cpp.run(binary, tmp_path / "missing.gguf", 8, 4, 2, 1)
    os.chmod(binary, 0o644)
    with pytest.raises(ValueError, match="llama-batched-bench is not executable"):
        llama_cpp.find_binary(str(llama_bin))


# ------------------------------------------------------------------ vLLM baseline
VLLM_STUB = """\
#!{python}
# A stand-in for a vLLM venv's python: run as `python vllm_runner.py --check` or `python vllm_runner.py FILE`, it
# checks the workload with the runner's own load_workload, records its arguments, environment and workload, and
# prints the runner's JSON line with times from the shape (0.01 s per prompt token, 0.05 s per decode step).
import json, os, sys
runner, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(runner))
import vllm_runner
record = os.path.join(os.path.dirname(__file__), "calls.jsonl")
env = {{k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "PYTHONPATH")}}
versions = dict(vllm="0.99.1", torch="2.13.0+cpu", platform="cpu")
if args == ["--check"]:
    call, out = dict(args=sys.argv[1:], env=env), versions
else:
    spec = vllm_runner.load_workload(args[0])
    call = dict(args=sys.argv[1:], env=env, workload=spec)
    sequences = len(spec["prompt_token_ids"]) * spec["n"]
    seconds = 0.01 * sum(map(len, spec["prompt_token_ids"])) + 0.05 * spec["output_len"]
    out = dict(versions, seconds=seconds, output_tokens=sequences * spec["output_len"],
               output_tok_s=sequences * spec["output_len"] / seconds, sequences=sequences, threads=spec["threads"],
               cpus=spec["cpus"], omp_threads_bind=env["VLLM_CPU_OMP_THREADS_BIND"], compilation_mode="DYNAMO_TRACE_ONCE",
               compilation_backend="inductor", enforce_eager=False, max_num_batched_tokens=4096,
               kv_cache_bytes=spec["kv_cache_bytes"])
with open(record, "a") as f:
    f.write(json.dumps(call) + "\\n")
print("INFO vllm logs a line to stdout")
print(json.dumps(out))
"""


@pytest.fixture()
def vllm_python(tmp_path):
    """A venv-like bin/python: the stub above."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(VLLM_STUB.format(python=sys.executable))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def vllm_calls(vllm_python) -> list[dict]:
    return [json.loads(line) for line in (vllm_python.parent / "calls.jsonl").read_text().splitlines()]


def test_vllm_row_comes_after_the_modes_with_the_engines_prompts_and_threads(vllm_python, tmp_path, monkeypatch,
                                                                              capsys):
    """3 random prompts x n=2 x 5 tokens, one thread: vLLM gets the very token ids the engine got, and its row is
    the runner's figures, named by its version, compared with the first mode."""
    engine_prompts = []

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        engine_prompts.append(prompts)
        return {"mode": mode, "output_tokens": 30, "seconds": 0.5, "output_tok_s": 60.0}

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    out = tmp_path / "report.json"
    assert main(["bench", "--num-prompts", "3", "--n", "2", "--prompts", "random", "--input-len", "7",
                 "--output-len", "5", "--threads", "1", "--baseline", "vllm", "--vllm-python", str(vllm_python),
                 "--json", str(out)]) == 0
    check, timed = vllm_calls(vllm_python)
    assert check["args"] == [str(vllm_baseline.RUNNER), "--check"]
    assert timed["args"][0] == str(vllm_baseline.RUNNER) and timed["args"][1].endswith("workload.json")
    [prompts] = engine_prompts
    workload = timed["workload"]
    assert workload["prompt_token_ids"] == prompts and [len(p) for p in prompts] == [7, 7, 7]
    first_cpu = min(os.sched_getaffinity(0))
    assert (workload["n"], workload["output_len"], workload["temperature"], workload["threads"], workload["cpus"]) == (
        2, 5, 1.0, 1, [first_cpu])
    assert (workload["dtype"], workload["max_num_seqs"], workload["kv_cache_bytes"]) == ("bfloat16", 256, 1 << 30)
    assert workload["model"] == throughput.model_dir("default")
    assert timed["env"] == {"VLLM_CPU_OMP_THREADS_BIND": str(first_cpu), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                            "PYTHONPATH": None}
    report = json.loads(out.read_text())
    engine, vllm = report["results"]
    assert (engine["mode"], engine["ratio_vs_first"]) == ("bf16", 1.0)
    seconds = 0.01 * 21 + 0.05 * 5
    assert (vllm["mode"], vllm["output_tokens"], vllm["seconds"]) == ("vllm 0.99.1 (cpu)", 30, pytest.approx(seconds))
    assert vllm["output_tok_s"] == pytest.approx(30 / seconds)
    assert vllm["ratio_vs_first"] == pytest.approx(30 / seconds / 60.0)
    assert (vllm["vllm"]["torch"], vllm["vllm"]["sequences"], vllm["vllm"]["omp_threads_bind"]) == (
        "2.13.0+cpu", 6, str(first_cpu))
    text = capsys.readouterr().out.splitlines()
    assert text[2].split()[0] == "bf16" and text[3].split()[:3] == ["vllm", "0.99.1", "(cpu)"]
    assert text[4].startswith("vllm: 0.99.1 on torch 2.13.0+cpu (cpu), 6 sequences of 5 tokens")


def test_both_subprocess_baselines_run_in_every_round_after_the_modes(vllm_python, llama_bin, tmp_path, monkeypatch):
    calls = []

    def fake_run_engine(mode, spec, prompts, model, dtype, device, progress, engines=None):
        calls.append(mode)
        return {"mode": mode, "output_tokens": 8, "seconds": 1.0, "output_tok_s": 8.0}

    def recorded(name, run):
        def call(*args, **kwargs):
            calls.append(name)
            return run(*args, **kwargs)
        return call

    monkeypatch.setattr(throughput, "run_engine", fake_run_engine)
    monkeypatch.setattr(vllm_baseline, "run", recorded("vllm", vllm_baseline.run))
    monkeypatch.setattr(llama_cpp, "run", recorded("llama.cpp", llama_cpp.run))
    spec = throughput.shaped("quick", num_prompts=2, n=1, prompts="random", input_len=4, output_len=8)
    report = throughput.run(spec, ["bf16"], ["llama.cpp", "vllm"], threads=1, rounds=2,
                            gguf=str(tmp_path / "model.gguf"), llama_bin=str(llama_bin), vllm_python=str(vllm_python))
    assert calls == ["bf16", "llama.cpp", "vllm", "vllm", "llama.cpp", "bf16"]
    assert [r["mode"] for r in report["results"]] == ["bf16", "llama.cpp", "vllm 0.99.1 (cpu)"]
    assert len(report["results"][2]["output_tok_s_rounds"]) == 2
    assert len(vllm_calls(vllm_python)) == 3  # one check, then a run per round


def test_a_vllm_python_that_fails_is_refused_before_any_mode_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "run_engine", lambda *args, **kw: pytest.fail("ran the engine"))
    spec = throughput.shaped("quick", num_prompts=1, n=1, output_len=2)
    text = tmp_path / "python"
    text.write_text("not a program\n")
    with pytest.raises(ValueError, match="--vllm-python '.*python' is not executable"):
        throughput.run(spec, ["bf16"], "vllm", vllm_python=str(text))
    text.chmod(0o755)
    with pytest.raises(ValueError, match="--vllm-python '.*python' does not run: .*Exec format error"):
        throughput.run(spec, ["bf16"], "vllm", vllm_python=str(text))
    if importlib.util.find_spec("vllm") is None:  # this python is one without vllm
        with pytest.raises(ValueError, match=r"(?s)has no vllm \(`.*vllm_runner.py --check` exited with status 1\); "
                                             r"`make bench-baselines` builds.*No module named 'vllm'"):
            throughput.run(spec, ["bf16"], "vllm", vllm_python=sys.executable)
    with pytest.raises(ValueError, match="--threads 99: vLLM binds one thread to each CPU"):
        throughput.run(spec, ["bf16"], "vllm", vllm_python=sys.executable, threads=99)


def test_a_vllm_run_that_fails_names_its_status_and_output(tmp_path):
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport sys\nprint('RuntimeError: no ISA for this kernel')\nsys.exit(3)\n")
    python.chmod(0o755)
    info = {"vllm": "0.99.1"}
    spec = throughput.shaped("quick", num_prompts=1, n=1, output_len=2)
    with pytest.raises(RuntimeError, match="(?s)vLLM 0.99.1 exited with status 3: .*no ISA for this kernel"):
        vllm_baseline.run(python, info, [[1, 2]], spec, "model", "bfloat16", 1, 1 << 30)
    python.write_text(f"#!{sys.executable}\nprint('INFO started')\n")
    with pytest.raises(RuntimeError, match="(?s)vLLM 0.99.1 printed no result: .*INFO started"):
        vllm_baseline.run(python, info, [[1, 2]], spec, "model", "bfloat16", 1, 1 << 30)


class _StubLLM:
    """vLLM's LLM as vllm_runner uses it: records its arguments and calls, returns n outputs of max_tokens ids."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        compilation = types.SimpleNamespace(mode=types.SimpleNamespace(name="NONE"), backend="eager")
        config = types.SimpleNamespace(compilation_config=compilation,
                                       model_config=types.SimpleNamespace(enforce_eager=True),
                                       scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2048))
        self.llm_engine = types.SimpleNamespace(vllm_config=config)
        _StubLLM.last = self

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", prompts, params.kwargs, use_tqdm))
        sample = types.SimpleNamespace(token_ids=[0] * params.kwargs["max_tokens"])
        return [types.SimpleNamespace(outputs=[sample] * params.kwargs.get("n", 1)) for _ in prompts]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_the_runner_reads_the_workload_and_counts_every_sample(tmp_path, monkeypatch, capsys):
    vllm = types.ModuleType("vllm")
    vllm.__version__, vllm.LLM = "0.99.1", _StubLLM
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(device_type="cpu")
    for name, module in {"vllm": vllm, "vllm.inputs": inputs, "vllm.platforms": platforms}.items():
        monkeypatch.setitem(sys.modules, name, module)
    threads, pinned = [], []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, cpus)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1")
    spec = dict(prompt_token_ids=[[5, 6, 7], [8, 9]], n=3, output_len=4, temperature=0.7, threads=2, cpus=[0, 1],
                model="m", dtype="bfloat16", max_num_seqs=64, kv_cache_bytes=1 << 30, seed=0)
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(spec))
    assert vllm_runner.main([str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    llm = _StubLLM.last
    assert llm.kwargs == dict(model="m", dtype="bfloat16", seed=0, max_num_seqs=64, kv_cache_memory_bytes=1 << 30)
    warm, reset, timed = llm.calls
    batch = ("generate", [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
             dict(n=3, temperature=0.7, top_p=1.0, top_k=0, max_tokens=4, min_tokens=4, ignore_eos=True, logprobs=0),
             False)
    assert warm == timed == batch  # warmed up on the batch it is timed on
    assert reset == ("reset_prefix_cache",)
    assert threads == [2] and pinned == [(0, [0, 1])]
    assert (out["vllm"], out["torch"], out["platform"]) == ("0.99.1", torch.__version__, "cpu")
    assert (out["output_tokens"], out["sequences"], out["cpus"], out["omp_threads_bind"]) == (24, 6, [0, 1], "0,1")
    assert out["output_tok_s"] == pytest.approx(24 / out["seconds"])
    assert (out["compilation_mode"], out["enforce_eager"], out["max_num_batched_tokens"]) == (
        "NONE", True, 2048)
    assert vllm_runner.main(["--check"]) == 0
    assert json.loads(capsys.readouterr().out) == {"vllm": "0.99.1", "torch": torch.__version__, "platform": "cpu"}


@pytest.mark.parametrize("change, message", [
    (dict(n=None), "missing n"),
    (dict(n=0), "n must be >= 1"),
    (dict(threads=True), "threads must be of type int, got True"),
    (dict(prompt_token_ids=[[1], []]), "prompt_token_ids must be non-empty lists of token ids"),
    (dict(prompt_token_ids=[[1, 2.5]]), "prompt_token_ids must be non-empty lists of token ids"),
    (dict(model=3), "model must be of type str, got 3"),
    (dict(cpus=[]), "cpus must be a non-empty list of CPU ids, got []"),
])
def test_the_runner_refuses_a_malformed_workload(change, message, tmp_path):
    spec = dict(prompt_token_ids=[[5, 6]], n=1, output_len=4, temperature=0, threads=1, cpus=[0], model="m",
                dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=1 << 30, seed=0)
    spec.update(change)
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({k: v for k, v in spec.items() if v is not None}))
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        vllm_runner.load_workload(str(path))
    with pytest.raises(SystemExit):
        vllm_runner.main([])  # neither a file nor --check


# ------------------------------------------------------------------ replicas
def test_replica_counts_side_by_side_through_a_local_ray(tiny_qwen3_dir):
    """1 and 2 replicas of one thread each on a tiny model: every count syncs twice per method and rolls out
    the whole batch (4 prompts x n=2 x 4 tokens)."""
    import ray
    spec = throughput.shaped("quick", num_prompts=4, n=2, prompts="random", input_len=8, output_len=4)
    report = replicas.run(spec, "bf16", [1, 2], model=tiny_qwen3_dir, threads=1)
    assert not ray.is_initialized()  # the bench started its Ray and shut it down
    one, two = report["results"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    state_bytes = sum(t.numel() * 2 for _, t in iter_safetensors(tiny_qwen3_dir))  # BF16 on the wire
    for r in (one, two):
        assert (r["output_tokens"], r["weight_version"], r["sync_bytes"]) == (32, 4, state_bytes)
        assert r["seconds"] > 0 and r["sync_object_store_s"] > 0 and r["sync_distributed_s"] > 0
    assert one["ratio_vs_first"] == one["sync_object_store_ratio_vs_first"] == 1.0
    assert two["ratio_vs_first"] == pytest.approx(two["output_tok_s"] / one["output_tok_s"])
    sync_ratio = two["sync_distributed_s"] / one["sync_distributed_s"]
    assert two["sync_distributed_ratio_vs_first"] == pytest.approx(sync_ratio)
    assert (report["threads_per_replica"], report["shape"]["threads"], report["mode"]) == (1, 1, "bf16")
    text = replicas.format_table(report)
    assert "4 random prompts of 8 tokens x n=2 x 4 output tokens, 1 thread per replica" in text
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["replicas", "1", "2"]


# ------------------------------------------------------------------ soak
def test_soak_updates_weights_under_load_without_errors_mixed_versions_or_leaks():
    """A short soak on the default model: 24 s of traffic, every 3 s a pause("wait") + full-weight update."""
    config = soak.SoakConfig(minutes=0.4, clients=8, update_every_s=3.0, flush_every_s=4.0,
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
    # requests after an update were served on its version
    assert max(report["weight_versions_seen"]) >= 1, (report["updates"], report["weight_versions_seen"])
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


def test_a_malformed_event_counts_as_a_stream_error_and_the_soak_goes_on():
    """An event a line-splitting client cuts in two (U+2028 in raw JSON, as the server once sent it) is an
    error the soak reports, not one that ends it; the server's own events now survive such a client."""
    from fp8engine.entrypoints.server import _event
    cut = 'data: {"choices":[{"index":0,"text":"a\u2028b","weight_version":1,"token_ids":[5]}]}'
    tally = soak.Tally()
    asyncio.run(soak._read_events(httpx.Response(200, content=(cut + "\n\n").encode()), tally, 0.0, None))
    assert (tally.stream_errors["malformed event"], tally.completed) == (1, 0)
    whole = _event({"choices": [{"index": 0, "text": "a\u2028b\x85", "weight_version": 1, "token_ids": [5]}]})
    tally = soak.Tally()
    body = (whole + "data: [DONE]\n\n").encode()
    asyncio.run(soak._read_events(httpx.Response(200, content=body), tally, 0.0, None))
    assert (dict(tally.stream_errors), tally.completed, tally.output_tokens) == ({}, 1, 1)


# ------------------------------------------------------------------ weight updates during generation
def test_update_policies_side_by_side_on_one_stream_of_groups(tiny_qwen3_dir, capsys):
    """--update-every: the same groups and lengths under every policy; "keep" changes nothing of the schedule,
    "wait" drains before each update (more, smaller steps), "keep+recompute" re-prefills what is in flight, and
    with an FP8 KV cache every update that moves the scales re-quantizes the live blocks."""
    spec = throughput.shaped("rl-long", num_prompts=4, n=2, output_len=8)
    report = in_flight.run(spec, "fp8-kv", 3, ["none", "wait", "keep", "keep+recompute"], model=tiny_qwen3_dir,
                           threads=1)
    rows = {r["policy"]: r for r in report["results"]}
    total = sum(report["lengths"]) * 2
    assert all(r["output_tokens"] == total for r in rows.values())
    assert rows["none"]["updates"] == 0 and "stall_s_per_update" not in rows["none"]
    assert rows["keep"]["steps"] == rows["none"]["steps"] and rows["keep"]["recomputed_seqs"] == 0
    assert rows["keep"]["updates"] == rows["keep+recompute"]["updates"] >= 2
    assert rows["keep"]["kv_rescale_ms_per_update"] > 0
    assert rows["keep+recompute"]["recomputed_seqs"] > 0 and rows["wait"]["recomputed_seqs"] == 0
    assert rows["wait"]["updates"] >= 1 and rows["wait"]["steps"] >= rows["none"]["steps"]
    assert all("stall_s_per_update" in rows[p] for p in ("wait", "keep", "keep+recompute"))
    assert "keep+recompute" in in_flight.format_table(report)


@pytest.mark.parametrize("argv, message", [
    (["--update-every", "0"], "--update-every must be an integer >= 1"),
    (["--update-every", "4", "--in-flight", "drain"], "--in-flight"),
    (["--update-every", "4", "--replicas", "1"], "--update-every compares"),
    (["--workload", "sync", "--update-every", "4"], "--update-every"),
])
def test_bad_update_flags_are_refused_before_any_model_loads(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(in_flight, "run_policy", lambda *args: pytest.fail("a policy ran"))
    monkeypatch.setattr(in_flight, "prompt_ids", lambda *args: pytest.fail("loaded the tokenizer"))
    argv = ["bench", *(["--workload", "rl-long"] if "--workload" not in argv else []), *argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses an unknown choice itself
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_speculative_runs_beside_each_mode_with_its_counters(tmp_path, capsys):
    """--speculative off,ngram: every mode plain and with drafts, in one run, the draft counters in the report."""
    path = tmp_path / "spec.json"
    assert main(["bench", "--workload", "decode", "--output-len", "24", "--modes", "bf16-bi", "--speculative",
                 "off,ngram", "--num-speculative-tokens", "3", "--no-progress", "--json", str(path)]) == 0
    plain, spec = json.loads(path.read_text())["results"]
    assert (plain["mode"], spec["mode"]) == ("bf16-bi", "bf16-bi+ngram")
    assert plain["output_tokens"] == spec["output_tokens"] == 24 and "speculative" not in plain
    assert spec["speculative"] == "ngram" and 0 <= spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]
    assert spec["spec_tokens_per_verification"] >= 1.0
    assert "spec_acceptance" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "decode", "--speculative", "eagle"])


@pytest.mark.parametrize("name, cls, layers", [("qwen3.5-2b-shape", "Qwen3_5ForCausalLM", 24),
                                               ("qwen3.5-35b-a3b-4l-shape", "Qwen3_5MoeForCausalLM", 4),
                                               ("qwen3-0.6b-shape", "Qwen3ForCausalLM", 28)])
def test_every_named_shape_writes_a_config_the_engine_builds(name, cls, layers):
    """--model NAME: the shape's config.json and tokenizer (nothing downloaded), and the engine's class for it."""
    from transformers import AutoConfig

    from fp8engine.bench import model_shapes
    from fp8engine.model_executor.models import model_class
    cfg = AutoConfig.from_pretrained(model_shapes.shape_path(name))
    assert (model_class(cfg).__name__, cfg.num_hidden_layers, cfg.vocab_size) == (cls, layers, 49152)
    if name == "qwen3.5-35b-a3b-4l-shape":  # the released block's experts and layer types
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.layer_types[3]) == (
            256, 8, 512, "full_attention")
