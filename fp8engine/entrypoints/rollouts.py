"""Token-in/token-out generation for the routes other RL stacks call (vllm_api.py, sglang_api.py).

Their clients name each request themselves (vLLM's request_id, SGLang's rid) and end it by that name
(/abort_requests, /abort_request): `Rollouts` runs a request to its end and keeps the engine ids behind every
name still running, so an abort by name ends it early and its caller gets the tokens sampled so far, with
finish reason "abort", as both servers answer it.
"""

import uuid

from fp8engine.engine import Prompt
from fp8engine.entrypoints.async_engine import AsyncEngine, EngineAsleep, EnginePaused
from fp8engine.entrypoints.protocol import ApiError
from fp8engine.outputs import RequestOutput
from fp8engine.sampling_params import SamplingParams


VLLM_ID_PREFIX = "generate-tokens-"  # vLLM's /inference/v1/generate answers request_id with it, and aborts by it


class Rollouts:
    """The requests the other stacks' routes started, by the caller's id."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.live: dict[str, list[str]] = {}  # caller's id -> the engine's request ids

    async def run(self, prompts: list[Prompt], params: list[SamplingParams], rid: str | None,
                  names: list[str] | None = None) -> list[RequestOutput]:
        """The final output of every prompt, in order; `rid` names them all, `names` (one per prompt) each alone.
        ApiError 400 for a bad prompt or parameters (naming what was wrong), 409 for an id already running, 503
        while paused or asleep."""
        rid = rid or uuid.uuid4().hex
        engine_ids = [f"{rid}-{i}" for i in range(len(prompts))]
        named = {rid: engine_ids} | {name: [i] for name, i in zip(names or (), engine_ids)}
        taken = sorted(named.keys() & self.live.keys())
        if taken:
            raise ApiError(409, f"request id {taken[0]!r} is already running", param="rid",
                           code="duplicate_request_id")
        self.live |= named
        try:
            try:
                stream = await self.engine.add(prompts, params, rid)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
            except EnginePaused as exc:
                raise ApiError(503, str(exc), code="paused") from None
            except EngineAsleep as exc:
                raise ApiError(503, str(exc), code="sleeping") from None
            finals: dict[int, RequestOutput] = {}
            try:
                async for index, out in stream:
                    finals[index] = out
            finally:
                stream.close()  # a client that went away: its requests end here
            return [finals[i] for i in range(len(prompts))]
        finally:
            for name in named:
                del self.live[name]

    async def abort(self, rids: list[str] | None) -> int:
        """End the named requests (None: every request the engine runs, ours or not) without pausing; how many
        prompts were still running. Unknown ids are skipped, as vLLM and SGLang do."""
        if rids is None:
            return await self.engine.abort_running()
        named = (self.live.get(rid, self.live.get(rid.removeprefix(VLLM_ID_PREFIX), ())) for rid in rids)
        return await self.engine.abort_ids([i for ids in named for i in ids])


def spans(versions: list[int]) -> list[dict]:
    """Contiguous runs of one weight version over a sample's tokens ({"version", "start", "end"}, end exclusive), as
    vLLM's WeightVersionSpan and SGLang's weight_versions give them."""
    runs: list[dict] = []
    for i, version in enumerate(versions):
        if runs and runs[-1]["version"] == str(version):
            runs[-1]["end"] = i + 1
        else:
            runs.append({"version": str(version), "start": i, "end": i + 1})
    return runs
