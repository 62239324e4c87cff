"""The receiving end of vLLM's PyNccl weight-transfer data plane: a ctypes binding of the few NCCL calls it makes,
and the unique-id exchange through vLLM's StatelessProcessGroup store.

vLLM's trainer side (vllm/distributed/weight_transfer/nccl_common.py `trainer_init`) is rank 0 of a
StatelessProcessGroup: it hosts a TCP store, mints an NCCL unique id and publishes it with `broadcast_obj` under the
key "broadcast_from/0/0" as the pickle of vLLM's own ctypes struct (`pynccl_wrapper.ncclUniqueId`: 128 bytes). Each
receiver reads that key, calls ncclCommInitRank(world_size, id, rank) on its device, and takes part in a one-element
float32 sum all-reduce (the warm-up every PyNcclCommunicator runs) before any broadcast. The pickle is read by an
unpickler that knows vLLM's struct and ctypes' own unpickle function and nothing else, so nothing of vLLM is
imported and nothing else a store holds can run.

Unverified: no GPU has run this module (the unique-id exchange is tested on CPU against vLLM's own
StatelessProcessGroup; the NCCL calls need CUDA and two ranks). FP8ENGINE_NCCL_SO names the library; by default
the libnccl.so.2 of torch's nvidia-nccl wheel, then the loader's search path.
"""

import ctypes
import glob
import io
import os
import pickle
import sys

import torch

from fp8engine import envs

UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first object from rank 0
VLLM_UNIQUE_ID = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10}  # ncclDataType_t
NCCL_SUM = 0  # ncclRedOp_t
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


class UniqueId(ctypes.Structure):
    """NCCL's ncclUniqueId, laid out as vLLM's struct is (the two pickle to the same bytes)."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class _UniqueIdUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == VLLM_UNIQUE_ID:
            return UniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the NCCL unique id's pickle names {module}.{name}: only vLLM's ncclUniqueId "
                                     f"is accepted")


def unique_id_from_pickle(data: bytes) -> bytes:
    """The 128 bytes of an NCCL unique id pickled by vLLM (ValueError for anything else)."""
    try:
        unique_id = _UniqueIdUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"the store's {UNIQUE_ID_KEY!r} is not vLLM's pickled NCCL unique id: {exc}") from None
    if not isinstance(unique_id, UniqueId):
        raise ValueError(f"the store's {UNIQUE_ID_KEY!r} holds a {type(unique_id).__name__}, not an NCCL unique id")
    return bytes(unique_id.internal)


def read_unique_id(store) -> bytes:
    """Wait for the trainer's unique id in its StatelessProcessGroup store (blocks up to the store's timeout)."""
    return unique_id_from_pickle(store.get(UNIQUE_ID_KEY))


def library_path() -> str:
    explicit = envs.get("FP8ENGINE_NCCL_SO")
    if explicit:
        return explicit
    for root in sys.path:
        found = sorted(glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*")))
        if found:
            return found[0]
    return "libnccl.so.2"


class NcclComm:
    """One NCCL communicator: this process is `rank` of `world_size` on `device`, joined with a unique id minted by
    rank 0. Collectives run on the device's current stream and are waited for."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device):
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        self.lib = ctypes.CDLL(library_path())
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.device = torch.device(device)
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, len(unique_id))
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), ctypes.c_int(world_size), uid,
                                                  ctypes.c_int(rank)), "ncclCommInitRank")
            self.all_reduce(torch.zeros(1, device=self.device))  # PyNccl's warm-up: every rank runs it

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: NCCL error {result} ({self.lib.ncclGetErrorString(result).decode()})")

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pointer = ctypes.c_void_p(tensor.data_ptr())
        self._check(self.lib.ncclAllReduce(pointer, pointer, ctypes.c_size_t(tensor.numel()),
                                           ctypes.c_int(NCCL_DTYPES[tensor.dtype]), ctypes.c_int(NCCL_SUM),
                                           self.comm, self._stream()), "ncclAllReduce")
        torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Receive root's broadcast into `tensor` (contiguous, on this communicator's device)."""
        self._check(self.lib.ncclBroadcast(ctypes.c_void_p(), ctypes.c_void_p(tensor.data_ptr()),
                                           ctypes.c_size_t(tensor.numel()), ctypes.c_int(NCCL_DTYPES[tensor.dtype]),
                                           ctypes.c_int(root), self.comm, self._stream()), "ncclBroadcast")
        torch.cuda.current_stream(self.device).synchronize()

    def abort(self) -> None:
        """Free the communicator without waiting for the other ranks (ncclCommAbort)."""
        if self.comm:
            self.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()
