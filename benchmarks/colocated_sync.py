"""The three ways a trainer on the same machine hands its weights to `fp8engine serve`, side by side: seconds per
full sync of the default model's BF16 weights (median of alternating rounds) and the bytes that cross the socket.

  from_tensor  POST /update_weights_from_tensor: the tensors in shared memory (torch's file_system strategy),
               their handles in the body (weights/tensor_handles.py, SGLang's update_weights_from_tensor)
  http         RolloutClient.sync_weights: safetensors buckets in HTTP bodies
  group        RolloutClient.use_weights_update_group: a gloo broadcast per bucket

    python benchmarks/colocated_sync.py [--rounds 3] [--quantization fp8]
"""

import argparse
import statistics
import time

import httpx
import torch

from fp8engine.bench.serve_load import serving
from fp8engine.rl import RolloutClient
from fp8engine.weights import tensor_handles
from fp8engine.weights.default_model import default_model_path
from fp8engine.weights.loader import iter_safetensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="fp8")
    args = parser.parse_args()
    torch.multiprocessing.set_sharing_strategy("file_system")
    state = {name: t.to(torch.bfloat16) for name, t in iter_safetensors(default_model_path())}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shared = {name: t.share_memory_() for name, t in state.items()}  # as a trainer's tensors would already be
    flags = ["--quantization", args.quantization, "--num-kv-blocks", "64"]
    with serving(flags) as url_http, serving(flags) as url_group:
        http, group = RolloutClient(url_http), RolloutClient(url_group)
        group.use_weights_update_group()
        raw = httpx.Client(base_url=url_http, timeout=600)

        def from_tensor(version: int) -> int:
            body = {"serialized_named_tensors": [tensor_handles.dumps(list(shared.items()))],
                    "weight_version": version}
            response = raw.post("/update_weights_from_tensor", json=body)
            response.raise_for_status()
            return len(response.request.content)

        ways = {"from_tensor": from_tensor,
                "http": lambda version: http.sync_weights(state, weight_version=version).num_bytes,
                "group": lambda version: group.sync_weights(state, weight_version=version).num_bytes}
        for way in ways.values():
            way(1)  # warm-up: every path's first call pays its set-up
        seconds, sent = {name: [] for name in ways}, {}
        for r in range(args.rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                sent[name] = way(2 + r)
                seconds[name].append(time.perf_counter() - start)
        group.close()
    print(f"default model, {nbytes / 2**20:.0f} MiB of BF16 weights into a {args.quantization or 'bf16'} server, "
          f"{args.rounds} alternating rounds (median s; bytes in the request bodies, or broadcast for group)")
    for name in ways:
        median = statistics.median(seconds[name])
        print(f"  {name:12s} {median:6.2f} s  {nbytes / median / 2**30:5.2f} GiB/s  sent {sent[name]:>11,d} bytes")


if __name__ == "__main__":
    main()
