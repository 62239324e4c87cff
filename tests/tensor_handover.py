"""A trainer process for the same-machine hand-over test (test_sleep.py): its seeded perturbation of a checkpoint
moved to shared memory (torch's file_system strategy) and written to stdout as one line of handles
(weights/tensor_handles.dumps, SGLang's serialized form), flat in one bucket when asked; it keeps the tensors
alive until a line arrives on stdin.

    python tests/tensor_handover.py MODEL_DIR SEED [flattened_bucket]
"""

import sys

import torch

from fp8engine.weights import tensor_handles
from tests.checkpoints import perturbed_state


def main() -> None:
    model_dir, seed = sys.argv[1], int(sys.argv[2])
    flat = len(sys.argv) > 3 and sys.argv[3] == "flattened_bucket"
    torch.multiprocessing.set_sharing_strategy("file_system")
    state = perturbed_state(model_dir, seed)
    if flat:
        payload = tensor_handles.flatten(state.items())
    else:
        payload = list(state.items())
    sys.stdout.write(tensor_handles.dumps(payload) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


if __name__ == "__main__":
    main()
