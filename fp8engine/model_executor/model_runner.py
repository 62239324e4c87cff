"""Model runner: builds the model and its paged KV cache, turns a schedule into a flat batch and runs it."""

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from fp8engine.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, EngineConfig
from fp8engine.model_executor import cuda_graphs, fused_decoder, host_memory, kernel_set, tensor_parallel
from fp8engine.model_executor.kernels import cpu_ops
from fp8engine.model_executor.kernels.attention_ref import quantize_fp8
from fp8engine.model_executor.layers.attention import AttentionMetadata
from fp8engine.model_executor.layers.embedding import LMHead
from fp8engine.model_executor.layers.linear import Linear
from fp8engine.model_executor.layers.lora import LoRA
from fp8engine.model_executor.models import model_class
from fp8engine.model_executor.models.qwen3_5 import text_config
from fp8engine.model_executor.models.llama import LinearFactory
from fp8engine.request import ScheduledSeq, Sequence
from fp8engine.weights import layout
from fp8engine.weights import lora, updater
from fp8engine.weights.loader import expected_names, load_checkpoint, load_dummy, read, resolve
from fp8engine.weights.quant import FP8_DTYPE

logger = logging.getLogger(__name__)


SHUTDOWN_WAIT_S = 10.0
PROMPT_LOGITS_BYTES = 256 << 20  # float32 logits computed at once for prompt logprobs and scoring


