"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step of a 32-layer model issues about 2,800 torch calls and over a thousand kernel launches
(benchmarks/host_side.py); on an H200 the host would take most of a step that the GPU finishes in ~2 ms. A CUDA
graph records those launches once and replays them with one call. What a graph replays is fixed at capture: the
shapes, every pointer and every Python number handed to a kernel. So:

  * Buckets: a step of n sequences runs the graph of the smallest bucket >= n (1, 2, 4, 8, then multiples of 16
    up to max_num_seqs, at most 256); rows n.. are padding: token 0 at position 0, KV slot -1 (the cache write
    skips it), a context of one token over block 0. Their outputs are never read, and every kernel computes a
    row from that row alone, so real rows get what an eager step of the bucket's size gives them; with
    `batch_invariant=True` that is what an eager step of n rows gives, bit for bit.
  * Static inputs: the step's token ids, positions, slots, context lengths, a hybrid model's state slots and block
    tables go into one host buffer (pinned where CUDA can pin it) and to the device in one copy; the graphs read
    that device buffer (their first ops cast the lengths and tables to int32); the logits come back in a static
    output, sliced to n rows.
  * Hybrid models (Qwen3.5 dense and MoE, Qwen3-Next): a decode step's GDN layers take their state slots
    from the static buffer and their one-token lengths as known (AttentionMetadata.decode); padding rows advance the
    state pool's scratch slot (one slot past those the scheduler hands out), never a sequence's. A step that writes a
    state snapshot (prefix caching at a block's end) runs eagerly.
  * What is baked in: the KV scales (Python floats handed to the attention kernels) and the LoRA segments (read on
    the host). A step compares them with those of the capture and drops every graph when they changed (after a
    weight update that recalibrates the scales, or update_lora); buckets are captured again on first use.
  * MoE models: the routing (kernels/moe_triton.align_rows) sorts a step's rows by expert on the device into a
    fixed number of tiles for the row count, so a graph holds it; padding rows record their experts at slot -1,
    the routed-experts buffer's spare last row.
  * The sampler: when every row of a graph step takes the fused sampler (greedy or temperature alone, the
    sampled token's logprob at most: sampler.sample_rows_torch), a second, small graph per bucket (and per
    raw-logprob need) samples the captured logits; the rows' temperatures and uniforms go to the device in one
    copy (padding rows greedy), and one copy brings back the tokens and logprobs. Its bits are the eager
    sampler's. It reads the bucket graph's output, so it is dropped whenever that graph is.
  * Only pure decode steps: one new token per sequence, every row sampled, no draft tokens, no prompt logprobs,
    no KV observer (calibration). Anything else runs eagerly, as do engines the graphs cannot serve (not CUDA,
    `enforce_eager=True`, FlashInfer attention, which plans on the host); `get_stats().kernels["cuda_graphs"]`
    says which and why.

  * Tensor parallelism: every rank holds its own graphs, the all-reduces and the LM head's gather captured in them.
    Rank 0 decides (this bucket, drop every graph, capture) and sends each worker the step's rows and its decision
    (tp_worker.graph_step) before replaying its own; the workers capture their buckets when rank 0 does
    (capture_all), so the ranks' collectives meet in one order.

Capturing needs a CUDA device. `capture` is a parameter so the tests can drive the same buffers, padding and
invalidation on the CPU (tests/test_cuda_graphs.py, under tests/fake_cuda.py: no host synchronisation inside
the captured region, bitwise equal to eager steps).
"""

import logging
from collections.abc import Callable

import torch

from fp8engine.model_executor.layers import sampler
from fp8engine.model_executor.layers.attention import AttentionMetadata
from fp8engine.request import ScheduledSeq

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256

# (forward) -> (replay, output): runs forward once under capture and returns the replay and the captured output.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs (at most
    MAX_GRAPH_BATCH), and max_num_seqs itself when it is not one of them."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    return sizes if sizes[-1] == top else sizes + [top]


def capture_cuda() -> Capture:
    """The capture a CUDA device gives: one eager run on a side stream first (Triton compiles its kernels, the
    libraries set up their workspaces: nothing of that may happen inside a capture), then torch.cuda.graph; every
    bucket's graph allocates from one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out
    return capture


def unavailable_reason(config, runner) -> str | None:
    """Why decode steps of this engine cannot run from graphs (None: they can)."""
    if runner.device.type != "cuda":
        return "not a CUDA device"
    if config.enforce_eager:
        return "enforce_eager=True"
    if runner.kernels.names.get("attention", "").startswith("flashinfer"):
        return "FlashInfer attention plans each batch on the host"
    return None


class DecodeGraphs:
    """The graphs of one model runner: static inputs at the largest bucket, a graph per bucket on demand."""

    def __init__(self, runner, max_num_seqs: int, capture: Capture):
        self.runner = runner
        self.sizes = buckets(max_num_seqs)
        self.capture = capture
        top = self.sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        # A bucket of b rows reads [ids | positions | slots | context lengths | (state slots) | block tables
        # (b x max_blocks)], b of each, from the front of one int64 buffer: one host-to-device copy a step; the
        # graph converts.
        self.fields = 5 if runner.gdn_layers else 4
        numel = top * (self.fields + self.max_blocks)
        # Host buffers, two of each, a step taking them in turn: a step may be staged while the one before still
        # runs (async_scheduling), and a buffer is written again only once the copy out of it two steps ago is done
        # (that step's results were read back, or the host waited for them)
        self.stagings = [pinned(numel), pinned(numel)]
        self.turn = 0
        self.inputs = torch.zeros(numel, dtype=torch.int64, device=runner.device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=runner.device)  # a token a row
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        # The sampler's graphs, by (bucket, raw logprobs wanted), and their static [temperatures | uniforms]
        self.samplers: dict[tuple[int, bool], tuple[Callable[[], None], torch.Tensor]] = {}
        self.sample_stagings = [pin(torch.zeros(2 * top, dtype=torch.float32)) for _ in range(2)]
        self.results = [pin(torch.zeros(top, 3, dtype=torch.float64)) for _ in range(2)]  # the sampler's, read back
        self.sample_inputs = torch.zeros(2 * top, dtype=torch.float32, device=runner.device)
        self.last: tuple[torch.Tensor, int] | None = None  # the last replay's logits and bucket, until sampled
        self.key: tuple | None = None
        self.num_captures = 0
        self.num_replays = 0
        self.num_sampler_replays = 0

    # ------------------------------------------------------------------ when
    def takes(self, scheduled: list[ScheduledSeq]) -> bool:
        """A pure decode step of at most the largest bucket, with nothing a graph cannot replay."""
        if not scheduled or len(scheduled) > self.sizes[-1]:
            return False
        for item in scheduled:
            if item.num_new_tokens != 1 or item.draft or not item.samples or item.seq.needs_prompt_logprobs:
                return False
            if item.snapshots:  # a hybrid's state snapshot: written eagerly
                return False
        return not any(layer.observer is not None for layer in self.runner.attn_layers)

    def _baked(self) -> tuple:
        """What the captured kernels hold as host values: the KV scales, the LoRA segments."""
        scales = tuple((a.k_scale, a.v_scale, a.q_scale) for a in self.runner.attn_layers)
        lora = tuple(tuple(m.ranks) for m in self.runner.lora_layers.values())
        return scales, lora

    # ------------------------------------------------------------------ run
    def run(self, scheduled: list[ScheduledSeq], feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences, from the bucket's graph. feed: the step before's
        sampler output [n, 3] on the device, whose tokens are these rows' inputs (async_scheduling: the host
        holds placeholders for them). Tensor-parallel workers replay theirs with it (step: what to drop and
        capture is rank 0's call)."""
        key = self._baked()
        clear = key != self.key
        if clear and self.graphs:
            logger.info("CUDA graphs: the KV scales or the LoRA adapter changed; graphs are captured again")
        self.key = key
        n = len(scheduled)
        size = next(b for b in self.sizes if b >= n)
        rows = self._rows(scheduled)
        capture = clear or size not in self.graphs
        if self.runner.tp_leader is not None:
            self.runner.tp_leader.send("graph_step", rows, size, clear, capture)
        logits = self.step(rows, size, clear, capture, feed)
        self.last = (logits[:n], size)  # for sample()
        return self.last[0]

    def step(self, rows: tuple, size: int, clear: bool, capture: bool,
             feed: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step's rows (_rows) staged, the bucket's graph captured first if `capture` (every graph dropped
        first if `clear`), then replayed; its static output."""
        if clear:
            self.graphs.clear()
            self.samplers.clear()
        self.turn ^= 1
        self._stage(rows, size)
        if feed is not None:
            # the ids field: the tokens the step before drew, float64 -> int64
            self.inputs[:len(feed)].copy_(feed[:, 0])
        if capture:
            self.graphs[size] = self.capture(lambda: self._forward(size))
            self.num_captures += 1
        elif size not in self.graphs:  # a worker told to replay what it never captured: out of step with rank 0
            raise RuntimeError(f"no CUDA graph of bucket {size} to replay (rank 0 has one)")
        replay, out = self.graphs[size]
        replay()
        self.num_replays += 1
        return out

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
               need_raw: bool) -> torch.Tensor | None:
        """The fused sampler's [n, 3] (sampler.sample_rows_torch) over the last replay's logits, from the bucket's
        sampler graph; None when `logits` are not those (an eager step, rows gathered for forks or a mixed batch).
        temperature, uniform: [n] host tensors, staged in one copy from this turn's buffer."""
        if self.last is None or logits is not self.last[0]:
            return None
        n, size = len(logits), self.last[1]
        self.last = None
        staging = self.sample_stagings[self.turn]
        staged = staging[:2 * size].view(2, size)
        staged[:, n:] = 0.0  # padding rows: greedy
        staged[0, :n], staged[1, :n] = temperature, uniform
        self.sample_inputs[:2 * size].copy_(staging[:2 * size], non_blocking=True)
        key = (size, need_raw)
        if key not in self.samplers:
            self.samplers[key] = self.capture(lambda: self._sample_forward(size, need_raw))
        replay, out = self.samplers[key]
        replay()
        self.num_sampler_replays += 1
        return out[:n]

    def capture_all(self) -> None:
        """Every bucket's graph, largest first, on padding rows alone (nothing is written to the cache): the
        warm-up at start-up that compiles the decode kernels at every batch size a step will meet (a
        tensor-parallel rank 0 has its workers capture theirs alongside: their collectives meet)."""
        if self.runner.tp_leader is not None:
            self.runner.tp_leader.send("capture_graphs")
        self.key = self._baked()
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._stage(self._rows([]), size, wait=True)
                self.graphs[size] = self.capture(lambda size=size: self._forward(size))
                self.num_captures += 1

    def _views(self, buffer: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, context lengths, state slots or None, block tables) of a bucket in `buffer`'s
        layout."""
        f = self.fields
        fields = list(buffer[:f * size].view(f, size).unbind(0)) + [None] * (5 - f)
        return (*fields, buffer[f * size:size * (f + self.max_blocks)].view(size, self.max_blocks))

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slots, lens, states, tables = self._views(self.inputs, size)
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=lens.to(torch.int32), block_tables=tables.to(torch.int32),
                                 state_slots=states, decode=True)
        model = self.runner.model
        hidden = model(ids, positions, meta)
        logits = model.compute_logits(hidden)
        return hidden[:0] if logits is None else logits  # a tensor-parallel worker's: rank 0 holds the logits

    def _sample_forward(self, size: int, need_raw: bool) -> torch.Tensor:
        temperature, uniform = self.sample_inputs[:2 * size].view(2, size)
        return sampler.sample_rows_torch(self.graphs[size][1], temperature, uniform, need_raw)

    def _rows(self, scheduled: list[ScheduledSeq]) -> tuple:
        """A decode step's rows as lists (what rank 0 sends its tensor-parallel workers): token ids, positions,
        slots, context lengths, block tables and (hybrid models) state slots."""
        bs = self.runner.block_size
        tok, pos, slot, length, tables = [], [], [], [], []
        for item in scheduled:
            seq = item.seq
            c, table = seq.num_computed_tokens, seq.block_table
            tok.append(seq.token_ids[c])
            pos.append(c)
            slot.append(table[c // bs] * bs + c % bs)
            length.append(c + 1)
            tables.append(table)
        states = [item.seq.state_slot for item in scheduled] if self.fields == 5 else None
        return tok, pos, slot, length, tables, states

    def _stage(self, rows: tuple, size: int, wait: bool = False) -> None:
        """A step's rows (_rows) into the pinned buffer, rows n..size as padding (token 0 at position 0, slot -1, a
        one-token context over block 0, the state pool's scratch slot), then to the device in one copy. Table
        columns past a sequence's blocks keep what they held: attention reads a sequence's blocks only. This turn's
        buffer (see __init__; capture_all waits for its copies: `wait`)."""
        tok, pos, slot, length, table_rows, state_rows = rows
        n = len(tok)
        staging = self.stagings[self.turn]
        ids, positions, slots, lens, states, tables = self._views(staging, size)
        pad = size - n
        ids[:size] = torch.tensor(tok + [0] * pad, dtype=torch.int64)
        positions[:size] = torch.tensor(pos + [0] * pad, dtype=torch.int64)
        slots[:size] = torch.tensor(slot + [-1] * pad, dtype=torch.int64)
        lens[:size] = torch.tensor(length + [1] * pad, dtype=torch.int64)
        width = max((len(t) for t in table_rows), default=0)
        if n and width:
            tables[:n, :width] = torch.tensor([t + [0] * (width - len(t)) for t in table_rows], dtype=torch.int64)
        tables[n:, 0] = 0
        if states is not None:
            scratch = self.runner.graph_state_scratch
            states[:size] = torch.tensor(state_rows + [scratch] * pad, dtype=torch.int64)
        used = size * (self.fields + self.max_blocks)
        self.inputs[:used].copy_(staging[:used], non_blocking=not wait)

    def read_back(self, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying a step's sampler output [n, 3] into the front of this turn's page-locked host buffer
        without waiting; the function returned waits for the copy (a CUDA event) and returns the host rows."""
        dst = self.results[self.turn][:len(out)]
        dst.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> torch.Tensor:
            done.synchronize()
            return dst
        return wait


def pinned(numel: int) -> torch.Tensor:
    """An int64 host buffer, page-locked where CUDA can pin it (a pinned source lets the copy run asynchronously)."""
    return pin(torch.zeros(numel, dtype=torch.int64))


def pin(host: torch.Tensor) -> torch.Tensor:
    """host in page-locked memory where CUDA can pin it, else host itself (a CPU build, the tests' stand-in)."""
    try:
        return host.pin_memory()
    except RuntimeError:
        return host
