"""`fp8engine serve | generate | bench`; the options themselves are in options.py."""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import fp8engine
from fp8engine.entrypoints.options import add_options, start_engine

DEFAULT_PROMPTS = ("What is 12 + 30? Answer briefly.", "Name a prime number larger than 10.")


def cmd_generate(args: argparse.Namespace) -> int:
    from fp8engine.sampling_params import SamplingParams
    prompts = [_chat(p) for p in [*args.prompts, *args.prompt]]
    if args.prompts_file is not None:
        prompts += load_prompts(args.prompts_file)
    prompts = prompts or [_chat(p) for p in DEFAULT_PROMPTS]
    engine = start_engine(args)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed_sampling, logprobs=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    samples = [sample_record(i, out, c) for i, out in enumerate(outs) for c in out.outputs]
    stats = engine.get_stats()
    tokens = sum(len(s["token_ids"]) for s in samples)
    summary = dict(num_prompts=len(outs), num_samples=len(samples), num_generated_tokens=tokens,
                   seconds=seconds, output_tok_s=tokens / seconds,
                   num_preemptions_total=stats.num_preemptions_total,
                   kv_cache_capacity_tokens=stats.kv_cache_capacity_tokens, kv_cache_dtype=stats.kv_cache_dtype,
                   linear_backend=stats.linear_backend, attention_backend=stats.attention_backend,
                   decoder_backend=stats.decoder_backend)
    if args.output == "json":
        print(json.dumps({"samples": samples, "summary": summary}, indent=2))
    elif args.output == "jsonl":
        for sample in samples:
            print(json.dumps(sample))
    else:
        _print_text(outs, summary)
    return 0


def sample_record(prompt_index: int, out, sample) -> dict:
    """One sample of `generate --json/--jsonl`."""
    return {"prompt_index": prompt_index, "sample_index": sample.index, "text": sample.text,
            "token_ids": sample.token_ids, "logprobs": sample.logprobs, "finish_reason": sample.finish_reason,
            "num_preemptions": sample.num_preemptions, "weight_version": out.weight_version}


