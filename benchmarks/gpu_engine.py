"""The engine on the device: `make gpu-check`'s engine part (benchmarks/gpu_check.py calls it first), and its dry run
on the CPU (the CUDA path under tests/fake_cuda.py, Triton on the interpreter, a tiny model), which CI runs so that a
device run does not start by finding a typo.

Everything is built from configs, nothing downloaded: a word-level tokenizer over the model's vocabulary, a
random model of the default model's shape (a checkpoint written once, so the GPU engine and the CPU reference load
the same weights), and an 8B-shaped Llama with random weights drawn on the device (load_format="dummy").

Checks (each `ok` or not, with its figures): teacher-forced logprobs against the CPU engine (float32); seeded
sampling that repeats; update_weights in place (every data_ptr kept) with KV recalibration, equal to a fresh engine
given the new weights; batch invariance, a request alone vs in a batch of 64 (4 in the dry run), bitwise, in BF16
and FP8; a LoRA adapter (kernels/dense_triton.py lora_add_triton): its teacher-forced logprobs against the CPU engine
with the same adapter (float32), and on an FP8 batch-invariant engine the base bytes kept and a request alone vs in
the batch bitwise; CUDA graphs (model_executor/cuda_graphs.py): decode steps replayed from graphs against an eager
engine, bitwise, through three buckets; the OpenAI-compatible server through the openai client. Then speed:
ms per decode step and tok/s of the 8B shape at batch 1, 64 and 256 in BF16 and FP8, beside the HBM floor (the bytes
a step must read / 4.8 TB/s), from graphs, and at batch 1 eagerly too (enforce_eager=True: the host's share).
"""

import contextlib
import gc
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fp8engine import EngineConfig, LLMEngine, SamplingParams
from fp8engine.model_executor import cuda_graphs

DEFAULT_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                     max_position_embeddings=2048, rms_norm_eps=1e-5)
EIGHT_B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
               rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-5)
HBM_BYTES_PER_S = 4.8e12  # H200
# A small Qwen3.5 (3 GDN layers, then gated attention) with its released head sizes: linear heads of 128, attention
# heads of 256 with a quarter rotated (the text RoPE of its multimodal sections)
HYBRID = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=256, vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-6,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
              rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                   mrope_section=[11, 11, 10]))


