"""A trainer process for the weight-update-group tests: rank 0 of a gloo group broadcasts a safetensors
file's tensors in name order, then waits for its stdin to close.

python -m tests.broadcast_trainer PORT WORLD_SIZE FILE [--group-name G] [--die-after K]
--die-after K: exit at once (no clean-up) after broadcasting K tensors, as a trainer that dies mid-broadcast.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import load_file

from fp8engine.weights.dist_update import broadcast_weights, init_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("file")
    parser.add_argument("--group-name", default="weights")
    parser.add_argument("--die-after", type=int)
    args = parser.parse_args()
    tensors = sorted(load_file(args.file).items())
    group = init_process_group("127.0.0.1", args.port, 0, args.world_size, args.group_name, "gloo", timeout_s=120)
    if args.die_after is not None:
        broadcast_weights(group, tensors[:args.die_after])
        os._exit(3)
    broadcast_weights(group, tensors)
    sys.stdin.read()
    torch.distributed.destroy_process_group(group)


if __name__ == "__main__":
    main()
