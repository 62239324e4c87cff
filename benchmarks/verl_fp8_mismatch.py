"""Is the growth of veRL's `rollout_probs_diff_mean` with an FP8 engine FP8's expected mismatch on a changing
policy, or a fault in the path (sync, quantization, KV, sampler)? (issue 62, docs/integrations.md "FP8 mismatch")

`run`: veRL's own GRPO trainer (tests/integrations/test_verl_grpo.py's overrides, FP8 engine, 3 steps) with the
test-only dump of tests/integrations/verl_cpu_shim.py (FP8ENGINE_VERL_DUMP): per sync the tensors veRL yielded, per
rollout the prompt / response ids and the engine's logprobs, per step veRL's rollout and FSDP (old_log_probs)
logprobs. `analyze`: per step, teacher-forced on the same responses, with the weights the engine was synced with
for that rollout:

  hf32   HF LlamaForCausalLM in float32 (the reference; checked against veRL's FSDP logprobs),
  fq     the same model with every decoder linear (q/k/v/o, gate/up/down) computing
         fp8engine.weights.quant.fp8_block_linear_ref on quantize_weight_blockwise(W) per projection, as the engine
         quantizes (128x128 weight blocks, partial at 576 / 192; 1x128 activation groups), head / embeddings / norms
         untouched, float32 elsewhere,
  fq16   the same fake-quantized replay in bfloat16 (the engine's model dtype),
  eng    the engine itself (quantization=fp8, BF16 KV) updated with the dumped weights, LLMEngine.score,
  roll   the engine's rollout logprobs (what veRL got), fsdp = veRL's old_log_probs,
  hf16   HF in bfloat16 (the weights rounded to bfloat16: what FSDP2 with param_dtype bf16 computes with),
  fq16s / hf16s  fq16 / hf16 with SDPA attention instead of eager (the same math reordered: the noise floor),
  engb / fq16b   the engine / fq16 synced with the weights cast to bfloat16 first (FP8 of what FSDP computes with),

and prints mean |p - q| (veRL's rollout_probs_diff_mean is mean |p_roll - p_fsdp|) and k3 = mean(r - 1 - log r),
r = q / p, for pairs of these, plus where the mismatch sits (by token probability) and the per-step weight
quantization error. Run both inside veRL's venv (make test-integrations builds it), this checkout first on the path:

    cd /tmp && PYTHONPATH=$CHECKOUT OMP_NUM_THREADS=1 ~/.cache/fp8engine/verl-venv/bin/python \\
        $CHECKOUT/benchmarks/verl_fp8_mismatch.py run --lr 1e-4 --out /tmp/w/inv/lr1e-4
    ... run --lr 0 --out /tmp/w/inv/lr0
    ... analyze /tmp/w/inv/lr1e-4 /tmp/w/inv/lr0 [--json out.json]
"""

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))


# ----------------------------------------------------------------------------- run
def run(args) -> None:
    import subprocess

    import test_verl_grpo as t
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dump = out / "dump"
    over = [o if not o.startswith("actor_rollout_ref.actor.optim.lr=") else f"actor_rollout_ref.actor.optim.lr={args.lr}"
            for o in t.overrides(out, t.write_data(out / "train.parquet"), {"quantization": args.quantization}
                                 if args.quantization != "none" else {})]
    env = os.environ | {
        "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_shim",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "integrations"), str(ROOT)]),
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "VERL_SYNC_CHECK": str(out / "syncs.jsonl"),
        "FP8ENGINE_VERL_DUMP": str(dump), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *over], cwd=out, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    (out / "main_ppo.log").write_text(proc.stdout + proc.stderr)
    print(f"main_ppo exit {proc.returncode} in {time.perf_counter() - start:.0f} s; dump in {dump}")
    if proc.returncode:
        print((proc.stdout + proc.stderr)[-4000:])
        sys.exit(1)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        print(record["step"], {k: record["data"].get(k) for k in ("training/rollout_probs_diff_mean",
                                                                  "actor/grad_norm", "actor/entropy")})


