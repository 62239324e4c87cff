"""A tensor-parallel worker: rank r > 0 of a replica (model_executor/tensor_parallel.py), started by rank 0 as
`python -m fp8engine.model_executor.tp_worker FD`, FD its end of a socket pair.

It builds the same ModelRunner on its shard and then does what rank 0 sends, in order: a step's forward (whose
all-reduces meet rank 0's), cache copies, sleep and wake, weight updates and reads. An exception it cannot answer
with is sent to rank 0 as its last words before it exits; it exits too when rank 0's process goes (the socket
closes, or a collective fails).
"""

import contextlib
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch

from fp8engine.kvcache.kv_scales import KVScaleManager
from fp8engine.model_executor import tensor_parallel
from fp8engine.model_executor.model_runner import ModelRunner
from fp8engine.model_executor.tensor_parallel import TPGroup, fixed_order, join_groups, post, receive
from fp8engine.weights import updater
from fp8engine.weights.dist_update import WeightsUpdateGroup
from fp8engine.weights.loader import resolve


class Worker:
    def __init__(self, runner: ModelRunner, conn: Connection):
        self.runner, self.conn = runner, conn
        self.live: list[int] = []  # the blocks a KV-scale change re-quantizes (rank 0's scheduler's live blocks)
        self.kv_scales = KVScaleManager(runner.config, runner.attn_layers, {})
        self.kv_scales.pending = False  # rank 0 says when a forward calibrates
        self.kv_scales.reduce_amax = runner.tp.all_reduce_max
        self.kv_scales.rescale = lambda layer, old, new: runner.rescale_kv(layer, self.live, old, new)
        self.staged: updater.Staged | None = None
        self.plan: list = []  # an update's (target, dtype, shape, region) per tensor, between plan_update and stage
        self.update_group: WeightsUpdateGroup | None = None

    def loop(self) -> None:
        while True:
            op, args = receive(self.conn)
            if op == "shutdown":
                return
            result = getattr(self, op)(*args)
            if op in REPLIES:
                post(self.conn, ("ok", result))

    def _calibrating(self, live: list[int] | None):
        """Rank 0's forward measures KV scales (live: its live blocks) when live is not None: so does this one."""
        if live is not None:
            self.live, self.kv_scales.pending = live, True
        return self.kv_scales.calibrating()

    @torch.inference_mode()
    def execute(self, flat: tuple, live: list[int] | None) -> None:
        with self._calibrating(live):
            self.runner.forward_flat(flat)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> None:
        self.runner.model.compute_logits(hidden.to(self.runner.device))

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Rank 0 captures its decode graphs (start-up, after a wake): this rank captures its own, in the same order,
        so that their collectives meet. A failure here ends the worker (rank 0 reports it)."""
        if self.runner.graphs is None:
            self.runner._start_graphs()  # rank 0's own start, without the group guard: a failure ends this worker
        else:
            self.runner.graphs.capture_all()

    @torch.inference_mode()
    def graph_step(self, rows: tuple, size: int, clear: bool, capture: bool) -> None:
        """Rank 0 replays a decode graph: this rank replays its own for the same rows (DecodeGraphs.step)."""
        self.runner.graphs.step(rows, size, clear, capture)

    def decoder(self) -> str:
        """What runs this rank's decoder layers: "python", or the C++ plan's name."""
        fused = self.runner.model.fused
        return "python" if fused is None else fused.name

    def graph_counts(self) -> tuple[int, int] | None:
        """(captures, replays) of this rank's decode graphs since they were last built; None without them."""
        graphs = self.runner.graphs
        return None if graphs is None else (graphs.num_captures, graphs.num_replays)

    def forward_detached(self, token_ids: list[int], live: list[int] | None) -> None:
        with self._calibrating(live):
            self.runner.forward_detached(token_ids)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def apply_state_ops(self, ops: tuple[list[tuple[int, int]], list[int]]) -> None:
        self.runner.apply_state_ops(ops)

    def kv_scales_set(self, scales: list[tuple[float, float, float]], live: list[int]) -> None:
        self.live = live
        for index, (k, v, q) in enumerate(scales):
            self.kv_scales._set(index, k, v)
            self.runner.attn_layers[index].q_scale = q

    def release(self, tag: str, keep: bool, spill_dir: str | None) -> int:
        return self.runner.release(tag, keep, spill_dir)

    def resident_bytes(self, tag: str) -> int:
        return self.runner.resident_bytes(tag)

    def restore(self, tag: str) -> None:
        self.runner.restore(tag)

    def plan_update(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list:
        """For each (name, dtype, shape) of an update rank 0 validated: the part of it this rank writes
        (tensor_parallel.update_region), which rank 0 then sends (stage)."""
        targets = [resolve(self.runner.model, name) for name, _, _ in specs]
        self.plan = [(target, dtype, shape, tensor_parallel.update_region(target, dtype))
                     for target, (_, dtype, shape) in zip(targets, specs)]
        return [region for *_, region in self.plan]

    def stage(self) -> tuple[str, str] | None:
        """Receives the parts plan_update named, in order; whole tensors are validated as at one rank (an expert only
        this rank holds), parts were validated whole by rank 0. (what failed, why) if they do not pass; nothing is
        written until commit."""
        whole, parts = [], []
        for target, dtype, shape, region in self.plan:
            if region is None:
                continue
            part_shape = tensor_parallel.cut(torch.empty(shape, device="meta"), region).shape
            tensor = torch.empty(part_shape, dtype=dtype)
            self.runner.tp.recv(tensor)
            if region == "all":
                whole.append((target.name, tensor))
            else:
                parts.append((tensor_parallel.region_target(target, region, part_shape), tensor, None))
        self.plan = []
        error = self._stage(whole)
        if error is None:
            self.staged.items += parts
        return error

    def _stage(self, received: list) -> tuple[str, str] | None:
        try:
            self.staged = updater.stage(self.runner.model, received, self.kv_scales)
        except ValueError as exc:
            self.staged = None
            return "stage", str(exc)
        return None

    def join_update_group(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, device: str) -> str | None:
        try:
            self.update_group = WeightsUpdateGroup(address, port, rank_offset + self.runner.tp.rank, world_size,
                                                   group_name, backend, timeout_s, device)
        except (RuntimeError, ValueError) as exc:
            return str(exc)
        return None

    def receive_update(self, names, dtypes, shapes) -> tuple[str, str] | None:
        """This rank's copy of what the trainer broadcasts to the group, staged against its shard; (what failed,
        why) if it did not pass: a transfer that fails closes the group, as rank 0's does."""
        self.staged = None
        if self.update_group is None:
            return "transfer", "this rank is in no weight-update group"
        try:
            received = self.update_group.receive(names, dtypes, shapes)
        except RuntimeError as exc:
            self.leave_update_group()
            return "transfer", str(exc)
        except ValueError as exc:
            return "stage", str(exc)
        return self._stage(received)

    def leave_update_group(self) -> None:
        group, self.update_group = self.update_group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.destroy()

    def commit(self) -> int:
        staged, self.staged = self.staged, None
        return self.runner.commit_weights(staged)

    def commit_lora(self, staged) -> None:
        self.runner.commit_lora(staged)

    def abort(self) -> None:
        self.staged = None

    def reload(self) -> None:
        self.runner.reload_weights()

    def weight_names(self) -> list[str]:
        return self.runner.weight_names

    def read(self, hf_name: str) -> list:
        """This rank's pieces of a weight, on the host (a device tensor would unpickle onto rank 0's device)."""
        return [(index, tp, values.cpu()) for index, tp, values in
                tensor_parallel.pieces(resolve(self.runner.model, hf_name), self.runner.dtype)]


REPLIES = frozenset({"release", "restore", "resident_bytes", "graph_counts", "decoder", "stage", "plan_update",
                     "join_update_group", "receive_update", "leave_update_group", "commit_lora", "weight_names",
                     "commit", "reload", "read"})


def _watch_parent() -> None:
    """Exit when the process that started this one is gone (its socket may outlive it in a grandchild)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    _watch_parent()
    try:
        config, model_dir, rank, port, threads, device, device_port = receive(conn)
        torch.set_num_threads(threads)
        if device is not None:  # "cuda" is this rank's device from here on (the NCCL group's too)
            torch.cuda.set_device(device)
        post(conn, ("ok", None))
        group, device_group = join_groups(config, port, device_port, rank)
        runner = ModelRunner(config, model_dir, TPGroup(group, rank, config.tensor_parallel_size, fixed_order(config),
                                                        device_group))
        Worker(runner, conn).loop()
    except (EOFError, ConnectionError):  # rank 0 is gone
        os._exit(1)
    except BaseException:
        try:
            post(conn, ("died", traceback.format_exc(limit=8)))
        finally:
            os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
