"""The trainer's side of a standalone-mode sync through FP8EngineCheckpointEngine, in a process of its own (as
veRL's FSDP workers are): two trainer ranks built as veRL builds them (rank 0 the master), rank 0 broadcasting a
safetensors file's float32 tensors, rank 1 walking the same generator. Prints the master's metadata (a JSON line:
the rollout side's init_process_group needs it), then what was sent.

python verl_ce_trainer.py FILE GLOBAL_STEPS
"""

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from safetensors.torch import load_file
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # importing verl loads the fp8engine plugin


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2])
    engine_cls = CheckpointEngineRegistry.get("fp8engine")
    ranks = [engine_cls(bucket_size=1 << 20, is_master=rank == 0, timeout_s=60) for rank in range(2)]
    metadata = [ce.prepare() for ce in ranks] + [{}]
    actor_kwargs, _ = engine_cls.build_topology(2, 1, metadata)
    for rank, ce in enumerate(ranks):
        ce.init_process_group(**{key: values[rank] for key, values in actor_kwargs.items()})
    print(json.dumps(metadata[0]), flush=True)
    weights = list(load_file(path).items())
    walked = []

    def other_rank():
        for name, tensor in weights:
            walked.append(name)
            yield name, tensor

    with ThreadPoolExecutor(1) as pool:
        walking = pool.submit(asyncio.run, ranks[1].send_weights(other_rank(), global_steps=steps))
        sent = asyncio.run(ranks[0].send_weights(iter(weights), global_steps=steps))
        walking.result()
    for ce in ranks:
        ce.finalize()
    print(json.dumps(sent | {"walked": len(walked)}), flush=True)


if __name__ == "__main__":
    main()
