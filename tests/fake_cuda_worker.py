"""A tensor-parallel worker on the stand-in device (tests/fake_cuda.py): `python -m tests.fake_cuda_worker FD`, what
tensor_parallel.WORKER_MODULE names in a test of tensor parallelism on "cuda". The worker runs as
fp8engine.model_executor.tp_worker does, its Triton kernels on the interpreter, and every op that would mix its
device tensors with host tensors raises (and reaches rank 0 as the worker's last words). FP8ENGINE_TEST_CUDA_DEVICES
, FP8ENGINE_TEST_CUDA_GRAPHS and FP8ENGINE_TEST_CUDA_FREE_BYTES: FakeCuda's num_devices, graphs and free_bytes, as
rank 0's stand-in has them."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from fp8engine.model_executor import tp_worker  # noqa: E402
from tests.fake_cuda import FakeCuda  # noqa: E402

if __name__ == "__main__":
    with FakeCuda(num_devices=int(os.environ.get("FP8ENGINE_TEST_CUDA_DEVICES", "2")),
                  graphs=os.environ.get("FP8ENGINE_TEST_CUDA_GRAPHS") or None,
                  free_bytes=int(os.environ.get("FP8ENGINE_TEST_CUDA_FREE_BYTES", str(4 << 30)))):
        tp_worker.main()
