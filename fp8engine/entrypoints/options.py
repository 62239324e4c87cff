"""Every command-line option in one table, shared by `fp8engine serve | generate | bench`.

The engine's options come from EngineConfig's fields (type, default, allowed values and help from
the field metadata); the server's, `generate`'s and `bench`'s own options are listed below. `--help`,
docs/cli.md's option table and the EngineConfig the server builds all read this table.
"""

import argparse
import dataclasses
import logging
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from fp8engine.bench.workloads import (
    BASELINES,
    IN_FLIGHT_POLICIES,
    MODES,
    PROMPT_KINDS,
    SPECULATIVE_RUNS,
    WORKLOADS,
)
from fp8engine.config import EngineConfig
from fp8engine.entrypoints.limits import LOGPROBS_MODES, MAX_BODY_BYTES, MAX_UPDATE_BYTES
from fp8engine.tools import PARSERS

logger = logging.getLogger(__name__)

GROUPS = {"model": "model", "kv": "quantization and KV cache", "scheduling": "scheduling",
          "server": "server", "rl": "RL (weight updates)", "prompts": "prompts", "sampling": "sampling",
          "output": "output", "bench": "benchmark"}
ENGINE_GROUPS = {"model": "model", "dtype": "model", "device": "model", "seed": "model", "load_format": "model",
                 "quantization": "kv", "fp8_scale_fmt": "kv", "kv_cache_dtype": "kv", "kv_scale_mode": "kv",
                 "kv_scale_margin": "kv", "fp8_attention": "kv", "block_size": "kv",
                 "kv_cache_memory_bytes": "kv", "num_kv_blocks": "kv", "state_memory_fraction": "kv",
                 "max_num_seqs": "scheduling",
                 "max_num_batched_tokens": "scheduling", "max_model_len": "scheduling",
                 "enable_prefix_caching": "scheduling", "batch_invariant": "kv", "lm_head_fp32": "kv",
                 "lm_head_fp8": "kv",
                 "speculative": "scheduling", "num_speculative_tokens": "scheduling",
                 "speculative_forget_on_update": "scheduling", "max_lora_rank": "model", "enforce_eager": "model",
                 "async_scheduling": "scheduling",
                 "sleep_spill_dir": "model", "tensor_parallel_size": "model", "expert_parallel": "model"}
BENCH_ENGINE_OPTIONS = ("model", "dtype", "device")  # --modes sets the rest per mode, --speculative takes a list
COMMANDS = ("serve", "generate", "bench")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+\.?\d*(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "1.5GiB", "512MiB", "64MB", "1e9" or "1073741824".

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024 (case-insensitive); a plain
    number is bytes. Fractions of a byte are dropped."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"size {text!r} is not a number with an optional unit (e.g. 2GiB, 512MiB, 1e9)")
    unit = match[2].lower()
    if unit not in _UNITS:
        raise ValueError(f"size {text!r} has an unknown unit {match[2]!r}; use B, KB, MB, GB, TB, "
                         f"KiB, MiB, GiB or TiB")
    size = int(Decimal(match[1]) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return size


def format_size(num_bytes: int) -> str:
    """The largest binary unit that shows `num_bytes` exactly ("2 GiB", "1536 KiB"), else bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale} {unit}"
    return str(num_bytes)


@dataclass(frozen=True, slots=True)
class Option:
    """One flag (or positional argument) as argparse takes it, plus where it shows up.

    flags: the name first, then aliases; empty for a positional argument named by metavar.
    choices: the allowed values; with `many`, the value is a comma-separated list of them.
    """

    flags: tuple[str, ...]
    dest: str
    group: str
    commands: tuple[str, ...]
    help: str
    default: object = None
    convert: Callable[[str], object] | None = None  # argparse's type
    choices: tuple | None = None
    many: bool = False
    size: bool = False
    action: str | type[argparse.Action] | None = None
    const: object = None
    nargs: str | None = None
    metavar: str | None = None
    exclusive: bool = False  # excludes the other `exclusive` options of its group

    def names(self) -> tuple[str, ...]:
        """What --help lists: the flags (both spellings of an on/off flag), or a positional's metavar."""
        if self.action is argparse.BooleanOptionalAction:
            return (*self.flags, *("--no-" + flag[2:] for flag in self.flags))
        return self.flags or (self.metavar,)

    def show_default(self) -> str:
        if self.action in ("store_true", "store_const"):
            return "off"
        return show_value(self.default, self.size)

    def show_choices(self) -> str | None:
        return None if self.choices is None else ",".join(show_value(c) for c in self.choices)

    def add_to(self, parser: argparse._ActionsContainer) -> argparse.Action:
        kwargs = {k: getattr(self, k) for k in ("default", "action", "const", "nargs", "metavar")
                  if getattr(self, k) is not None}
        if self.convert is not None:
            kwargs["type"] = self.convert
            kwargs.setdefault("metavar", {"int": "N", "float": "X"}.get(self.convert.__name__))
        if self.choices is not None:
            kwargs["type"] = (_choice_list if self.many else _choice)(self.choices)
            kwargs["metavar"] = "{%s}%s" % (self.show_choices(), "[,...]" if self.many else "")
            if not self.many:
                kwargs["choices"] = self.choices
        args = self.flags or (self.dest,)
        if self.flags:
            kwargs["dest"] = self.dest
        action = parser.add_argument(*args, **kwargs)
        action.help = f"{self.help} (default: {self.show_default()})".replace("%", "%%")
        return action


def show_value(value, size: bool = False) -> str:
    """How --help and docs/cli.md write a default or an allowed value."""
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return format_size(value) if size else str(value)


def _argument_type(parse: Callable, name: str, optional: bool = False) -> Callable[[str], object]:
    """parse() as an argparse type: its ValueError message becomes argparse's, "none" means None."""
    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return parse(text)
        except ValueError as exc:
            if parse in (int, float):
                raise  # argparse words these itself: "invalid int value: 'x'"
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def _choice(choices: tuple) -> Callable[[str], object]:
    def parse(text: str):
        for choice in choices:
            if text == show_value(choice):
                return choice
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(map(show_value, choices))})")
    return _argument_type(parse, "choice")