# ----------------------------------------------------------------------------- analyze
MODEL = Path(os.environ.get("FP8ENGINE_VERL_MODEL",
                            Path.home() / ".cache/fp8engine/models/SmolLM2-135M-Instruct")).expanduser()
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_run(directory: Path) -> list[dict]:
    """Per step: the rollouts veRL scored (prompt, response, engine logprobs from the rollout, veRL's rollout and
    FSDP logprobs) and the weight version they were sampled with."""
    dump = directory / "dump"
    records = [json.loads(line) for f in sorted(dump.glob("rollouts_*.jsonl")) for line in f.read_text().splitlines()]
    debug = sorted(dump.glob("debug_*.pt"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
    steps = []
    for step, f in enumerate(debug, 1):
        d = torch.load(f)
        rows = []
        for i in range(d["responses"].shape[0]):
            n = int(d["response_mask"][i].sum())
            response = d["responses"][i, :n].tolist()
            roll = d["rollout_log_probs"][i, :n]
            match = [r for r in records if r["token_ids"][:n] == response and len(r["token_ids"]) == n
                     and torch.allclose(torch.tensor(r["log_probs"][:n]), roll, atol=1e-5)]
            assert match, f"step {step} row {i}: no rollout record with these tokens"
            r = match[0]
            rows.append({"prompt": r["prompt_ids"], "response": response, "roll": roll.double(),
                         "fsdp": d["old_log_probs"][i, :n].double(), "version": r["global_steps"],
                         "min_version": r["min_global_steps"], "params": r["sampling_params"]})
        versions = {row["version"] for row in rows} | {row["min_version"] for row in rows}
        assert len(versions) == 1, f"step {step}: rollouts span weight versions {versions}"
        steps.append({"step": step, "version": versions.pop(), "rows": rows, "metrics": d["metrics"]})
    return steps


def load_weights(directory: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(directory / "dump" / f"weights_v{version}.safetensors"))


def hf_model(weights: dict, dtype: torch.dtype, fake_quant: bool, attn: str = "eager"):
    """LlamaForCausalLM with `weights`; fake_quant: each decoder linear runs fp8_block_linear_ref on its own
    blockwise quantization (the engine's per-projection scale grids)."""
    from transformers import AutoConfig, LlamaForCausalLM

    from fp8engine.weights.quant import fp8_block_linear_ref, quantize_weight_blockwise
    config = AutoConfig.from_pretrained(MODEL)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype).eval()
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    if fake_quant:
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                w_q, scale = quantize_weight_blockwise(weights[name + ".weight"].float())

                def forward(x, w_q=w_q, scale=scale):
                    return fp8_block_linear_ref(x, w_q, scale)
                module.forward = forward
    return model


@torch.no_grad()
def teacher_forced(model, rows: list[dict]) -> list[torch.Tensor]:
    out = []
    for row in rows:
        ids = torch.tensor([row["prompt"] + row["response"]])
        logits = model(ids).logits[0].double()
        p = len(row["prompt"])
        logp = torch.log_softmax(logits[p - 1:-1], dim=-1)
        out.append(logp.gather(1, torch.tensor(row["response"]).unsqueeze(1)).squeeze(1))
    return out


def engine_scores(engine, weights: dict, rows: list[dict]) -> list[torch.Tensor]:
    from fp8engine import SamplingParams
    engine.update_weights(weights)
    sp = {k: v for k, v in rows[0]["params"].items() if k in ("temperature", "top_p", "top_k")}
    params = SamplingParams(logprobs=0, logprobs_mode="processed", **sp)
    scores = engine.score([r["prompt"] for r in rows], [r["response"] for r in rows], params)
    return [torch.tensor(s, dtype=torch.float64) for s in scores]


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """a: the sampling side (r = q_b / p_a); mean |p_a - p_b|, k3 = mean(r - 1 - log r), mean |log p_a - log p_b|
    over every response token of the step."""
    la, lb = torch.cat(a), torch.cat(b)
    log_r = lb - la
    return {"probs_diff": (la.exp() - lb.exp()).abs().mean().item(),
            "k3": (log_r.exp() - 1 - log_r).mean().item(), "logp_diff": log_r.abs().mean().item()}


def weight_error(weights: dict, base: dict) -> dict:
    """Over the decoder linears: relative FP8 quantization error ||W - DQ(Q(W))|| / ||W||, relative change from
    the first synced weights, share of 128x128 blocks whose amax (hence scale) changed, share of elements whose
    FP8 code changed, and how well the update U = W - W0 survives a cast: ||(C(W) - C(W0)) - U|| / ||U|| for C the
    bfloat16 cast (what veRL's FSDP computes with, param_dtype bf16) and the FP8 quantize-dequantize."""
    from fp8engine.weights.quant import (
        dequantize_weight_blockwise,
        quantize_weight_blockwise,
    )
    err = norm = change = lost16 = lost8 = 0.0
    blocks = blocks_changed = codes = codes_changed = 0
    for name, w in weights.items():
        if name.rsplit(".", 2)[-2] not in LINEARS:
            continue
        w = w.float()
        q, s = quantize_weight_blockwise(w)
        q0, s0 = quantize_weight_blockwise(base[name].float())
        err += (w - dequantize_weight_blockwise(q, s)).pow(2).sum().item()
        norm += w.pow(2).sum().item()
        update = w - base[name].float()
        change += update.pow(2).sum().item()
        lost16 += (w.bfloat16().float() - base[name].bfloat16().float() - update).pow(2).sum().item()
        lost8 += (dequantize_weight_blockwise(q, s) - dequantize_weight_blockwise(q0, s0) - update).pow(2).sum().item()
        blocks += s.numel()
        blocks_changed += (s != s0).sum().item()
        codes += q.numel()
        codes_changed += (q.view(torch.uint8) != q0.view(torch.uint8)).sum().item()
    return {"quant_rel_err": (err / norm) ** 0.5, "rel_change_from_v0": (change / norm) ** 0.5,
            "blocks_scale_changed": blocks_changed / blocks, "fp8_codes_changed": codes_changed / codes,
            "bf16_update_err": (lost16 / change) ** 0.5 if change else 0.0,
            "fp8_update_err": (lost8 / change) ** 0.5 if change else 0.0}


def by_probability(p_ref: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """|p_a - p_b| and |log p_a - log p_b| by bins of the reference token probability."""
    edges = [0.0, 0.1, 0.5, 0.9, 0.99, 1.0001]
    out = []
    for lo, hi in itertools.pairwise(edges):
        m = (p_ref >= lo) & (p_ref < hi)
        if m.any():
            out.append({"p": f"[{lo:g},{min(hi, 1):g})", "tokens": int(m.sum()),
                        "probs_diff": (a[m].exp() - b[m].exp()).abs().mean().item(),
                        "logp_diff": (a[m] - b[m]).abs().mean().item(),
                        "share_of_probs_diff": ((a[m].exp() - b[m].exp()).abs().sum()
                                                / (a.exp() - b.exp()).abs().sum()).item()})
    return out


def analyze(args) -> None:
    from fp8engine import EngineConfig, LLMEngine
    torch.manual_seed(0)
    engine = LLMEngine(EngineConfig(model=str(MODEL), dtype="bfloat16", quantization="fp8", max_model_len=96,
                                    seed=0))
    report = {}
    pairs = [("roll", "fsdp"), ("eng", "hf32"), ("fq", "hf32"), ("fq16", "hf32"), ("eng", "fq"), ("eng", "fq16"),
             ("roll", "eng"), ("fsdp", "hf16"), ("hf16", "hf32"), ("roll", "hf16"), ("fq16", "fq16s"), ("hf16", "hf16s"),
             ("fq", "fq16"), ("engb", "fsdp"), ("fq16b", "fsdp"), ("engb", "fq16b"), ("eng", "engb")]
    for run_dir in map(Path, args.runs):
        steps = load_run(run_dir)
        base = load_weights(run_dir, steps[0]["version"])
        report[str(run_dir)] = rows_out = []
        print(f"\n== {run_dir}")
        for step in steps:
            weights = load_weights(run_dir, step["version"])
            rows = step["rows"]
            lp = {"roll": [r["roll"] for r in rows], "fsdp": [r["fsdp"] for r in rows]}
            start = time.perf_counter()
            lp["hf32"] = teacher_forced(hf_model(weights, torch.float32, False), rows)
            lp["hf16"] = teacher_forced(hf_model(weights, torch.bfloat16, False), rows)
            lp["fq"] = teacher_forced(hf_model(weights, torch.float32, True), rows)
            lp["fq16"] = teacher_forced(hf_model(weights, torch.bfloat16, True), rows)
            lp["fq16s"] = teacher_forced(hf_model(weights, torch.bfloat16, True, "sdpa"), rows)
            lp["hf16s"] = teacher_forced(hf_model(weights, torch.bfloat16, False, "sdpa"), rows)
            as_bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
            lp["fq16b"] = teacher_forced(hf_model(as_bf16, torch.bfloat16, True), rows)
            lp["engb"] = engine_scores(engine, as_bf16, rows)
            lp["eng"] = engine_scores(engine, weights, rows)
            p_hf32 = torch.cat(lp["hf32"]).exp()
            record = {"step": step["step"], "weight_version": step["version"], "tokens": sum(map(len, lp["roll"])),
                      "verl_rollout_probs_diff_mean": step["metrics"]["training/rollout_probs_diff_mean"],
                      "mean_p_hf32": torch.cat(lp["hf32"]).exp().mean().item(),
                      "mean_p(1-p)_hf32": (p_hf32 * (1 - p_hf32)).mean().item(),
                      "pairs": {f"{a}-{b}": compare(lp[a], lp[b]) for a, b in pairs},
                      "weights": weight_error(weights, base),
                      "fq_vs_hf32_by_p": by_probability(torch.cat(lp["hf32"]).exp(), torch.cat(lp["fq"]),
                                                        torch.cat(lp["hf32"])),
                      "roll_vs_fsdp_by_p": by_probability(torch.cat(lp["fsdp"]).exp(), torch.cat(lp["roll"]),
                                                          torch.cat(lp["fsdp"])),
                      "seconds": time.perf_counter() - start}
            rows_out.append(record)
            print(f"step {record['step']} (weights v{record['weight_version']}, {record['tokens']} tokens): veRL "
                  f"{record['verl_rollout_probs_diff_mean']:.4f}, mean p {record['mean_p_hf32']:.3f}, "
                  f"mean p(1-p) {record['mean_p(1-p)_hf32']:.4f}, weights {record['weights']}")
            for name, c in record["pairs"].items():
                print(f"   {name:10s} |dp| {c['probs_diff']:.4f}  k3 {c['k3']:.2e}  |dlogp| {c['logp_diff']:.4f}")
            for key in ("fq_vs_hf32_by_p", "roll_vs_fsdp_by_p"):
                print(f"   {key}: " + "; ".join(f"{b['p']} n={b['tokens']} |dp| {b['probs_diff']:.4f} "
                                             f"|dlogp| {b['logp_diff']:.4f} share {b['share_of_probs_diff']:.2f}"
                                             for b in record[key]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="veRL GRPO with the dump on")
    r.add_argument("--lr", default="1e-4")
    r.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
    r.add_argument("--out", required=True)
    a = sub.add_parser("analyze", help="the offline comparison of one or more run directories")
    a.add_argument("runs", nargs="+")
    a.add_argument("--json")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else analyze(args)


if __name__ == "__main__":
    main()