class PromptLogits:
    """The LM head over a step's rows of one sequence, computed a chunk of rows at a time (at most
    PROMPT_LOGITS_BYTES of float32 logits: 2 GiB of hidden rows' logits would otherwise be one tensor for an
    8,192-token chunk of a 128K vocabulary, with log_softmax's copy beside it)."""

    def __init__(self, logits, hidden: torch.Tensor, vocab_size: int):
        self.logits, self.hidden = logits, hidden  # logits: ModelRunner.head_logits
        self.rows = max(1, PROMPT_LOGITS_BYTES // (4 * vocab_size))

    def chunks(self, start: int, stop: int):
        """(offset from start, float32 logits of rows offset+start ..) over rows start..stop-1, in order."""
        for i in range(start, stop, self.rows):
            yield i - start, self.logits(self.hidden[i:min(stop, i + self.rows)]).float()


def _exclusive(method):
    """A runner method that talks to the tensor-parallel workers holds them for its whole length (engine methods
    may come from several threads: a server's stats, a trainer's update)."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        if self.tp_leader is None:
            return method(self, *args, **kwargs)
        with self.tp_leader.lock:
            return method(self, *args, **kwargs)
    return held


@dataclass(slots=True)
class StepOutput:
    """Logits of the rows to sample (one per sampling sequence and one per draft token, in schedule order) and
    the prompt rows' logits (prompt logprobs, scoring), by sequence."""

    logits: torch.Tensor | None
    prompt_logits: dict[int, PromptLogits]


class ModelRunner:
    """tp: a tensor-parallel worker's place in its group (tp_worker.py); rank 0 is built without one and, with
    tensor_parallel_size > 1, starts the workers itself (tp_leader) and sends them every call that needs them."""

    def __init__(self, config: EngineConfig, model_dir: str, tp: tensor_parallel.TPGroup | None = None):
        self.config, self.model_dir = config, model_dir
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = text_config(AutoConfig.from_pretrained(model_dir))
        model_config = self.hf_config
        if config.tensor_parallel_size > 1:
            tensor_parallel.check_shardable(self.hf_config, config.tensor_parallel_size, config.quantization == "fp8",
                                            config.expert_parallel)
            model_config = tensor_parallel.local_config(self.hf_config, config.tensor_parallel_size,
                                                        config.expert_parallel)
        self.tp_leader = tensor_parallel.Leader(config, model_dir) if config.tensor_parallel_size > 1 and tp is None \
            else None
        self.tp = self.tp_leader.group if self.tp_leader is not None else tp
        # rank 0: the scheduler's live blocks (the engine sets it), which a KV-scale change re-quantizes on every rank
        self.live_blocks = list
        self.worker_received: list[torch.Tensor] | None = None  # a received update's tensors, staged on the workers
        try:
            self._build(model_config)
        except BaseException:
            if self.tp_leader is not None:
                self.tp_leader.close()
            raise

    def _build(self, model_config) -> None:
        config, model_dir = self.config, self.model_dir
        self.vocab_size = self.hf_config.vocab_size  # read every step: a config attribute is a slow lookup
        self.max_model_len = config.max_model_len or self.hf_config.max_position_embeddings
        self.kernels = kernel_set.select(config)
        if self.device.type == "cpu" and (warning := cpu_ops.thread_warning(torch.get_num_threads())):
            logger.warning("%s", warning)
        make_linear = LinearFactory(self.dtype, self.kernels, config.fp8_scale_fmt, config.max_lora_rank,
                                    config.lm_head_fp8)
        cls = model_class(self.hf_config)
        # hybrid models: the batch-invariant engine runs GDN prefill in the recurrent form (docs/hybrid-models.md)
        extra = {"recurrent": config.batch_invariant} if getattr(cls, "hybrid", False) else {}
        with torch.device(self.device):
            self.model = cls(model_config, make_linear, self.max_model_len, **extra)
            if self.tp is not None:
                tensor_parallel.shard_model(self.model, self.hf_config, self.tp, config.expert_parallel)
        # before loading: the loader's targets are views of the tensors' final homes
        self.weight_buffers = _weight_buffers(self.model)  # LoRA's A and B: weights, though buffers
        self.home = None if self.device.type != "cpu" else host_memory.rehome(
            self.model, huge_pages=self.kernels.huge_pages, weight_buffers=self.weight_buffers)
        self.kv_homes: list[host_memory.HostMapping] = []  # the CPU KV cache's mappings (sleep releases them)
        self.kept: dict[str, object] = {}  # what a sleeping tag keeps (a Spill on CPU, host copies on CUDA)
        self.released_sizes: dict[str, list[int]] = {}  # CUDA: a sleeping tag's storages' bytes
        self.graph_captures, self.graph_capture_seconds = 0, 0.0  # CUDA graphs captured again after a sleep
        if self.kernels.fp8_nt16:  # the loader and updates write them through weights/layout.py
            for param in self.model.parameters():
                if param.dtype == FP8_DTYPE:
                    layout.mark(param)
        head = getattr(self.model, "lm_head", None)
        if self.kernels.head_nt16 and isinstance(head, LMHead) and head.weight.dtype == torch.bfloat16:
            layout.mark(head.weight)  # a tied embedding's too: it looks its rows up through layout.embedding
        if self.kernels.dense_nt16 is not None:
            for module in self.model.modules():
                if isinstance(module, Linear) and not module.is_fp8 and module.weight.dtype == torch.bfloat16:
                    layout.mark(module.weight)
        if config.load_format == "dummy":
            load_dummy(self.model, self.kernels.quantize_into, config.seed)
        else:
            load_checkpoint(self.model, model_dir, self.kernels.quantize_into, self.kernels.block_scales)
        self.model.eval()
        self.attn_layers = self.model.attention_layers()
        self.moe_blocks = self.model.moe_blocks()
        self.gdn_layers = self.model.gdn_layers() if hasattr(self.model, "gdn_layers") else []
        self.block_size = config.block_size
        self.kv_cache: torch.Tensor | None = None
        self.routed_experts: torch.Tensor | None = None
        # hybrid models: state slots for running sequences and snapshots (kvcache/state_pool.py), in the KV budget;
        # with speculative decoding each running slot has num_speculative_tokens more (a verification's roll-back)
        self.spec_states_per_slot = config.num_speculative_tokens if self.gdn_layers and config.speculative else 0
        self.num_state_slots, self.num_state_snapshots = self._state_slots()
        self.states: list[torch.Tensor] = []
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = self._allocate_kv_cache()
        self.routed_experts = self._allocate_routed_experts()
        self.states = self._allocate_states()
        self._attach_cache(self.kv_cache, self.routed_experts)
        # (tensor-parallel ranks each run their shard's plan, which adds the partial sums over the ranks itself)
        self.model.fused = fused_decoder.build(self.model, self.kernels, config.fp8_scale_fmt, self.tp)
        self.lora_layers = {name.removesuffix(".lora"): m for name, m in self.model.named_modules()
                            if isinstance(m, LoRA)}
        # a prefill chunk's kernels compiled now, not in the first request (by rank 0, which sends it to its workers)
        if self.device.type == "cuda" and (self.tp is None or self.tp.rank == 0):
            self.forward_detached([0] * min(config.max_num_batched_tokens, 2 * self.block_size - 1))
        # what each tag holds on the workers while awake (fixed from here on: get_stats reads it, with no round trip)
        self.worker_bytes = {} if self.tp_leader is None else {
            tag: sum(self.tp_leader.call("resident_bytes", tag)) for tag in ("weights", "kv_cache")}
        # the HF names of every weight the replica holds (with expert parallelism each rank holds some experts)
        self.weight_names = expected_names(self.model)
        if self.tp_leader is not None:
            mine = set(self.weight_names)
            self.weight_names += [n for names in self.tp_leader.call("weight_names") for n in names if n not in mine]
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        self.graphs_off = cuda_graphs.unavailable_reason(config, self)
        # every decode bucket's kernels too: its graph captured on padding rows (a tensor-parallel worker's when rank 0
        # says, alongside its own)
        if self.graphs_off is None and (self.tp is None or self.tp.rank == 0):
            self._graphs_guarded(self._start_graphs)

    def _start_graphs(self) -> None:
        self.graphs = cuda_graphs.DecodeGraphs(self, self.config.max_num_seqs, cuda_graphs.capture_cuda())
        self.graphs.capture_all()

    def _graphs_guarded(self, fn, *args, workers: bool = True):
        """fn(*args), or None with the graphs switched off for good when it fails (said once, with the reason). With
        tensor parallelism a failure of what the workers follow (`workers`: a capture, a replay) ends the group
        instead: they were told to capture or replay what rank 0 did not, so their collectives no longer meet."""
        try:
            return fn(*args)
        except Exception as exc:  # a capture that fails: the eager path stays right
            if self.tp_leader is not None and workers:
                with self.tp_leader.guard():
                    raise RuntimeError(f"CUDA graphs failed under tensor parallelism ({type(exc).__name__}: {exc}); "
                                       f"enforce_eager=True runs without them") from exc
            self.graphs, self.graphs_off = None, f"capture failed ({type(exc).__name__}: {exc})"
            logger.warning("CUDA graphs off, decode steps run eagerly: %s", self.graphs_off)
            return None

    @property
    def kernel_names(self) -> dict[str, str]:
        """What runs: the kernel set's names, the decoder layers' path ("cpp-plan": one C++ call) and where the weights
        live ("huge-pages" or "mapping": host_memory.rehome moved them)."""
        graphs = "decode" if self.graphs is not None else f"off: {self.graphs_off}"
        home = "allocator" if self.home is None else "huge-pages" if self.home.mapping.huge else "mapping"
        names = self.kernels.names | {"decoder": "python" if self.model.fused is None else self.model.fused.name,
                                      "cuda_graphs": graphs, "host_memory": home}
        if self.tp is not None:
            order = "fixed-order" if self.tp.fixed_order else self.tp.backend
            names["tensor_parallel"] = f"{self.tp.size} ranks, {order} all-reduce"
        return names

    @property
    def lora_active(self) -> bool:
        return any(m.active for m in self.lora_layers.values())

    @property
    def kv_dtype(self) -> torch.dtype:
        return FP8_DTYPE if self.config.kv_is_fp8 else self.dtype

    def kv_bytes_per_block(self) -> int:
        first = self.attn_layers[0]
        elems = 2 * len(self.attn_layers) * self.block_size * first.num_kv_heads * first.head_dim
        return elems * torch.empty(0, dtype=self.kv_dtype).element_size()

    def state_bytes_per_slot(self) -> int:
        """Bytes of one sequence's state over every GDN layer (0 for a model without them)."""
        return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                   for layer in self.gdn_layers for shape, dtype in layer.state_shapes(self.dtype))

    def total_state_slots(self) -> int:
        """Slots of the state pool: running sequences' (each with its verification slots) and snapshots'."""
        return self.num_state_slots * (1 + self.spec_states_per_slot) + self.num_state_snapshots

    @property
    def graph_state_scratch(self) -> int:
        """The state pool's slot past the scheduler's, allocated on CUDA only: what a decode graph's padding rows
        advance (cuda_graphs.py)."""
        return self.total_state_slots()

    def _state_slots(self) -> tuple[int, int]:
        """(slots for running sequences, snapshot slots) of a hybrid model, (0, 0) otherwise: a slot for each of
        max_num_seqs, up to state_memory_fraction of the KV budget (half by default; more sequences wait for a
        slot), and as many snapshots (with prefix caching), up to an eighth of it. The KV blocks get the rest."""
        if not self.gdn_layers:
            return 0, 0
        per, seqs = self.state_bytes_per_slot() * (1 + self.spec_states_per_slot), self.config.max_num_seqs
        snapshots = seqs if self.config.enable_prefix_caching else 0
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.config.num_kv_blocks is None and self.device.type == "cpu":
            budget = DEFAULT_CPU_KV_BYTES
        if budget is None:
            return seqs, snapshots
        running = int(budget * self.config.state_memory_fraction) // per
        return min(seqs, max(1, running)), min(snapshots, budget // 8 // self.state_bytes_per_slot())

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                activations = self._profile_activations()
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int((free - activations) * DEFAULT_GPU_KV_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        slots = self.total_state_slots()
        states = slots * self.state_bytes_per_slot()
        num = (budget - states) // self.kv_bytes_per_block()
        if self.tp is not None:  # the budget is each rank's; every rank holds the blocks the smallest one has
            with self._following():
                num = self.tp.min_int(num)
        if num < 1:
            held = f" after {slots} state slots ({states} bytes)" if states else ""
            raise ValueError(f"kv_cache_memory_bytes={budget} leaves less than one KV block "
                             f"({self.kv_bytes_per_block()} bytes){held}")
        return num

    def _allocate_kv_cache(self) -> torch.Tensor:
        first = self.attn_layers[0]
        return self._zeros((len(self.attn_layers), 2, self.num_blocks, self.block_size, first.num_kv_heads,
                            first.head_dim), self.kv_dtype)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of the KV cache's (the "kv_cache" tag's): on CPU on a mapping of its own."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        home, tensor = host_memory.zeros(shape, dtype)
        self.kv_homes.append(home)
        return tensor

    def _allocate_routed_experts(self) -> torch.Tensor | None:
        """[KV slots + 1, MoE layers, top_k]: the experts each cached token was routed to (None if dense). Kept
        per slot, like the KV, so prefix-cache hits, forks and recomputes carry their tokens' routing; the last row
        takes what slot -1 writes (a CUDA graph's padding rows), no token's."""
        if not self.moe_blocks:
            return None
        top_k, num_experts = self.moe_blocks[0].top_k, self.moe_blocks[0].experts.num_experts
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        return self._zeros((self.num_blocks * self.block_size + 1, len(self.moe_blocks), top_k), dtype)

    def _allocate_states(self) -> list[torch.Tensor]:
        """The state pool: per kind of state (conv, recurrent) one [GDN layers, slots, ...] tensor, zero (the KV
        cache's tag: sleep releases it with the KV), each layer given its views."""
        if not self.gdn_layers:
            return []
        kinds = self.gdn_layers[0].state_shapes(self.dtype)
        slots = self.graph_state_scratch + (self.device.type == "cuda")
        states = [self._zeros((len(self.gdn_layers), slots, *shape), dtype) for shape, dtype in kinds]
        for i, layer in enumerate(self.gdn_layers):
            layer.conv_state, layer.rec_state = states[0][i], states[1][i]
        return states

    @_exclusive
    def apply_state_ops(self, ops: tuple[list[tuple[int, int]], list[int]]) -> None:
        """The scheduler's pending state-slot copies (forks, prefix hits), then its zeroings (fresh slots); on every
        tensor-parallel rank (each holds its heads' states)."""
        copies, zeros = ops
        if (copies or zeros) and self.tp_leader is not None:
            self.tp_leader.send("apply_state_ops", ops)
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for t in self.states:
                t[:, dst] = t[:, src]
        if zeros:
            index = torch.tensor(zeros, device=self.device)
            for t in self.states:
                t[:, index] = 0

    def _attach_cache(self, cache: torch.Tensor | None, routed: torch.Tensor | None) -> None:
        """Points every attention layer at its [2, blocks, block_size, heads, dim] slice of cache, and every MoE
        block at its [slots, top_k] slice of routed (None: the forward records no routing)."""
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = (None, None) if cache is None else (cache[i, 0], cache[i, 1])
        for i, block in enumerate(self.moe_blocks):
            block.routed = None if routed is None else routed[:, i]

    def routed_experts_of(self, seq: Sequence) -> torch.Tensor:
        """int32 [computed tokens, MoE layers, top_k]: the experts of a sequence's computed positions."""
        bs, block_table = self.block_size, seq.block_table
        slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(seq.num_computed_tokens)],
                             dtype=torch.int64,
                             device=self.device)
        return self.routed_experts[slots].to(device="cpu", dtype=torch.int32)

    @_exclusive
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self.tp_leader is not None:
            self.tp_leader.send("copy_blocks", copies)
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
            if self.routed_experts is not None:
                slots = self.num_blocks * self.block_size
                routed = self.routed_experts[:slots].view(self.num_blocks, self.block_size,
                                                          *self.routed_experts.shape[1:])
                routed[dst] = routed[src]

    # ------------------------------------------------------------------ tensor parallelism (rank 0's side)
    def _following(self, sync: bool = False):
        """Around what rank 0 runs while its workers run the same (tensor_parallel.Leader.guard): a failure there is
        a RuntimeError naming the rank that died. sync: rank 0's own forward, replay or head call, whose stream is
        waited for on leaving, and which a worker's death meanwhile fails too."""
        return self.tp_leader.guard(sync) if self.tp_leader is not None else contextlib.nullcontext()

    def _calibration(self) -> list[int] | None:
        """What a worker needs to measure KV scales in the forward it is sent: rank 0's live blocks while its attention
        layers observe (kv_scales.KVScaleManager.calibrating), else None."""
        if not any(layer.observer is not None for layer in self.attn_layers):
            return None
        return list(self.live_blocks())

    @_exclusive
    def commit_weights(self, staged: updater.Staged) -> int:
        """A validated update written on every rank or on none: the workers stage their shards of its tensors (those
        they received from the trainer beside rank 0: receive_with_workers, or else rank 0's, broadcast now) and
        answer before any rank writes; returns how many tensors rank 0 quantized."""
        if self.tp_leader is not None:
            received, self.worker_received = self.worker_received, None
            if received is None or len(received) != len(staged.items) or any(
                    r is not tensor for r, (_, tensor, _) in zip(received, staged.items)):
                if received is not None:  # what they received is not what commits: dropped
                    self.tp_leader.send("abort")
                self._stage_on_workers(staged)
            self.tp_leader.call("commit")
        return updater.commit(staged, self.kernels.quantize_into)

    def _stage_on_workers(self, staged: updater.Staged) -> None:
        """Each worker is sent the parts of the update's tensors it writes (its rows and columns; at T ranks about
        1 / T of a sharded weight), then stages them."""
        tensors = [tensor.detach() for _, tensor, _ in staged.items]
        specs = [(target.name, t.dtype, tuple(t.shape)) for (target, _, _), t in zip(staged.items, tensors)]
        with self._following():
            plans = self.tp_leader.call("plan_update", specs)
            self.tp_leader.send("stage")
            for rank, plan in enumerate(plans, 1):
                for tensor, region in zip(tensors, plan):
                    if region is not None:
                        self.tp.send(tensor_parallel.cut(tensor, region).contiguous().cpu(), rank)
            errors = self.tp_leader.replies()
        self._check_staged(errors)  # a refusal is the update's failure, not the group's

    def _check_staged(self, errors: list[tuple[str, str] | None]) -> None:
        """errors: each worker's (what failed: "transfer" or "stage", why) or None. A transfer that failed is a
        RuntimeError (the engine closes its weight-update group, as for its own), a refused tensor a ValueError;
        either way every worker drops what it staged."""
        failed = [(rank, err) for rank, err in enumerate(errors, 1) if err is not None]
        if failed:
            self.tp_leader.send("abort")
            rank, (what, why) = failed[0]
            if what == "transfer":
                raise RuntimeError(f"tensor-parallel rank {rank} could not receive the update: {why}")
            raise ValueError(f"tensor-parallel rank {rank} refused the update, nothing was written: {why}")

    @_exclusive
    def join_update_group(self, join, *args):
        """join(*args) (rank 0 joining a trainer's weight-update group: WeightsUpdateGroup's arguments, rank_offset
        among them) while every worker joins it at rank_offset + its rank; returns what join returned, or raises
        RuntimeError naming a worker that could not join."""
        if self.tp_leader is None:
            return join(*args)
        self.tp_leader.send("join_update_group", *args)
        group = None
        try:
            group = join(*args)
        finally:  # every worker's answer is read, whatever rank 0's join did
            with self._following():
                errors = [(rank, err) for rank, err in enumerate(self.tp_leader.replies(), 1) if err is not None]
            if errors or group is None:  # the workers that joined leave again
                self.tp_leader.call("leave_update_group")
                if group is not None:
                    group.destroy()
        if errors:
            rank, err = errors[0]
            raise RuntimeError(f"tensor-parallel rank {rank} could not join the weight-update group: {err}")
        return group

    @_exclusive
    def receive_with_workers(self, receive, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
        """receive() (rank 0's copy of an update a trainer broadcasts) while every worker receives its own and stages
        its shards; commit_weights of exactly these tensors then commits them on every rank, of any others drops
        theirs. A worker that could not receive or stage fails it with the worker's reason."""
        if self.tp_leader is None:
            return receive()
        self.worker_received = None
        self.tp_leader.send("receive_update", names, dtypes, shapes)
        try:
            received = receive()
        finally:
            with self._following():
                errors = self.tp_leader.replies()
        self._check_staged(errors)
        self.worker_received = [tensor for _, tensor in received]
        return received

    @_exclusive
    def leave_update_group(self) -> None:
        if self.tp_leader is not None:
            self.tp_leader.call("leave_update_group")

    @_exclusive
    def commit_lora(self, staged: lora.StagedAdapter) -> None:
        """A validated adapter (full A and B) written on every rank, each its slices."""
        if self.tp_leader is not None:  # from the host: a device tensor would unpickle onto rank 0's device
            host = {path: {shard: (a.to("cpu", copy=True), b.to("cpu", copy=True), scale)
                           for shard, (a, b, scale) in shards.items()} for path, shards in staged.shards.items()}
            self.tp_leader.call("commit_lora", dataclasses.replace(staged, shards=host))
        lora.commit_adapter(self.lora_layers, staged)

    @_exclusive
    def reload_weights(self) -> None:
        """Every weight read again from the model directory (seeded random ones with load_format dummy), on every
        rank."""
        if self.tp_leader is not None:
            self.tp_leader.call("reload")
        if self.config.load_format == "dummy":
            load_dummy(self.model, self.kernels.quantize_into, self.config.seed)
        else:
            load_checkpoint(self.model, self.model_dir, self.kernels.quantize_into, self.kernels.block_scales)

    @_exclusive
    def read_weight(self, hf_name: str) -> torch.Tensor:
        """Weight hf_name in the model dtype and the HF shape (FP8 dequantized), gathered from every rank's slice."""
        target = resolve(self.model, hf_name)
        if self.tp_leader is None:
            return read(target, self.dtype)
        mine = tensor_parallel.pieces(target, self.dtype)
        if mine and all(tp is None for _, tp, _ in mine):  # every rank holds all of it
            return mine[0][2]
        # assembled on the host, as the workers send theirs
        mine = [(index, tp, part.cpu()) for index, tp, part in mine]
        held = mine + [piece for theirs in self.tp_leader.call("read", hf_name) for piece in theirs]
        if target.kind == "elsewhere":  # an expert another rank holds whole
            return held[0][2]
        out = torch.empty(target.shape, dtype=held[0][2].dtype)  # a scale grid stays float32
        for index, tp, part in held:
            where = (tp.rows or slice(None),) + ((tp.cols,) if tp.cols is not None else ())
            if index and isinstance(index[0], torch.Tensor):  # rows picked one by one (Qwen3-Next's fused ones)
                out[(index[0][where[0]],) + where[1:]] = part
            else:
                out[index][where] = part
        return out.to(self.device)  # where a single rank's read leaves it

    @_exclusive
    def sync_kv_scales(self) -> None:
        """The workers take rank 0's KV scales (set outside a forward: from a checkpoint, an update's external
        scales), their live KV re-quantized where a scale changed."""
        if self.tp_leader is not None:
            scales = [(float(a.k_scale), float(a.v_scale), float(a.q_scale)) for a in self.attn_layers]
            self.tp_leader.send("kv_scales_set", scales, list(self.live_blocks()))

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing to do at one rank); the runner cannot step after. Waits up to
        SHUTDOWN_WAIT_S for a call in progress on another thread."""
        if self.tp_leader is not None:
            held = self.tp_leader.lock.acquire(timeout=SHUTDOWN_WAIT_S)
            try:
                self.tp_leader.close()
            finally:
                if held:
                    self.tp_leader.lock.release()

    # ------------------------------------------------------------------ sleep
    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors of the "weights" tag: every parameter and weight buffer (LoRA's), each storage once."""
        tensors = [p for _, p in self.model.named_parameters()] + [b for n, b in self.model.named_buffers()
                                                                    if n in self.weight_buffers]
        return list({_storage_id(t): t for t in tensors}.values())

    def resident_bytes(self, tag: str) -> int:
        """Bytes the tag holds while awake, over every tensor-parallel rank: what sleep releases (on CPU the weights'
        whole pages of their mapping, the weights that could not move aside)."""
        return self._resident_bytes(tag) + self.worker_bytes.get(tag, 0)

    def _resident_bytes(self, tag: str) -> int:
        if tag == "kv_cache":
            return sum(t.untyped_storage().nbytes() for t in self._kv_tensors())
        if self.home is not None:
            return self.home.weight_bytes
        return sum(t.untyped_storage().nbytes() for t in self.weight_tensors())

    @_exclusive
    def release(self, tag: str, keep: bool, spill_dir: str | None = None) -> int:
        """Hands a tag's memory back ("weights" or "kv_cache"), keeping the weights' bytes first when keep (on CPU in
        a Spill under spill_dir, on CUDA in host memory); returns the bytes released. On CPU the addresses stay (the
        pages read as zeros until restored); on CUDA the storages shrink to nothing and the decode graphs, which
        hold their addresses, are dropped (captured again by restore)."""
        nbytes = self.resident_bytes(tag)
        if self.device.type == "cpu":
            if tag == "kv_cache":
                for home in self.kv_homes:
                    home.release()
            else:
                region = self.home.mapping.memory[:self.home.weight_bytes]
                if keep:
                    self.kept[tag] = host_memory.Spill(region, spill_dir)
                self.home.mapping.release(self.home.weight_bytes)
            if self.tp_leader is not None:  # after rank 0's own (its spill may fail: then no rank released)
                self.tp_leader.call("release", tag, keep, spill_dir)
            return nbytes
        self.graphs = None
        tensors = self._tag_tensors(tag)
        sizes = [t.untyped_storage().nbytes() for t, _ in tensors]
        self.kept[tag] = [_host_copy(t) if keep or derived else None for t, derived in tensors]
        self.released_sizes[tag] = sizes
        for t, _ in tensors:
            t.untyped_storage().resize_(0)
        torch.cuda.empty_cache()
        if self.tp_leader is not None:  # after rank 0's own (its host copies may fail: then no rank released)
            self.tp_leader.call("release", tag, keep, spill_dir)
        return nbytes + sum(size for size, (_, derived) in zip(sizes, tensors) if derived)

    @_exclusive
    def restore(self, tag: str) -> None:
        """Takes a released tag's memory back: the bytes kept as they were, the rest zeros (as the kernel gives a
        released page back on CPU). What was kept stays kept until it is read back: a wake that fails can be tried
        again."""
        if self.tp_leader is not None:
            self.tp_leader.call("restore", tag)
        kept = self.kept.get(tag)
        if self.device.type != "cpu" and tag not in self.released_sizes:  # restored already (a wake tried again)
            return
        if self.device.type == "cpu":
            if kept is not None:
                kept.restore(self.home.mapping.memory[:self.home.weight_bytes])
        else:
            for (t, _), size, copy in zip(self._tag_tensors(tag), self.released_sizes[tag], kept):
                t.untyped_storage().resize_(size)
                if copy is not None:
                    _bytes_of(t).copy_(copy)
                else:
                    _bytes_of(t).zero_()
            del self.released_sizes[tag]
        self.kept.pop(tag, None)

    def _tag_tensors(self, tag: str) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, derived) of a tag's device storages, one tensor each: the KV cache's, or the weights' and then the
        model's other device buffers (derived from the config: rotary tables), which go with the weights and always
        come back."""
        if tag == "kv_cache":
            return [(t, False) for t in self._kv_tensors()]
        weights = self.weight_tensors()
        ids = {_storage_id(t) for t in weights}
        derived = {_storage_id(b): b for b in self.model.buffers()
                   if b.device.type != "cpu" and _storage_id(b) not in ids}
        return [(t, False) for t in weights] + [(b, True) for b in derived.values()]

    def _kv_tensors(self) -> list[torch.Tensor]:
        """The "kv_cache" tag's tensors: the KV cache, the routed experts and the state pool."""
        return [t for t in (self.kv_cache, self.routed_experts, *self.states) if t is not None]

    @_exclusive
    def recapture_graphs(self) -> None:
        """The decode graphs captured again after a CUDA sleep dropped them (counted and timed)."""
        if self.graphs is not None or self.graphs_off is not None:
            return
        start = time.perf_counter()
        self._graphs_guarded(self._start_graphs)
        self.graph_captures += 1
        self.graph_capture_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def rescale_kv(self, layer: int, blocks: list[int], old: tuple[float, float], new: tuple[float, float]) -> None:
        """Re-quantize one layer's FP8 K and V in `blocks` from scales `old` (k, v) to `new`, in place: the values
        they stand for stay what was written, within one more E4M3 rounding (attention_ref.quantize_fp8)."""
        if not blocks or self.kv_cache.dtype != FP8_DTYPE:
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for which, (before, after) in enumerate(zip(old, new)):
            if before != after:
                cache = self.kv_cache[layer, which]
                cache[index] = quantize_fp8(cache[index].float() * before, after)

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Device bytes a step at max_num_batched_tokens takes beyond the weights, measured before the KV cache is
        sized: one forward of that many tokens (a lone sequence over a private cache, whose own bytes the KV budget
        holds and are not counted), the logits of max_num_seqs sampled rows, and a chunk of prompt rows' float32
        logits with log_softmax's copy (prompt logprobs and scoring compute no more at once: PromptLogits)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        # every tensor-parallel rank profiles itself here, in this order (rank 0 sends its workers nothing)
        with self._following(sync=True):
            hidden = self._forward_detached([0] * n)
            sampled = self.model.compute_logits(hidden[:min(n, self.config.max_num_seqs)])
            prompt = self.model.compute_logits(hidden[:PromptLogits(None, hidden, self.vocab_size).rows])
        if prompt is not None:  # (a worker's share went to rank 0) a prompt chunk's float32 logits, log_softmax's copy
            torch.log_softmax(prompt.float(), dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden, sampled, prompt
        torch.cuda.empty_cache()
        scratch = -(-n // self.block_size) * self.kv_bytes_per_block() // len(self.attn_layers)  # one layer's
        activations = max(0, peak - scratch)
        logger.info("profile forward of %d tokens: %.2f GiB of activations at the peak", n, activations / 2**30)
        return activations

    @_exclusive
    @torch.inference_mode()
    def forward_detached(self, token_ids: list[int]) -> torch.Tensor:
        """One forward of token_ids as a lone sequence against a private KV cache (its final hidden states), for
        calibration and the start-up profile: the engine's cache and the scheduler's blocks are untouched."""
        if self.tp_leader is not None:
            self.tp_leader.send("forward_detached", token_ids, self._calibration())
        with self._following(sync=True):
            return self._forward_detached(token_ids)

    def _forward_detached(self, token_ids: list[int]) -> torch.Tensor:
        n, bs, first = len(token_ids), self.block_size, self.attn_layers[0]
        num_blocks = -(-n // bs)
        scratch = torch.zeros(2, num_blocks, bs, first.num_kv_heads, first.head_dim, dtype=self.kv_dtype,
                              device=self.device).expand(len(self.attn_layers), -1, -1, -1, -1, -1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None])
        try:
            self._attach_cache(scratch, None)  # one scratch cache shared by every layer, one after the other
            return self.model(torch.tensor(token_ids, dtype=torch.int64, device=dev),
                              torch.arange(n, dtype=torch.int64, device=dev), meta)
        finally:
            self._attach_cache(self.kv_cache, self.routed_experts)

    @_exclusive
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], feed: torch.Tensor | None = None) -> StepOutput:
        """The step's logits (and prompt logits). feed: with async scheduling, the sampler output [n, 3] of the step
        before, still on the device, whose tokens are this decode step's inputs (the host holds placeholders)."""
        if self.graphs is not None and self.graphs.takes(scheduled):
            logits = self._graphs_guarded(self.graphs.run, scheduled, feed)
            if logits is not None:
                with self._following(sync=True):  # the replay's collectives land (or a worker's death fails it)
                    return StepOutput(logits, {})
        flat, prompt_rows = self._flatten(scheduled)
        if feed is not None:  # no graph after all (a capture failed): the tokens read here, one a row
            flat[0][:] = [int(t) for t in feed[:, 0].tolist()]
        if self.tp_leader is not None:
            self.tp_leader.send("execute", flat, self._calibration())
        with self._following(sync=True):
            input_ids, positions, meta, sample_rows = self._tensors(flat)
            hidden = self.model(input_ids, positions, meta)
            logits = self._sampled_logits(hidden, sample_rows)
        prompt_logits = {seq_id: PromptLogits(self.head_logits, hidden[rows], self.vocab_size)
                         for seq_id, rows in prompt_rows.items()} if prompt_rows else {}  # rows: slices of the step
        return StepOutput(logits, prompt_logits)

    @property
    def fused_sampler(self) -> Callable | None:
        """The fused sampler the output processor calls (the kernel set's sample_rows), through the decode graphs'
        sampler graph where graphs run."""
        if self.kernels.sample_rows is None or self.graphs_off is not None:
            return self.kernels.sample_rows
        return self._sample_rows

    def _sample_rows(self, logits, temperature, uniform, need_raw, forced=None):
        if self.graphs is not None and forced is None:
            out = self._graphs_guarded(self.graphs.sample, logits, temperature, uniform, need_raw, workers=False)
            if out is not None:
                return out
        return self.kernels.sample_rows(logits, temperature, uniform, need_raw, forced)

    def _sampled_logits(self, hidden: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor | None:
        """The LM head over a step's rows to sample (every row of a decode step: its hidden states as they are);
        tensor-parallel ranks each compute their vocabulary rows' share (None on the workers)."""
        if not len(sample_rows):
            return None
        return self.model.compute_logits(hidden if len(sample_rows) == len(hidden) else hidden[sample_rows])

    @_exclusive
    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden rows outside a step's forward (prompt logprobs, scoring: PromptLogits); with
        tensor parallelism the workers are sent the rows and each computes its vocabulary rows' share."""
        if self.tp_leader is not None:
            # a host copy: pickling a view would send its whole base, a device tensor would land on rank 0's device
            self.tp_leader.send("head_logits", hidden.to("cpu", copy=True))
        with self._following(sync=True):
            return self.model.compute_logits(hidden)

    def forward_flat(self, flat: tuple) -> None:
        """A tensor-parallel worker's step: the forward of the flat inputs rank 0 sent, and its share of the rows to
        sample's logits (which rank 0 gathers)."""
        input_ids, positions, meta, sample_rows = self._tensors(flat)
        self._sampled_logits(self.model(input_ids, positions, meta), sample_rows)

    def _flatten(self, scheduled: list[ScheduledSeq]) -> tuple[tuple, dict[int, slice]]:
        """The step's inputs as lists (what rank 0 sends tensor-parallel workers), and the prompt rows by sequence."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        sample_rows, prompt_rows = [], {}
        bs = self.block_size
        for item in scheduled:
            seq, d = item.seq, len(item.draft)
            c, n = seq.num_computed_tokens, item.num_new_tokens + d
            ids += seq.token_ids[c:c + n - d]
            ids += item.draft
            positions += range(c, c + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            if seq.needs_prompt_logprobs:
                prompt_rows[seq.seq_id] = slice(starts[-1], starts[-1] + n)
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            tables.append(table)
            if item.samples:  # the last token's row, and one after each draft token
                sample_rows += range(starts[-1] - 1 - d, starts[-1])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        state_slots, snapshots = None, []
        if self.gdn_layers:
            state_slots = [item.seq.state_slot for item in scheduled]
            snapshots = [(i, *snapshot) for i, item in enumerate(scheduled) for snapshot in item.snapshots]
        return (ids, positions, slots, starts, seq_lens, padded, sample_rows, state_slots, snapshots), prompt_rows

    def _tensors(self, flat: tuple):
        """(input ids, positions, attention metadata, rows to sample) on the device, from _flatten's lists."""
        ids, positions, slots, starts, seq_lens, padded, sample_rows, state_slots, snapshots = flat
        dev = self.device
        if state_slots is not None:
            state_slots = torch.tensor(state_slots, dtype=torch.int64, device=dev)
        if dev.type != "cpu":
            staged = self._stage_on_device(ids, positions, slots, starts, seq_lens, padded, sample_rows)
            staged[2].state_slots, staged[2].state_snapshots = state_slots, snapshots
            return staged
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev), state_slots=state_slots,
            state_snapshots=snapshots)
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.int64, device=dev))

    def _stage_on_device(self, ids, positions, slots, starts, seq_lens, tables, sample_rows):
        """The step's inputs in one host buffer (pinned where CUDA can pin it: torch's caching host allocator
        reuses the block once its copy is done) and to the device in one copy; the device casts what attention
        takes as int32."""
        fields = (ids, positions, slots, starts, seq_lens, sample_rows)
        host = torch.tensor([x for f in fields for x in f] + [x for t in tables for x in t], dtype=torch.int64)
        staged = torch.empty(host.shape, dtype=torch.int64, device=self.device)
        staged.copy_(cuda_graphs.pin(host), non_blocking=True)
        parts, at = [], 0
        for f in fields:
            parts.append(staged[at:at + len(f)])
            at += len(f)
        ids_d, positions_d, slots_d, starts_d, lens_d, rows_d = parts
        table_d = staged[at:].view(len(tables), -1)
        meta = AttentionMetadata(slot_mapping=slots_d, query_start_loc=starts_d.to(torch.int32),
                                 seq_lens=lens_d.to(torch.int32), block_tables=table_d.to(torch.int32))
        return ids_d, positions_d, meta, rows_d


def _weight_buffers(model: torch.nn.Module) -> frozenset[str]:
    """The names of the model's buffers that are weights (LoRA's A and B: update_lora writes them)."""
    return frozenset(f"{name}.{attr}" for name, m in model.named_modules() if isinstance(m, LoRA)
                     for attr in ("lora_a", "lora_b"))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's whole storage in host memory (page-locked where CUDA can pin it)."""
    source = _bytes_of(t)
    return cuda_graphs.pin(torch.empty(source.shape, dtype=torch.uint8)).copy_(source)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of t, on its device."""
    return t.new_empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _storage_id(t: torch.Tensor) -> int:
    """Which storage a tensor views (not where its bytes are: a released storage has none)."""
    return t.untyped_storage()._cdata