def _choice_list(choices: tuple) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise ValueError(f"invalid choice {','.join(bad) or text!r} (choose one or more, "
                             f"comma-separated, from {', '.join(choices)})")
        return values
    return _argument_type(parse, "choice list")


def _int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or not all(re.fullmatch(r"[+-]?\d+", v) for v in values):
        raise ValueError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2)")
    return [int(v) for v in values]


def _engine_option(f: dataclasses.Field) -> Option:
    flag = "--" + f.name.replace("_", "-")
    optional = isinstance(f.type, types.UnionType) and type(None) in f.type.__args__
    base = next(t for t in f.type.__args__ if t is not type(None)) if optional else f.type
    commands = COMMANDS if f.name in BENCH_ENGINE_OPTIONS else ("serve", "generate")
    common = dict(dest=f.name, group=ENGINE_GROUPS[f.name], commands=commands, help=f.metadata["help"],
                  default=f.default)
    if base is bool:
        return Option((flag,), action=argparse.BooleanOptionalAction, **common)
    if f.metadata["choices"] is not None:
        return Option((flag,), choices=f.metadata["choices"], **common)
    if f.metadata["unit"] == "bytes":
        return Option((flag.removesuffix("-bytes"), flag), convert=_argument_type(parse_size, "size", optional),
                      size=True, metavar="SIZE", **common)
    return Option((flag,), convert=_argument_type(base, base.__name__, optional) if optional else base, **common)


def _size_option(flag: str, dest: str, group: str, default: int, help: str) -> Option:
    return Option((flag, "--" + dest.replace("_", "-")), dest, group, ("serve",), help, default,
                  _argument_type(parse_size, "size"), size=True, metavar="SIZE")