def load_prompts(path: str) -> list:
    """Prompts from a file ("-" = stdin): one chat message per line, or, when the first line is a JSON
    object, one JSON object per line with "prompt" (raw text or token ids) or "messages" (chat)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"no prompts in {path!r}")
    if not lines[0][1].lstrip().startswith("{"):
        return [_chat(line) for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ValueError(f"{path}:{number}: a JSON line needs exactly one of 'prompt' (text or token ids) "
                             f"and 'messages' (chat)")
        prompts.append(record["prompt"] if "prompt" in record else record["messages"])
    return prompts


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _print_text(outs, summary: dict) -> None:
    for out in outs:
        print(f"=== prompt {out.request_id}: {out.prompt_token_ids[-12:]} (weight_version {out.weight_version})")
        for c in out.outputs:
            lps = ", ".join(f"{x:.3f}" for x in c.logprobs[:6])
            print(f"[{c.index}] {c.text!r}\n    finish={c.finish_reason} tokens={len(c.token_ids)} "
                  f"preemptions={c.num_preemptions} logprobs[:6]=[{lps}] "
                  f"sum={c.cumulative_logprob:.2f}")
    s = summary
    print(f"{s['num_generated_tokens']} tokens in {s['seconds']:.2f} s = {s['output_tok_s']:.1f} tok/s; "
          f"preemptions total {s['num_preemptions_total']}; KV {s['kv_cache_capacity_tokens']} tokens "
          f"({s['kv_cache_dtype']}); linear {s['linear_backend']}, attention {s['attention_backend']}, "
          f"decoder {s['decoder_backend']}")


# flags that shape or extend a throughput workload, and mean nothing to sync, serve and soak
THROUGHPUT_FLAGS = {"num_prompts": "--num-prompts", "n": "--n", "input_len": "--input-len",
                    "output_len": "--output-len", "threads": "--threads", "replicas": "--replicas",
                    "gguf": "--gguf", "llama_bin": "--llama-bin", "vllm_python": "--vllm-python",
                    "update_every": "--update-every"}


def cmd_bench(args: argparse.Namespace) -> int:
    from fp8engine.bench.workloads import WORKLOADS
    given = [flag for dest, flag in THROUGHPUT_FLAGS.items() if getattr(args, dest) is not None]
    if args.workload not in WORKLOADS and given:
        raise ValueError(f"{', '.join(given)}: for the throughput workloads ({', '.join(WORKLOADS)}), "
                         f"not --workload {args.workload}")
    if args.workload == "serve":
        from fp8engine.bench import serve_load
        report = serve_load.run_side_by_side(concurrency=args.concurrency, num_requests=args.num_requests,
                                             max_tokens=args.max_tokens, model=args.model, dtype=args.dtype,
                                             engine_options=None, rounds=3)
        print(serve_load.format_table(report))
    elif args.workload == "soak":
        from fp8engine.bench import soak
        report = soak.run(soak.SoakConfig(minutes=args.minutes, clients=args.concurrency, model=args.model,
                                          dtype=args.dtype, device=args.device))
        print(soak.format_table(report))
    elif args.workload == "sync":
        from fp8engine.bench import weight_sync
        report = weight_sync.run(model=args.model, modes=args.modes)
        print(weight_sync.format_table(report))
    else:
        report = bench_throughput(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def bench_throughput(args: argparse.Namespace) -> dict:
    """A throughput workload in the shape the flags give: engine modes side by side (and baselines), or
    with --replicas the first mode through RolloutCluster at each replica count."""
    from fp8engine.bench import throughput
    spec = throughput.shaped(args.workload, args.num_prompts, args.n, args.input_len, args.output_len,
                             args.prompt_kind)
    if args.interleave and (args.update_every is not None or args.replicas is not None):
        raise ValueError("--interleave times engine modes side by side; it takes neither --update-every nor "
                         "--replicas")
    if args.update_every is not None:
        if args.replicas is not None or args.baseline is not None or args.plot:
            raise ValueError("--update-every compares --in-flight policies of one mode; it takes neither "
                             "--replicas, --baseline nor --plot")
        from fp8engine.bench import in_flight
        report = in_flight.run(spec, args.modes[0], args.update_every, args.in_flight, args.model, args.dtype,
                               args.device, threads=args.threads)
        print(in_flight.format_table(report))
        return report
    if args.replicas is not None:
        if args.baseline is not None or args.plot:
            raise ValueError("--replicas compares replica counts of one mode; it takes neither --baseline nor --plot")
        from fp8engine.bench import replicas
        report = replicas.run(spec, args.modes[0], args.replicas, args.model, args.dtype, args.device,
                              threads=args.threads, rounds=args.rounds)
        print(replicas.format_table(report))
        return report
    report = throughput.run(spec, args.modes, args.baseline, args.model, args.dtype, args.device,
                            progress=not args.no_progress, rounds=args.rounds, threads=args.threads,
                            gguf=args.gguf, llama_bin=args.llama_bin, vllm_python=args.vllm_python,
                            speculative=args.speculative_list, num_speculative_tokens=args.num_speculative_tokens,
                            interleave=args.interleave)
    print(throughput.format_table(report))
    if args.plot:
        from fp8engine.bench.plot import plot_report
        plot_report(report, args.plot)
    return report


def cmd_serve(args: argparse.Namespace) -> int:
    from fp8engine.entrypoints.server import serve
    return serve(args)


COMMAND_HELP = {
    "serve": (cmd_serve, "OpenAI-compatible rollout server with the RL endpoints"),
    "generate": (cmd_generate, "generate from prompts; print text, tokens, logprobs and preemptions, or JSON"),
    "bench": (cmd_bench, "throughput / weight-sync / server / soak benchmarks, engine modes side by side"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8engine", description="A paged-attention LLM inference engine "
                                     "for RL rollouts. `fp8engine COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"fp8engine {fp8engine.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (func, help) in COMMAND_HELP.items():
        command_parser = sub.add_parser(command, help=help, description=help)
        add_options(command_parser, command)
        command_parser.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    logging.getLogger("fp8engine.engine").setLevel(logging.WARNING)  # start_engine logs a fuller line
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"fp8engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
