"""AsyncEngine: one thread owns the LLMEngine; asyncio code reaches it only through a command queue.

The engine thread runs queued commands (add, abort, pause, weight updates, stats), then calls
`step()` while there is work and streams each step's outputs to the asyncio queues of the waiting
requests, so requests from many clients are batched continuously and the event loop never blocks
on a forward pass. A caller that stops listening (a client that disconnects) has its requests
aborted, which frees their KV blocks.

Pause modes: "abort" aborts in-flight requests and refuses new ones; "wait" lets in-flight
requests finish and refuses new ones; "keep" stops stepping but keeps (and accepts) requests.
Refused requests raise `EnginePaused`. `resume()` clears the pause.
"""

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from fp8engine.engine import LLMEngine, Prompt
from fp8engine.outputs import EngineStats, RequestOutput, SleepReport, WeightUpdateReport
from fp8engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_MODES = ("abort", "wait", "keep")


class EnginePaused(RuntimeError):
    """The engine is paused in "abort" or "wait" mode and takes no new requests."""


class EngineAsleep(RuntimeError):
    """The engine sleeps (or waits for the weights a level-2 sleep released) and takes no new requests."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


class AsyncEngine:
    """Drives an LLMEngine from its own thread; every method is called from asyncio code."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.pause_mode: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._idle_waiters: list[concurrent.futures.Future] = []
        self._thread = threading.Thread(target=self._run, name="fp8engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; requests still streaming end with an error."""
        self._commands.put(None)
        self._thread.join()

    # ------------------------------------------------------------ asyncio side
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread between steps; its result or exception comes back here."""
        return await self._call(lambda: fn(self.engine))

    async def add(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                  request_id: str) -> "RequestStream":
        """Add one request per prompt (all or none; params for all, or one per prompt); iterate the
        returned stream for their outputs.

        ValueError for a bad prompt or params, EnginePaused while paused in "abort"/"wait" mode.
        """
        if not isinstance(params, list):
            params = [params] * len(prompts)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids)
        loop = asyncio.get_running_loop()
        try:
            await self._call(lambda: self._add(prompts, params, ids, loop, stream.queue))
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown ids are ignored) without waiting; their streams end with "abort"."""
        self._submit(lambda: self._abort(request_ids))

    async def abort_ids(self, request_ids: list[str]) -> int:
        """Abort requests by engine id (unknown or finished ones are skipped) without pausing; how many were
        running. Their streams end with "abort" and the tokens sampled so far."""
        return await self._call(lambda: self._abort(request_ids))

    async def abort_running(self) -> int:
        """Abort every request in flight without pausing (new requests are still taken); how many there were."""
        return await self._call(lambda: self._abort(list(self._streams)))

    def abort_all(self) -> None:
        """Pause in "abort" mode without waiting (callable from a signal handler): every request is
        aborted and new ones are refused."""
        self._submit(lambda: self._set_pause("abort"))

    async def pause(self, mode: str) -> int:
        """Pause in `mode` ("wait" returns once in-flight requests finished); returns how many were aborted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        num_aborted = await self._call(lambda: self._set_pause(mode))
        if mode == "wait":
            idle: concurrent.futures.Future = concurrent.futures.Future()
            self._submit(lambda: self._idle_waiters.append(idle))
            await asyncio.wrap_future(idle)
        return num_aborted

    async def resume(self) -> None:
        await self._call(lambda: self._set_pause(None))

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable, *,
                             weight_version: int | None = None, flush_cache: bool = True,
                             in_flight: str = "wait", kv_on_update: str = "keep") -> WeightUpdateReport:
        """LLMEngine.update_weights in the engine thread, between two steps.

        in_flight="wait" finishes unfinished requests on the old weights first (even while paused in
        "keep" mode), inside the update: their last tokens arrive together when it is done. Pause in
        "wait" mode first to keep streams smooth. "abort" aborts them. "keep" lets them go on, sampled by
        the new weights from the next step (kv_on_update: their KV kept, or recomputed under the new weights).
        """
        return await self._call(lambda: self._updated(self.engine.update_weights(
            weights, weight_version=weight_version, flush_cache=flush_cache, in_flight=in_flight,
            kv_on_update=kv_on_update)))

    async def update_lora(self, adapter: Mapping[str, torch.Tensor] | Iterable, scaling, *,
                          weight_version: int | None = None, flush_cache: bool = True,
                          in_flight: str = "wait", kv_on_update: str = "keep") -> WeightUpdateReport:
        """LLMEngine.update_lora in the engine thread, between two steps (in_flight as update_weights)."""
        return await self._call(lambda: self._updated(self.engine.update_lora(
            adapter, scaling, weight_version=weight_version, flush_cache=flush_cache, in_flight=in_flight,
            kv_on_update=kv_on_update)))

    async def sleep(self, level: int, tags: list[str] | None, in_flight: str) -> SleepReport:
        """LLMEngine.sleep in the engine thread, between two steps; the final outputs of the requests it finished
        (in_flight="wait") or aborted go out at once (the loop does not step while the engine sleeps)."""
        return await self._call(lambda: self._slept(self.engine.sleep(level, tags, in_flight=in_flight)))

    async def stats(self) -> EngineStats:
        return await self.call(LLMEngine.get_stats)

    async def _call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: _run_into(future, fn))
        return await asyncio.wrap_future(future)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while self._run_commands(block=not self._should_step()):
            if self._should_step():
                self._step()
            self._notify_idle()
        self._fail_all(RuntimeError("the engine loop stopped"))

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once stop was requested."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            try:
                command()
            except Exception:
                logger.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _should_step(self) -> bool:
        return self.pause_mode != "keep" and self.engine.has_unfinished_requests() and self.engine.ready()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting every request")
            self._fail_all(exc)
            return
        self._deliver(outputs)

    def _add(self, prompts: list[Prompt], params: list[SamplingParams], ids: list[str],
             loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
        if self.pause_mode in ("abort", "wait"):
            raise EnginePaused(f"the engine is paused (mode {self.pause_mode!r}); retry after /resume")
        if not self.engine.ready():
            raise EngineAsleep(self.engine.not_ready_reason())
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                added.append(self.engine.add_request(prompt, p, request_id))
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        for index, request_id in enumerate(added):
            self._streams[request_id] = _Stream(loop, outputs, index)

    def _abort(self, ids: list[str]) -> int:
        outputs = [out for out in map(self.engine.abort_request, ids) if out is not None]
        self._deliver(outputs)
        return len(outputs)

    def _set_pause(self, mode: str | None) -> int:
        self.pause_mode = mode
        return self._abort(list(self._streams)) if mode == "abort" else 0

    def _slept(self, report: SleepReport) -> SleepReport:
        if self.engine.has_pending_outputs():
            self._step()  # hands back the pending outputs alone while the engine sleeps
        return report

    def _updated(self, report: WeightUpdateReport) -> WeightUpdateReport:
        """After an update in the engine thread: a step, so the outputs it finished (in_flight="wait") go out."""
        if self.engine.ready():
            self._step()
        return report

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, (stream.index, out)))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort_request(request_id)
            _call_soon(stream.loop, _put_all, [(stream.queue, exc)])

    def _notify_idle(self) -> None:
        if self._idle_waiters and not self.engine.has_unfinished_requests():
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.set_result(None)


class RequestStream:
    """Outputs of the requests one `add` made, as (prompt index, RequestOutput) per engine step that
    advanced them, until all finished. `close()` aborts the unfinished ones (freeing their blocks)."""

    def __init__(self, engine: AsyncEngine, ids: list[str]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._engine = engine
        self._ids = ids
        self._unfinished = set(range(len(ids)))

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        index, out = item
        if out.finished:
            self._unfinished.discard(index)
        return index, out

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort([self._ids[i] for i in self._unfinished])
            self._unfinished.clear()


def _run_into(future: concurrent.futures.Future, fn: Callable[[], T]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the caller's event loop is closed; nobody is listening any more