def write_tokenizer(root: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words are the token ids ("t0 t1 ..."), with the model's special ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(root)


def model_dir(root: Path, shape: dict, weights: bool) -> str:
    """config.json and the tokenizer of a random Llama of `shape`; with `weights`, a seeded BF16 checkpoint too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    root.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root)
    else:
        config.save_pretrained(root)
    write_tokenizer(root, shape["vocab_size"])
    return str(root)


def hybrid_dir(root: Path, shape: dict = HYBRID, weights: bool = True) -> str:
    """A Qwen3.5 text model of `shape` with a tokenizer: seeded random BF16 weights, or with `weights=False` the
    config alone (load_format "dummy" draws them on the device)."""
    import transformers
    root.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3_5TextConfig(bos_token_id=1, eos_token_id=2, **shape)
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root)
    else:
        config.save_pretrained(root)
    write_tokenizer(root, shape["vocab_size"])
    return str(root)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def _check(name: str, ok: bool, **figures) -> dict:
    row = {"check": name, "ok": bool(ok), **figures}
    print(f"{'ok ' if ok else 'BAD'} engine/{name:34s} " + "  ".join(f"{k}={v}" for k, v in figures.items()),
          flush=True)
    return row


def check_logprobs_vs_cpu(model: str, device: str, cpu_device, vocab: int, kv_blocks: int) -> dict:
    """Teacher-forced raw logprobs of random continuations, the device engine against the CPU engine (float32)."""
    prompts = _prompts(6, 24, vocab, 1)
    responses = _prompts(6, 16, vocab, 2)
    raw = SamplingParams(temperature=1.0, logprobs_mode="raw")
    got = LLMEngine(EngineConfig(model=model, device=device, dtype="float32", num_kv_blocks=kv_blocks)).score(
        prompts, responses, raw)
    with cpu_device():
        cpu = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=kv_blocks))
        want = cpu.score(prompts, responses, raw)
    err = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    return _check("logprobs_vs_cpu_float32", err <= 1e-3, max_abs_diff=f"{err:.2e}")


def check_seeded(model: str, device: str, vocab: int, kv_blocks: int, size: int) -> dict:
    engine = LLMEngine(EngineConfig(model=model, device=device, num_kv_blocks=kv_blocks))
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=3 * size, ignore_eos=True, seed=7, logprobs=1)
    prompts = _prompts(size, 20, vocab, 3)
    first, second = ([(c.token_ids, c.logprobs) for o in engine.generate(prompts, params) for c in o.outputs]
                     for _ in range(2))
    finite = all(lp <= 0.0 and lp == lp for _, lps in first for lp in lps)
    return _check("seeded_sampling_repeats", first == second and finite, samples=len(first))


def check_update_in_place(model: str, device: str, vocab: int, kv_blocks: int, size: int) -> dict:
    options = dict(model=model, device=device, quantization="fp8", kv_cache_dtype="fp8_e4m3", num_kv_blocks=kv_blocks)
    engine = LLMEngine(EngineConfig(**options))
    greedy = SamplingParams(temperature=0.0, max_tokens=2 * size, ignore_eos=True, logprobs=0)
    prompts = _prompts(size, 20, vocab, 4)
    engine.generate(prompts, greedy)
    pointers = {name: p.data_ptr() for name, p in engine.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    update = {name: torch.randn(engine.get_weights_by_name(name).shape, generator=gen).bfloat16() * 0.05
              for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight")}
    calibrations = engine.kv_scales.num_calibrations
    report = engine.update_weights(update, weight_version=2)
    after = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    fresh = LLMEngine(EngineConfig(**options))
    fresh.update_weights(update)
    same = after == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy)]
    kept = {name: p.data_ptr() for name, p in engine.named_parameters()} == pointers
    recalibrated = engine.kv_scales.num_calibrations == calibrations + 1
    return _check("update_weights_in_place", same and kept and recalibrated, data_ptrs_kept=kept,
                  recalibrated=recalibrated, equals_fresh_engine=same, seconds=f"{report.seconds:.3f}")


def _alone_equals_batched(engine: LLMEngine, vocab: int, batch: int, tokens: int, seed: int,
                          context: int = 30, score: bool = False) -> tuple[bool, bool]:
    """A seeded T=1 request with a `context`-token prompt alone and in the middle of a batch of `batch`: the same
    tokens and logprobs; and (second, with `score`) the engine's scoring of its response, one prefill, the same
    logprobs."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=seed + 5, logprobs=0)
    target, others = _prompts(1, context, vocab, seed)[0], _prompts(batch - 1, 17, vocab, seed + 1)
    alone = engine.generate([target], params)[0].outputs[0]
    middle = batch // 2
    batched = engine.generate(others[:middle] + [target] + others[middle:], params)[middle].outputs[0]
    scored = not score or engine.score([target], [alone.token_ids], params)[0] == alone.logprobs
    return (alone.token_ids, alone.logprobs) == (batched.token_ids, batched.logprobs), scored


def check_batch_invariance(model: str, device: str, vocab: int, kv_blocks: int, quantization, batch: int,
                           tokens: int, context: int = 30) -> dict:
    """A request alone and in the middle of a batch: the same tokens and logprobs, bit for bit; and its scoring.
    A context over attention_triton.SPLIT_KEYS (on the device) folds key runs in the prefill and splits them over
    programs in a decode step that leaves SMs idle."""
    engine = LLMEngine(EngineConfig(model=model, device=device, batch_invariant=True, quantization=quantization,
                                    num_kv_blocks=kv_blocks))
    same, scored = _alone_equals_batched(engine, vocab, batch, tokens, seed=6, context=context, score=True)
    return _check(f"batch_invariance_{quantization or 'bf16'}", same and scored, batch=batch, context=context,
                  scoring_equals_rollout=scored)


def random_adapter(shape: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT-named rank-`rank` adapter of random A and B on every projection of layers 0 and 1."""
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    modules = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
               "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
               "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in (0, 1):
        for module, (k, n) in modules.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.05
            out[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.05
    return out


def check_lora(model: str, device: str, cpu_device, shape: dict, kv_blocks: int, batch: int, tokens: int) -> dict:
    """An unmerged rank-8 adapter: float32 logprobs against the CPU engine with the same adapter; on an FP8
    batch-invariant engine the base's bytes unchanged by the update and a request alone vs in a batch bitwise."""
    vocab, lora, scaling = shape["vocab_size"], random_adapter(shape, 8, 12), 2.0
    prompts, responses = _prompts(4, 24, vocab, 13), _prompts(4, 12, vocab, 14)
    raw = SamplingParams(temperature=1.0, logprobs_mode="raw")
    options = dict(model=model, dtype="float32", num_kv_blocks=kv_blocks, max_lora_rank=8)
    engine = LLMEngine(EngineConfig(device=device, **options))
    engine.update_lora(lora, scaling)
    got = engine.score(prompts, responses, raw)
    with cpu_device():
        cpu = LLMEngine(EngineConfig(device="cpu", **options))
        cpu.update_lora(lora, scaling)
        want = cpu.score(prompts, responses, raw)
    err = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    fp8 = LLMEngine(EngineConfig(model=model, device=device, quantization="fp8", batch_invariant=True,
                                 num_kv_blocks=kv_blocks, max_lora_rank=8))
    base = {name: p.detach().clone() for name, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    fp8.update_lora(lora, scaling)
    kept = all(torch.equal(p.view(torch.uint8), base[name].view(torch.uint8))
               for name, p in fp8.named_parameters() if name in base)
    same = all(_alone_equals_batched(fp8, vocab, batch, tokens, seed=16))
    return _check("lora_adapter", err <= 1e-3 and kept and same, max_abs_diff_vs_cpu=f"{err:.2e}",
                  fp8_base_kept=kept, batch_invariant=same, kernel=engine.get_stats().kernels.get("lora", "?"))


def check_cuda_graphs(model: str, device: str, vocab: int, kv_blocks: int, batch: int, tokens: int,
                      stand_in=None) -> dict:
    """Decode steps replayed from CUDA graphs (model_executor/cuda_graphs.py) against an eager engine, both batch
    invariant: batch - 1 sequences (a padded bucket) finishing at three lengths (three buckets), tokens and
    logprobs bit for bit; the wall time of the same generate beside. stand_in: the dry run's capture."""
    options = dict(model=model, device=device, batch_invariant=True, num_kv_blocks=kv_blocks, max_num_seqs=batch)
    with contextlib.ExitStack() as stack:
        if stand_in is not None:
            stack.enter_context(_replaced(cuda_graphs, "capture_cuda", stand_in))
        graphed = LLMEngine(EngineConfig(**options))
    eager = LLMEngine(EngineConfig(enforce_eager=True, **options))
    prompts = _prompts(max(batch - 1, 1), 20, vocab, 18)
    # greedy and tempered rows with the sampled token's logprob: the fused sampler, from its own graphs
    params = [SamplingParams(temperature=1.0 if i % 4 else 0.0, max_tokens=tokens + i % 3, ignore_eos=True, seed=19,
                             logprobs=0) for i in range(len(prompts))]
    results, seconds = [], []
    for engine in (graphed, eager):
        engine.generate(prompts[:1], params[0])  # warm-up
        _sync(device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        results.append([(c.token_ids, c.logprobs) for o in outs for c in o.outputs])
    graphs = graphed.runner.graphs
    replays = graphs.num_replays if graphs is not None else 0
    sampled = graphs.num_sampler_replays if graphs is not None else 0
    mode = graphed.get_stats().kernels["cuda_graphs"]
    return _check("cuda_graph_replay", results[0] == results[1] and replays > 0 and sampled > 0, graphs=mode,
                  replays=replays, sampler_replays=sampled, graph_s=f"{seconds[0]:.3f}", eager_s=f"{seconds[1]:.3f}")


def check_sleep_wake(model: str, device: str, vocab: int, kv_blocks: int, batch: int, tokens: int,
                     stand_in=None) -> dict:
    """Three sleep(1) / wake_up cycles of a batch-invariant engine with decode graphs (LLMEngine.sleep): the device
    memory free after each sleep and each wake (torch.cuda.mem_get_info), the bytes each sleep released, and the
    tokens and logprobs after each wake against those before, bit for bit (the graphs captured again). On a GPU
    each sleep must free at least 0.9x what it released; the dry run's device reports a fixed free size."""
    options = dict(model=model, device=device, batch_invariant=True, num_kv_blocks=kv_blocks, max_num_seqs=batch)
    with contextlib.ExitStack() as stack:
        if stand_in is not None:
            stack.enter_context(_replaced(cuda_graphs, "capture_cuda", stand_in))
        engine = LLMEngine(EngineConfig(**options))
        prompts = _prompts(batch, 20, vocab, 23)
        params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=29, logprobs=1)

        def outputs():
            return [(c.token_ids, c.logprobs) for o in engine.generate(prompts, params) for c in o.outputs]

        before, cycles, same = outputs(), [], True
        for _ in range(3):
            _sync(device)
            free_awake = torch.cuda.mem_get_info()[0]
            report = engine.sleep(1)
            _sync(device)
            free_asleep = torch.cuda.mem_get_info()[0]
            engine.wake_up()
            same = same and outputs() == before
            free_woken = torch.cuda.mem_get_info()[0]
            cycles.append(dict(released_mib=round(report.num_bytes / 2**20, 1),
                               freed_mib=round((free_asleep - free_awake) / 2**20, 1), sleep_s=f"{report.seconds:.3f}",
                               free_after_wake_mib=round(free_woken / 2**20, 1)))
        stats = engine.get_stats()
    freed = stand_in is not None or all(c["freed_mib"] >= 0.9 * c["released_mib"] for c in cycles)
    return _check("sleep_wake", same and freed and stats.num_graph_recaptures_total == 3, cycles=cycles,
                  graph_recaptures=stats.num_graph_recaptures_total,
                  recapture_s=f"{stats.graph_recapture_seconds_total:.3f}", outputs_equal=same)


def check_server(model: str, device: str, vocab: int, kv_blocks: int, engine_thread=None) -> dict:
    """The OpenAI-compatible server on the device engine, through the openai client (starlette's TestClient under
    it: no port; plain JSON posts where openai is not installed): completions with n=2 and logprobs, then a streamed
    greedy one, equal to the engine's own tokens. engine_thread: wraps the engine thread's loop (the dry run's
    device tracking)."""
    from starlette.testclient import TestClient

    from fp8engine.entrypoints import async_engine
    from fp8engine.entrypoints.server import ServerSettings, create_app
    engine = LLMEngine(EngineConfig(model=model, device=device, num_kv_blocks=kv_blocks))
    prompt = _prompts(1, 12, vocab, 20)[0]
    want = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    sampled = dict(model="small", prompt=prompt, max_tokens=5, temperature=0.7, top_p=0.9, n=2, seed=1, logprobs=2)
    greedy = dict(model="small", prompt=prompt, max_tokens=4, temperature=0.0, ignore_eos=True, return_token_ids=True)
    with contextlib.ExitStack() as stack:
        if engine_thread is not None:
            run = engine_thread(async_engine.AsyncEngine._run)
            stack.enter_context(_replaced(async_engine.AsyncEngine, "_run", run))
        http = stack.enter_context(TestClient(create_app(engine, ServerSettings())))
        try:
            import openai
        except ImportError:
            client_name = "httpx"
            choices = http.post("/v1/completions", json=sampled).json()["choices"]
            lengths = [len(c["logprobs"]["token_logprobs"]) for c in choices]
            whole = http.post("/v1/completions", json=greedy).json()["choices"][0]
            streamed = whole["token_ids"]
        else:
            client_name = f"openai {openai.__version__}"
            client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http)
            extra = {k: sampled.pop(k) for k in ("top_p",)}
            out = client.completions.create(**sampled, **extra)
            lengths = [len(c.logprobs.token_logprobs) for c in out.choices]
            body = {k: greedy.pop(k) for k in ("ignore_eos", "return_token_ids")}
            chunks = client.completions.create(**greedy, stream=True, extra_body=body)
            streamed = [t for chunk in chunks for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
    same = streamed == want.outputs[0].token_ids
    return _check("server_openai_client", lengths == [5, 5] and same, client=client_name, sampled_lengths=lengths,
                  greedy_equal=same)


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int, params: SamplingParams) -> None:
    """`batch` random prompts of `prompt_len` added and prefilled (in as many chunks as the token budget takes), then
    one warm-up decode step: the next step is a pure decode step of `batch` sequences."""
    for prompt in _prompts(batch, prompt_len, engine.vocab_size, 8):
        engine.add_request(prompt, params)
    while engine.get_stats().num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()


def decode_speed(model: str, device: str, batch: int, quantization, steps: int, prompt_len: int,
                 enforce_eager: bool = False, batch_invariant: bool = False, lm_head_fp8: bool = False,
                 async_scheduling: bool | None = None) -> dict:
    """ms per decode step (median over `steps`, after a warm-up step) of `batch` sequences of `prompt_len`;
    lm_head_fp8: the LM head in FP8 too (mode "fp8-head"). async_scheduling True / False (an A/B): the engine option
    set, and the steps timed as one loop (the mean; a wait after each step would undo the overlap)."""
    kv_tokens = batch * (prompt_len + steps + 8)
    engine = LLMEngine(EngineConfig(model=model, device=device, quantization=quantization, load_format="dummy",
                                    num_kv_blocks=-(-kv_tokens // 16) + batch, max_num_seqs=max(batch, 1),
                                    max_num_batched_tokens=max(8192, prompt_len * min(batch, 64)),
                                    enforce_eager=enforce_eager, batch_invariant=batch_invariant,
                                    lm_head_fp8=lm_head_fp8, async_scheduling=bool(async_scheduling)))
    start_decoding(engine, batch, prompt_len, SamplingParams(temperature=1.0, max_tokens=steps + 4, ignore_eos=True,
                                                             seed=0, logprobs=0))
    if async_scheduling is None:  # each step alone
        times = []
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            engine.step()
            _sync(device)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
    else:  # one loop
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        ms = (time.perf_counter() - start) / steps * 1e3
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv = batch * (prompt_len + steps) * engine.runner.kv_bytes_per_block() / engine.config.block_size
    floor_ms = (weights + kv) / HBM_BYTES_PER_S * 1e3
    graphs, pdl = engine.get_stats().kernels["cuda_graphs"], engine.get_stats().kernels.get("pdl", "off")
    mode = (quantization or "bf16") + ("-head" if lm_head_fp8 else "") + ("-bi" if batch_invariant else "")
    if async_scheduling is not None:
        mode += "-async" if async_scheduling else "-sync"
    overlap = engine.get_stats().kernels["async_scheduling"]
    swap = engine.get_stats().kernels.get("swap_ab_gemm", "off")
    row = {"batch": batch, "mode": mode, "graphs": graphs, "pdl": pdl, "swap_ab": swap, "async": overlap,
           "ms_per_step": float(f"{ms:.4g}"),
           "tok_per_s": float(f"{batch / ms * 1e3:.4g}"), "hbm_floor_ms": float(f"{floor_ms:.3g}"),
           "weight_gb": float(f"{weights / 1e9:.3g}")}
    print(f"    speed {row['mode']:5s} batch {batch:4d}: {ms:8.2f} ms/step {row['tok_per_s']:9.1f} tok/s "
          f"(HBM floor {floor_ms:.3g} ms: {row['weight_gb']} GB of weights + KV; CUDA graphs: {graphs})", flush=True)
    del engine
    return row


_ONLY: list[str] = []  # run(only=...): the checks whose names hold one of these; empty: all


def _guarded(name: str, check, *args, **kwargs) -> dict:
    """check(*args, **kwargs), timed; an exception is a failed check with its traceback printed, and the checks
    after it still run (a device run is short and rare: one crash must not hide the rest)."""
    if _ONLY and not any(part in name for part in _ONLY):
        return {"check": name, "ok": True, "skipped": True}
    started = time.perf_counter()
    try:
        row = check(*args, **kwargs)
    except Exception as exc:
        traceback.print_exc()
        row = _check(name, False, error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        gc.collect()  # the engines of a check, and their device memory, go before the next one's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["wall_s"] = round(time.perf_counter() - started, 2)
    return row


def _sync(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def run(dry: bool, workdir: str | None = None, only: list[str] | None = None) -> dict:
    """The checks and the speed table; dry: on the CPU under FakeCuda, tiny shapes; only: the checks (speed rows
    included) whose names hold one of these strings."""
    _ONLY[:] = only or []
    with contextlib.ExitStack() as stack:
        root = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory()))
        cpu_device = contextlib.nullcontext
        shape = TINY if dry else DEFAULT_SHAPE
        small = model_dir(root / "small", shape, weights=True)
        vocab, blocks, size = shape["vocab_size"], 256 if dry else 4096, 1 if dry else 4
        batch, tokens = (4, 3) if dry else (64, 8)
        context = 30 if dry else 600  # on the device: 3 runs of attention_triton.SPLIT_KEYS keys
        stand_in = engine_thread = None
        if dry:
            from tests.fake_cuda import FakeCuda
            mode = stack.enter_context(FakeCuda())
            stand_in = mode.stand_in_capture()
            cpu_device = torch.overrides._pop_mode_temporarily

            def engine_thread(run):  # the server's engine thread tracked too (mode stacks are per thread)
                def tracked(self):
                    with mode.in_this_thread():
                        run(self)
                return tracked
        checks = [_guarded("logprobs_vs_cpu_float32", check_logprobs_vs_cpu, small, "cuda", cpu_device, vocab, blocks),
                  _guarded("seeded_sampling_repeats", check_seeded, small, "cuda", vocab, blocks, size),
                  _guarded("update_weights_in_place", check_update_in_place, small, "cuda", vocab, blocks, size),
                  _guarded("batch_invariance_bf16", check_batch_invariance, small, "cuda", vocab, blocks, None, batch,
                           tokens, context),
                  _guarded("batch_invariance_fp8", check_batch_invariance, small, "cuda", vocab, blocks, "fp8", batch,
                           tokens, context),
                  _guarded("lora_adapter", check_lora, small, "cuda", cpu_device, shape, blocks, batch, tokens),
                  _guarded("cuda_graph_replay", check_cuda_graphs, small, "cuda", vocab, blocks, batch, tokens,
                           stand_in),
                  _guarded("sleep_wake", check_sleep_wake, small, "cuda", vocab, blocks, 1 if dry else batch, tokens,
                           stand_in),  # dry: one sequence, one graph bucket to capture four times
                  _guarded("server_openai_client", check_server, small, "cuda", vocab, blocks, engine_thread)]
        big = model_dir(root / "8b", TINY if dry else EIGHT_B, weights=False)
        steps, prompt_len = (2, 16) if dry else (16, 128)
        sizes = (1,) if dry else (1, 64, 256)  # the dry run runs each kind of row once (the interpreter is slow)
        some = sizes[:2]
        # (batch, quantization, eager, batch invariant, FP8 LM head)
        runs = [(batch, quantization, False, False, False) for quantization in (None, "fp8") for batch in sizes]
        runs += [(1, quantization, True, False, False) for quantization in (None, "fp8")]  # the host's share
        runs += [(batch, quantization, False, True, False) for quantization in (None, "fp8") for batch in some]
        runs += [(batch, "fp8", False, False, True) for batch in some]
        names = [f"speed_{q or 'bf16'}{'_head' if head else ''}{'_bi' if bi else ''}_batch{batch}"
                 f"{'_eager' if eager else ''}" for batch, q, eager, bi, head in runs]
        speed = [_guarded(name,
                          decode_speed, big, "cuda", batch, quantization, steps, prompt_len, enforce_eager=eager,
                          batch_invariant=bi, lm_head_fp8=head)
                 for name, (batch, quantization, eager, bi, head) in zip(names, runs)]
    speed = [row for row in speed if not row.get("skipped")]
    return {"engine_checks": [c for c in checks if not c.get("skipped")], "speed": speed,
            "speed_shape": "tiny" if dry else "llama-8b",
            "failures": [c["check"] for c in checks + speed if not c.get("ok", True)]}


if __name__ == "__main__":
    print(json.dumps(run(dry=True), indent=1))