_GENERATE = ("generate",)
OPTIONS: tuple[Option, ...] = (
    *(_engine_option(f) for f in dataclasses.fields(EngineConfig)),
    Option(("--host",), "host", "server", ("serve",), "address to listen on", "127.0.0.1"),
    Option(("--port",), "port", "server", ("serve",), "port to listen on", 8000, int),
    Option(("--api-key",), "api_key", "server", ("serve",),
           "require `Authorization: Bearer KEY` on every endpoint but /health", metavar="KEY"),
    _size_option("--max-body-size", "max_body_bytes", "server", MAX_BODY_BYTES,
                 "largest OpenAI request body, e.g. 64MiB"),
    Option(("--shutdown",), "shutdown", "server", ("serve",), "on SIGTERM/SIGINT the server stops accepting "
           "requests, lets in-flight ones finish (wait) or aborts them (abort), and exits 0", "wait",
           choices=("wait", "abort")),
    Option(("--clamp-max-tokens",), "clamp_max_tokens", "server", ("serve",),
           "cut max_tokens to what the context has left instead of answering 400 when prompt + max_tokens "
           "exceeds it", False, action="store_true"),
    Option(("--tool-call-parser",), "tool_call_parser", "server", ("serve",),
           "how tool calls are read from the model's replies (tools.py); default: by the chat template "
           "(llama3_json for Llama 3 templates, else hermes)", None, choices=PARSERS),
    Option(("--logprobs-mode",), "logprobs_mode", "rl", ("serve",),
           "the logprobs a request gets when it does not name logprobs_mode: raw (the model's log-softmax) or "
           "processed (under the distribution sampled from, which importance-sampling correction needs); vLLM's "
           "raw_logprobs / processed_logprobs are the same; none: each API's own (raw on /v1/* and vLLM's "
           "routes, as vLLM; processed on SGLang's /generate but at temperature 0)", None, choices=LOGPROBS_MODES),
    Option(("--admin-key",), "admin_key", "rl", ("serve",),
           "key for the RL endpoints (weight updates, pause, flush); none = the api key", metavar="KEY"),
    Option(("--allowed-weight-dir",), "allowed_weight_dir", "rl", ("serve",),
           "directory /update_weights_from_disk may read from (repeatable)", [], action="append",
           metavar="DIR"),
    _size_option("--max-update-size", "max_update_bytes", "rl", MAX_UPDATE_BYTES,
                 "largest /update_weights body (one safetensors file or bucket)"),
    Option(("--bucket-timeout",), "bucket_timeout", "rl", ("serve",),
           "seconds a bucketed /update_weights may wait for its next bucket before it is dropped", 600.0, float),
    Option((), "prompts", "prompts", _GENERATE, "prompt, sent as a user chat message; with no prompts "
           "at all, two built-in questions", [], nargs="*", metavar="PROMPT"),
    Option(("--prompt",), "prompt", "prompts", _GENERATE, "one more prompt like PROMPT (repeatable)", [],
           action="append"),
    Option(("--prompts-file",), "prompts_file", "prompts", _GENERATE,
           "read prompts from FILE ('-' = stdin): one chat message per line, or JSON lines with 'prompt' "
           "(raw text or token ids, no chat template) or 'messages' (chat)", metavar="FILE"),
    Option(("--n",), "n", "sampling", _GENERATE, "samples per prompt", 2, int),
    Option(("--temperature",), "temperature", "sampling", _GENERATE, "sampling temperature; 0 = greedy",
           1.0, float),
    Option(("--top-p",), "top_p", "sampling", _GENERATE, "nucleus sampling: keep the smallest set of "
           "tokens with this much probability", 1.0, float),
    Option(("--max-tokens",), "max_tokens", "sampling", _GENERATE, "most tokens generated per sample", 48, int),
    Option(("--seed-sampling",), "seed_sampling", "sampling", _GENERATE,
           "sampling seed (noise of sample i at position p = hash(seed, i, p)); none = drawn from --seed", 0,
           _argument_type(int, "int", optional=True)),
    Option(("--json",), "output", "output", _GENERATE, "print one JSON document: {samples: [...], "
           "summary: {...}}", "text", action="store_const", const="json", exclusive=True),
    Option(("--jsonl",), "output", "output", _GENERATE, "print one JSON line per sample (prompt_index, "
           "sample_index, text, token_ids, logprobs, finish_reason, num_preemptions, weight_version)",
           "text", action="store_const", const="jsonl", exclusive=True),
    Option(("--workload",), "workload", "bench", ("bench",), "what to run: a throughput workload, weight "
           "sync (sync), the server under load (serve) or a long mixed load with weight updates, disconnects "
           "and cache flushes (soak)", "quick", choices=(*WORKLOADS, "sync", "serve", "soak")),
    Option(("--modes",), "modes", "bench", ("bench",), "engine modes, run side by side", "bf16",
           choices=tuple(MODES), many=True),
    Option(("--speculative",), "speculative_list", "bench", ("bench",), "throughput workloads: speculative "
           "decoding off or with these draft sources, each beside every mode", "off", choices=SPECULATIVE_RUNS,
           many=True),
    Option(("--num-speculative-tokens",), "num_speculative_tokens", "bench", ("bench",), "--speculative: most "
           "draft tokens a sequence verifies in one step", 4, int),
    Option(("--num-prompts",), "num_prompts", "bench", ("bench",), "throughput workloads: prompts in the batch; "
           "none = the workload's", convert=int),
    Option(("--n",), "n", "bench", ("bench",), "throughput workloads: samples per prompt; none = the workload's",
           convert=int),
    Option(("--prompts",), "prompt_kind", "bench", ("bench",), "throughput workloads: chat (arithmetic word "
           "problems, each its own length) or random (seeded random token ids, --input-len of them, no special "
           "tokens)", "chat", choices=PROMPT_KINDS),
    Option(("--input-len",), "input_len", "bench", ("bench",), "--prompts random: prompt tokens", convert=int),
    Option(("--output-len",), "output_len", "bench", ("bench",), "throughput workloads: output tokens per sample "
           "(max_tokens, EOS ignored); none = the workload's", convert=int),
    Option(("--threads",), "threads", "bench", ("bench",), "throughput workloads: torch threads of the engine "
           "runs and the baselines (with --replicas: per replica); none = torch's default (with --replicas: "
           "that over the largest count)", convert=int),
    Option(("--baseline",), "baseline", "bench", ("bench",), "baselines run on the same shape after the modes: "
           "Hugging Face generate (hf), llama.cpp's llama-batched-bench (llama.cpp; needs --gguf and --llama-bin), "
           "vLLM in its own venv (vllm; needs --vllm-python)", choices=BASELINES, many=True),
    Option(("--gguf",), "gguf", "bench", ("bench",), "--baseline llama.cpp: the model as a GGUF file",
           metavar="FILE"),
    Option(("--llama-bin",), "llama_bin", "bench", ("bench",), "--baseline llama.cpp: the directory holding "
           "llama-batched-bench (or its bin/), from a llama.cpp build", metavar="DIR"),
    Option(("--vllm-python",), "vllm_python", "bench", ("bench",), "--baseline vllm: the python of a venv with "
           "vLLM's CPU build (make bench-baselines builds one)", metavar="PATH"),
    Option(("--replicas",), "replicas", "bench", ("bench",), "throughput workloads: run through RolloutCluster "
           "(Ray) with each of these replica counts of --threads threads, side by side, the first of --modes",
           convert=_argument_type(_int_list, "int list"), metavar="K[,K...]"),
    Option(("--update-every",), "update_every", "bench", ("bench",), "throughput workloads: prompt groups "
           "streamed in and a weight update every N engine steps, the --in-flight policies side by side on the "
           "first of --modes", convert=int, metavar="N"),
    Option(("--in-flight",), "in_flight", "bench", ("bench",), "--update-every: what each update does to the "
           "requests in flight (none: no update, the reference the stalls are measured against)",
           ",".join(IN_FLIGHT_POLICIES), choices=IN_FLIGHT_POLICIES, many=True),
    Option(("--json",), "json", "bench", ("bench",), "write the report to FILE as JSON", metavar="FILE"),
    Option(("--plot",), "plot", "bench", ("bench",), "draw the report into FILE (PNG)", metavar="FILE"),
    Option(("--rounds",), "rounds", "bench", ("bench",), "run every mode (or replica count), and the baseline, "
           "this many times in alternating order and report the median (with a baseline, also each round's best "
           "mode / best peer)", 1, int),
    Option(("--interleave",), "interleave", "bench", ("bench",), "time the modes of a round together, N engine "
           "steps each in turn (the order reversing every turn), so that the machine's slow spells land on every "
           "mode alike; 0: each mode's run whole, one after the other", 0, int, metavar="N"),
    Option(("--no-progress",), "no_progress", "bench", ("bench",), "no progress bars", False,
           action="store_true"),
    Option(("--concurrency", "--clients"), "concurrency", "bench", ("bench",),
           "serve, soak: concurrent streaming clients", 64, int),
    Option(("--minutes",), "minutes", "bench", ("bench",), "soak: minutes of load, fractions allowed (then a "
           "drain)", 10.0, float),
    Option(("--num-requests",), "num_requests", "bench", ("bench",), "serve: requests in all", 200, int),
    Option(("--max-tokens",), "max_tokens", "bench", ("bench",), "serve: tokens per request", 16, int),
)


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of `command`, in their --help groups."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(GROUPS[opt.group])
        target = groups[opt.group]
        if opt.exclusive:
            if opt.group not in exclusive:
                exclusive[opt.group] = target.add_mutually_exclusive_group()
            target = exclusive[opt.group]
        opt.add_to(target)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def markdown_table() -> str:
    """docs/cli.md's table of every option: a row per option under a bold row per --help group."""
    lines = ["| option | commands | default | values | what it does |", "|---|---|---|---|---|"]
    for group, title in GROUPS.items():
        lines.append(f"| **{title}** | | | | |")
        for opt in (o for o in OPTIONS if o.group == group):
            names = " ".join(f"`{name}`" for name in opt.names())
            values = "-" if opt.choices is None else f"`{opt.show_choices()}`" + (" (a list)" if opt.many else "")
            values = "size: `2GiB`, `512MB`, `1e9`" if opt.size else values
            lines.append(f"| {names} | {', '.join(opt.commands)} | `{opt.show_default()}` | {values} | "
                         f"{opt.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


LINEAR_BACKENDS = {
    "cpp-bf16-gemv+torch": "a C++ GEMV for up to 4 rows (decode), torch's GEMM above",
    "cpp-bf16-gemv+amx+torch": "a C++ GEMV for 1 row, the C++ GEMM on AMX tiles up to 256 rows, torch's GEMM above",
    "cpp-bf16-amx": "the C++ BF16 GEMM on AMX tiles for every batch size (batch invariant)",
    "cpp-bf16-avx512": "the C++ BF16 GEMM on AVX-512 BF16 for every batch size (batch invariant)",
    "cpp-bf16-avx2": "the C++ BF16 kernel on AVX2 + FMA for every batch size (batch invariant)",
    "torch-bf16-fixed-chunks": "torch's GEMM fed fixed 64-row chunks (batch invariant)",
    "torch": "torch's matmul",
    "cpp-amx": "the C++ FP8 kernel (AMX tiles)",
    "cpp-avx512bf16": "the C++ FP8 kernel (AVX-512 BF16 dot products)",
    "cpp-avx2": "the C++ FP8 kernel (AVX2 + FMA, one kernel for every batch size: batch invariant)",
    "cpp-scalar": "the C++ FP8 kernel (scalar)",
    "torch-reference": "the plain-torch FP8 reference (no C++ kernel built)",
    "triton": "the Triton FP8 kernel",
    "deepgemm": "DeepGEMM",
}
ATTENTION_BACKENDS = {"cpp": "the C++ paged-attention kernel", "triton": "the Triton paged-attention kernel",
                      "torch": "the plain-torch paged-attention reference"}
DECODER_BACKENDS = {"cpp-plan": "one C++ call a step (the same ops as the Python layers)",
                    "cpp-plan-decode": "one C++ call a decode step, the Python layers for the others (the same ops)",
                    "python": "the Python layers, op by op"}


def start_engine(args: argparse.Namespace):
    """An LLMEngine from the parsed options, after logging one line that says what runs."""
    from fp8engine.engine import LLMEngine
    engine = LLMEngine(engine_config(args))
    logger.info("%s", startup_line(engine))
    return engine


def startup_line(engine) -> str:
    """What runs, in words: the model, the linear and attention kernels, the KV capacity in tokens and GiB."""
    config, stats = engine.config, engine.get_stats()
    model = os.path.basename(os.path.normpath(engine.model_dir))
    model = f"default model ({model})" if config.model == "default" else model
    weights = "FP8 W8A8" if config.quantization == "fp8" else config.dtype
    kv = "fp8_e4m3" if config.kv_is_fp8 else config.dtype
    attention = "FP8" if config.fp8_attention else config.dtype
    linear_words = LINEAR_BACKENDS.get(stats.linear_backend, stats.linear_backend)
    attention_words = ATTENTION_BACKENDS.get(stats.attention_backend, stats.attention_backend)
    return (f"fp8engine: {model} on {stats.device}; linear layers: {weights} via {linear_words} "
            f"[{stats.linear_backend}]; attention: {attention} via {attention_words} [{stats.attention_backend}]; "
            f"decoder layers: {DECODER_BACKENDS.get(stats.decoder_backend, stats.decoder_backend)} "
            f"[{stats.decoder_backend}]; "
            f"KV cache: {stats.kv_cache_capacity_tokens:,} tokens ({stats.num_kv_blocks_total} blocks of "
            f"{config.block_size}, {kv}) in {engine.runner.kv_cache.nbytes / 2**30:.2f} GiB")
