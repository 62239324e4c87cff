"""`fp8engine serve | generate | bench`."""

import argparse
import dataclasses
import json
import logging
import sys
import time

from fp8engine.config import EngineConfig
from fp8engine.entrypoints.limits import MAX_BODY_BYTES, MAX_UPDATE_BYTES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig option as a flag (--kv-cache-dtype fp8_e4m3, --quantization fp8, ...)."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=_parse_value, default=f.default)


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return None if text.lower() == "none" else text


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def cmd_generate(args: argparse.Namespace) -> int:
    from fp8engine.engine import LLMEngine
    from fp8engine.sampling_params import SamplingParams
    engine = LLMEngine(engine_config(args))
    prompts = [[{"role": "user", "content": p}] for p in args.prompt] or [
        [{"role": "user", "content": "What is 12 + 30? Answer briefly."}],
        [{"role": "user", "content": "Name a prime number larger than 10."}]]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed_sampling, logprobs=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = 0
    for out in outs:
        print(f"=== prompt {out.request_id}: {out.prompt_token_ids[-12:]} (weight_version {out.weight_version})")
        for c in out.outputs:
            tokens += len(c.token_ids)
            lps = ", ".join(f"{x:.3f}" for x in c.logprobs[:6])
            print(f"[{c.index}] {c.text!r}\n    finish={c.finish_reason} tokens={len(c.token_ids)} "
                  f"preemptions={c.num_preemptions} logprobs[:6]=[{lps}] "
                  f"sum={c.cumulative_logprob:.2f}")
    stats = engine.get_stats()
    print(f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s; preemptions total "
          f"{stats.num_preemptions_total}; KV {stats.num_kv_blocks_total} blocks "
          f"({stats.kv_cache_capacity_tokens} tokens, {stats.kv_cache_dtype}); linear {stats.linear_backend}, "
          f"attention {stats.attention_backend}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    if args.workload == "serve":
        from fp8engine.benchmarks import serve_load
        report = serve_load.run_side_by_side(concurrency=args.concurrency, num_requests=args.num_requests,
                                             max_tokens=args.max_tokens, model=args.model, dtype=args.dtype,
                                             engine_options=None, rounds=3)
        print(serve_load.format_table(report))
    elif args.workload == "sync":
        from fp8engine.benchmarks import weight_sync
        report = weight_sync.run(model=args.model, modes=modes)
        print(weight_sync.format_table(report))
    else:
        from fp8engine.benchmarks import throughput
        report = throughput.run(args.workload, modes, args.baseline, args.model, args.dtype, args.device,
                                progress=not args.no_progress, rounds=args.rounds)
        print(throughput.format_table(report))
        if args.plot:
            from fp8engine.benchmarks.plot import plot_report
            plot_report(report, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from fp8engine.entrypoints.server import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from chat prompts and print tokens, logprobs, preemptions")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[])
    gen.add_argument("--n", type=int, default=2)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--seed-sampling", type=int, default=0)
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="throughput / weight-sync benchmarks, modes side by side")
    bench.add_argument("--workload", default="quick",
                       choices=["quick", "decode", "rl-short", "rl-long", "sync", "serve"])
    bench.add_argument("--modes", default="bf16")
    bench.add_argument("--baseline", default=None, choices=["hf"])
    bench.add_argument("--model", default="default")
    bench.add_argument("--dtype", default="bfloat16")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--json", default=None)
    bench.add_argument("--plot", default=None)
    bench.add_argument("--rounds", type=int, default=1,
                       help="run every mode this many times in alternating order and report the median")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--concurrency", type=int, default=64, help="serve: concurrent streaming clients")
    bench.add_argument("--num-requests", type=int, default=200, help="serve: requests in all")
    bench.add_argument("--max-tokens", type=int, default=16, help="serve: tokens per request")
    bench.set_defaults(func=cmd_bench)
    serve = sub.add_parser("serve", help="OpenAI-compatible rollout server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--admin-key", default=None)
    serve.add_argument("--allowed-weight-dir", action="append", default=[])
    serve.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="limit for OpenAI requests")
    serve.add_argument("--max-update-bytes", type=int, default=MAX_UPDATE_BYTES,
                       help="limit for /update_weights bodies")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"fp8engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
