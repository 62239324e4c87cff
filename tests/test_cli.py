"""The command line: --help says what every option does and allows, bad values exit 2, sizes take units,
`generate` reads prompt files and writes JSON, and docs/cli.md's option table matches --help."""

import argparse
import dataclasses
import io
import json
import logging
import re
from pathlib import Path

import pytest

from fp8engine.bench.serve_load import _flags
from fp8engine.bench.throughput import MODES
from fp8engine.config import EngineConfig
from fp8engine.entrypoints import cli, options
from fp8engine.entrypoints.cli import build_parser, main
from fp8engine.entrypoints.options import OPTIONS, engine_config, format_size, parse_size
from fp8engine.entrypoints.server import ServerSettings
from fp8engine.model_executor.kernels.cpu_ops import cpu_kernel

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("serve", "generate", "bench")
SAMPLE_FIELDS = {"prompt_index", "sample_index", "text", "token_ids", "logprobs", "finish_reason",
                 "num_preemptions", "weight_version"}


def command_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def listed_actions(command: str) -> list[argparse.Action]:
    return [a for a in command_parser(command)._actions if not isinstance(a, argparse._HelpAction)]


def names(action: argparse.Action) -> tuple[str, ...]:
    return tuple(action.option_strings) or (action.metavar,)


def parse_exit(argv: list[str], capsys) -> tuple[int, str]:
    """argparse's exit status and what it printed."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    captured = capsys.readouterr()
    return exc.value.code, captured.out + captured.err


# ------------------------------------------------------------------ --help
@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_in_help_has_help_text_a_default_and_its_choices(command):
    text = command_parser(command).format_help()
    for action in listed_actions(command):
        assert len(action.help) > 20 and "(default: " in action.help, names(action)
        assert names(action)[0] in text
    choice_fields = {f.name: f.metadata["choices"] for f in dataclasses.fields(EngineConfig)
                     if f.metadata["choices"] is not None}
    by_dest = {a.dest: a for a in listed_actions(command)}
    for name, choices in choice_fields.items():
        if name in by_dest:  # the CLI offers exactly what EngineConfig validates
            assert by_dest[name].choices == choices
            assert "{%s}" % ",".join("none" if c is None else c for c in choices) in text
    if command == "bench":
        assert by_dest["workload"].choices == ("quick", "decode", "rl-short", "rl-long", "moe", "grpo", "sync", "serve",
                                               "soak")
        assert "{%s}[,...]" % ",".join(MODES) in text


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_grouped(command):
    titles = [g.title for g in command_parser(command)._action_groups if g._group_actions]
    expected = {"serve": ["model", "quantization and KV cache", "scheduling", "server", "RL (weight updates)"],
                "generate": ["model", "quantization and KV cache", "scheduling", "prompts", "sampling", "output"],
                "bench": ["model", "benchmark"]}[command]
    assert titles[1:] == expected  # titles[0] holds -h


def test_every_engine_config_field_is_a_flag_with_its_default():
    args = build_parser().parse_args(["serve"])
    assert engine_config(args) == EngineConfig()
    fp8 = build_parser().parse_args(["generate", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3",
                                     "--fp8-attention", "--no-enable-prefix-caching", "--max-model-len", "512"])
    assert engine_config(fp8) == EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_attention=True,
                                              enable_prefix_caching=False, max_model_len=512)
    assert build_parser().parse_args(["serve", "--quantization", "none"]).quantization is None


@pytest.mark.parametrize("argv,allowed", [
    (["generate", "--quantization", "fp9"], "(choose from none, fp8)"),
    (["serve", "--kv-cache-dtype", "fp16"], "(choose from auto, fp8_e4m3)"),
    (["serve", "--kv-scale-mode", "dynamic"], "(choose from recompute, external, static)"),
    (["bench", "--device", "tpu"], "(choose from auto, cpu, cuda)"),
    (["bench", "--workload", "huge"], "(choose from quick, decode, rl-short, rl-long, moe, grpo, sync, serve, soak)"),
    (["bench", "--modes", "bf16,fp4"], "from bf16, fp8-linear, fp8-kv, full-fp8, bf16-bi, "),
])
def test_a_bad_choice_exits_2_naming_the_allowed_values(argv, allowed, capsys):
    code, err = parse_exit(argv, capsys)
    assert code == 2
    assert f"argument {argv[1]}: invalid choice" in err and allowed in err


def test_version(capsys):
    code, out = parse_exit(["--version"], capsys)
    assert code == 0 and re.fullmatch(r"fp8engine \d+\.\d+\.\d+\n", out)


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GiB", 3 << 29), ("1e9", 10**9), ("1073741824", 1 << 30),
    ("64MB", 64 * 10**6), ("1KB", 1000), ("2 kib", 2048), ("100B", 100), ("0.5KiB", 512), ("2.5e3", 2500),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,message", [
    ("2XB", "unknown unit 'XB'"), ("2 GIGS", "unknown unit"), ("GiB", "not a number"), ("-1GiB", "not a number"),
    ("1..2GiB", "not a number"), ("", "not a number"), ("0", "less than one byte"), ("0.1B", "less than one"),
])
def test_parse_size_rejects_bad_sizes(text, message):
    with pytest.raises(ValueError, match=message):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (1 << 20, 2 << 30, 1536 << 10, 1000)] == ["1 MiB", "2 GiB", "1536 KiB", "1000"]


def test_size_flags_take_units_and_keep_their_byte_spellings(capsys):
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--max-body-size", "64MiB",
                                      "--max-update-bytes", "1e9"])
    sizes = (args.kv_cache_memory_bytes, args.max_body_bytes, args.max_update_bytes)
    assert sizes == (2 << 30, 64 << 20, 10**9)
    assert engine_config(args).kv_cache_memory_bytes == 2 << 30
    assert build_parser().parse_args(["generate", "--kv-cache-memory-bytes", "1000"]).kv_cache_memory_bytes == 1000
    code, err = parse_exit(["serve", "--max-body-size", "64Mb/s"], capsys)
    assert code == 2 and "argument --max-body-size/--max-body-bytes: size '64Mb/s' is not a number" in err


def test_the_flags_the_server_tests_and_benchmarks_pass_still_parse():
    args = build_parser().parse_args([
        "serve", "--api-key", "k", "--admin-key", "a", "--allowed-weight-dir", "/w1",
        "--allowed-weight-dir", "/w2", "--dtype", "float32", "--num-kv-blocks", "64", "--port", "8123",
        *_flags({"quantization": "fp8", "enable_prefix_caching": False})])
    assert ServerSettings.from_args(args) == ServerSettings(port=8123, api_key="k", admin_key="a",
                                                            allowed_weight_dirs=("/w1", "/w2"))
    assert engine_config(args) == EngineConfig(dtype="float32", num_kv_blocks=64, quantization="fp8",
                                               enable_prefix_caching=False)
    rl = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", str(64 << 20)])
    assert rl.kv_cache_memory_bytes == 64 << 20


def test_generate_keeps_its_prompt_spellings():
    args = build_parser().parse_args(["generate", "Hi there", "--prompt", "Bye", "--n", "2", "--max-tokens", "48"])
    assert (args.prompts, args.prompt, args.prompts_file, args.output) == (["Hi there"], ["Bye"], None, "text")
    assert build_parser().parse_args(["generate", "--jsonl"]).output == "jsonl"


# ------------------------------------------------------------------ prompts files
def test_load_prompts_reads_lines_or_json_lines(tmp_path):
    from fp8engine.entrypoints.cli import load_prompts
    plain = tmp_path / "plain.txt"
    plain.write_text("What is 1+1?\n\nName a colour.\n")
    assert load_prompts(str(plain)) == [[{"role": "user", "content": "What is 1+1?"}],
                                        [{"role": "user", "content": "Name a colour."}]]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "raw"}\n{"prompt": [1, 2]}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    assert load_prompts(str(jsonl)) == ["raw", [1, 2], [{"role": "user", "content": "x"}]]


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\n{"text": "b"}\n', r"p:2: a JSON line needs exactly one of 'prompt'"),
    ('{"prompt": "a", "messages": []}\n', "p:1: a JSON line needs exactly one"),
    ('{"prompt": "a"}\n{oops\n', r"p:2: not a JSON object"),
    ("\n\n", "no prompts in"),
])
def test_a_bad_prompts_file_exits_2_before_loading_the_model(tmp_path, monkeypatch, capsys, content, message):
    (tmp_path / "p").write_text(content)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "start_engine", lambda args: pytest.fail("loaded the model"))
    assert main(["generate", "--prompts-file", "p"]) == 2
    assert re.search(message, capsys.readouterr().err)


# ------------------------------------------------------------------ generate, on the default model
def test_generate_jsonl_round_trips_with_the_documented_fields(tmp_path, capsys, caplog):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n{"prompt": [1, 2, 3, 4]}\n'
                       '{"messages": [{"role": "user", "content": "Say hi."}]}\n')
    with caplog.at_level(logging.INFO, logger=options.__name__):
        assert main(["generate", "--prompts-file", str(prompts), "--jsonl", "--n", "2", "--max-tokens", "3",
                     "--num-kv-blocks", "64"]) == 0
    samples = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    indices = [(s["prompt_index"], s["sample_index"]) for s in samples]
    assert indices == [(p, i) for p in range(3) for i in range(2)]
    for s in samples:
        assert set(s) == SAMPLE_FIELDS
        assert 1 <= len(s["token_ids"]) <= 3 and all(type(t) is int for t in s["token_ids"])
        assert len(s["logprobs"]) == len(s["token_ids"])
        assert all(type(x) is float and x <= 0 for x in s["logprobs"])
        assert s["finish_reason"] in {"stop", "length"} and isinstance(s["text"], str)
        assert (s["num_preemptions"], s["weight_version"]) == (0, 0)
    line = caplog.records[-1].getMessage()
    assert line.startswith("fp8engine: default model (") and "KV cache: 1,024 tokens (64 blocks of 16" in line
    assert re.search(r"linear layers: bfloat16 via .+ \[\S+\]; attention: bfloat16 via .+ \[\S+\]", line)
    assert re.search(r"decoder layers: .+ \[(cpp-plan|python)\]; KV cache", line)


def test_generate_json_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 1+1?\nName a colour.\n"))
    assert main(["generate", "--prompts-file", "-", "--json", "--n", "1", "--max-tokens", "2",
                 "--temperature", "0", "--num-kv-blocks", "64"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["prompt_index"], s["sample_index"]) for s in doc["samples"]] == [(0, 0), (1, 0)]
    plan = cpu_kernel("decoder_plan_supported")  # the decoder plan where its ops are built (csrc/decoder.cpp)
    assert doc["summary"]["num_prompts"] == 2
    assert doc["summary"]["decoder_backend"] == ("cpp-plan" if plan is not None and plan() else "python")
    assert doc["summary"]["num_generated_tokens"] == sum(len(s["token_ids"]) for s in doc["samples"])


# ------------------------------------------------------------------ docs/cli.md
def readme_rows() -> dict[tuple[str, tuple[str, ...]], tuple[str, str]]:
    """(command, option names) -> (default, values) from docs/cli.md's option table."""
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text.split("<!-- cli-options:", 1)[1].split("\n", 1)[1].split("<!-- /cli-options -->")[0]
    assert table == options.markdown_table(), "docs/cli.md's option table is stale: paste options.markdown_table()"
    rows = {}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        flags = tuple(re.findall(r"`([^`]+)`", cells[0]))
        values = re.match(r"`([^`]+)`", cells[3])
        for command in cells[1].split(", "):
            rows[command, flags] = (cells[2].strip("`"), values[1] if values and "size" not in cells[3] else "-")
    return rows


def help_rows(command: str) -> dict[tuple[str, tuple[str, ...]], tuple[str, str]]:
    """The same, from what `fp8engine COMMAND --help` prints."""
    rows = {}
    for action in listed_actions(command):
        default = re.search(r"\(default: (.*)\)$", action.help)[1]
        choices = re.fullmatch(r"\{(.*)\}(\[,\.\.\.\])?", action.metavar or "")
        rows[command, names(action)] = (default, choices[1] if choices else "-")
    return rows


def test_readme_option_table_matches_help():
    readme = readme_rows()
    for command in COMMANDS:
        assert {k: v for k, v in readme.items() if k[0] == command} == help_rows(command)
    assert len(readme) == sum(len(o.commands) for o in OPTIONS)
