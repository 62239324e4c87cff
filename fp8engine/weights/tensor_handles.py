"""Same-machine weight hand-over (SGLang's update_weights_from_tensor): tensors travel as handles to memory that
the trainer and the engine share, never as their bytes.

The trainer pickles its (name, tensor) pairs with torch's multiprocessing pickler: a CPU tensor under torch's
"file_system" sharing strategy becomes the name of a shared-memory segment, a CUDA tensor a CUDA IPC handle; the
pickle, base64-encoded, is a few hundred bytes per tensor (SGLang's MultiprocessingSerializer writes the same
thing). `load` rebuilds the tensors from it, mapping the trainer's memory: the engine then validates and writes
them in place as update_weights does, and drops its mappings; the trainer's process owns the segments (torch's
shared-memory manager unlinks them when the trainer lets go of its tensors).

Unpickling runs whatever callables a pickle names, so this one names only torch's rebuild functions for shared
storages and CUDA IPC, the tensor, storage, Size and dtype types they take, and SGLang's two plain record types
(FlattenedTensorMetadata, LocalSerializedTensor, as stand-ins of ours): any other global is refused, naming it
(docs/security.md). The "file_descriptor" strategy is refused too: its rebuild calls back into the sender.
"""

import base64
import binascii
import dataclasses
import io
import pickle
from collections.abc import Iterable

import torch
import torch.multiprocessing.reductions as reductions

LOAD_FORMATS = (None, "direct", "flattened_bucket")
_REDUCTIONS = ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_empty",
               "rebuild_cuda_tensor", "rebuild_parameter", "rebuild_parameter_with_state")
_ALLOWED = {("torch.multiprocessing.reductions", name): getattr(reductions, name) for name in _REDUCTIONS
            if hasattr(reductions, name)} | {
    ("torch", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage, ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage}


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor of SGLang's flattened bucket: elements start_idx..end_idx of the bucket's flat tensor."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclasses.dataclass
class LocalSerializedTensor:
    """SGLang's per-rank wrapper: values[r] is rank r's tensor, pickled again."""

    values: list


_SGLANG_RECORDS = {"FlattenedTensorMetadata": FlattenedTensorMetadata, "LocalSerializedTensor": LocalSerializedTensor}


class RefusedGlobal(ValueError):
    """A pickle named a global outside the allowed set."""


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module.split(".")[0] == "sglang" or module == __name__) and name in _SGLANG_RECORDS:
            return _SGLANG_RECORDS[name]
        raise RefusedGlobal(f"the serialized tensors name the global {module}.{name}, which is not one of torch's "
                            f"shared-tensor rebuild functions: refused (only handles to shared memory are taken)")


def loads(data: str | bytes) -> object:
    """An object unpickled from data (base64 text or pickle bytes) by the restricted unpickler; ValueError (a
    RefusedGlobal for a forbidden global) when it is not such a pickle."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"serialized tensors: not base64 ({exc})") from None
    try:
        return _HandleUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal:
        raise
    except Exception as exc:  # a truncated or corrupt pickle, a segment that no longer exists
        raise ValueError(f"serialized tensors cannot be rebuilt: {type(exc).__name__}: {exc}") from None


def dumps(payload: list | dict) -> str:
    """The trainer's side: (name, tensor) pairs (or a `flatten` bucket) as base64 text of torch's multiprocessing
    pickle, handles only (CPU tensors are moved to shared memory under the file_system strategy, which must be
    set in the trainer's process: torch.multiprocessing.set_sharing_strategy("file_system")). Keep the tensors
    alive until the engine has answered."""
    from multiprocessing.reduction import ForkingPickler
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        raise ValueError("tensor_handles.dumps needs torch.multiprocessing.set_sharing_strategy('file_system') in "
                         "this process (the default 'file_descriptor' hands over descriptors the engine cannot use)")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def flatten(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's flattened bucket of (name, tensor) pairs: their bytes end to end in one uint8 tensor, and where
    each lies (load_format "flattened_bucket": one handle for the whole bucket)."""
    flats, metadata, at = [], [], 0
    for name, tensor in named_tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, at, at + data.numel(),
                                                tensor.numel()))
        flats.append(data)
        at += data.numel()
    return {"flattened_tensor": torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8), "metadata": metadata}


def named_tensors(serialized: list[str | bytes], load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of SGLang's serialized_named_tensors (one entry per tensor-parallel rank: this
    engine takes one) in load_format None / "direct" (a pickled list of pairs, a value maybe a
    LocalSerializedTensor) or "flattened_bucket" (a pickled {"flattened_tensor", "metadata"})."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if not isinstance(serialized, list) or len(serialized) != 1:
        raise ValueError(f"serialized_named_tensors must hold one entry (one rank), got "
                         f"{len(serialized) if isinstance(serialized, list) else type(serialized).__name__}")
    payload = loads(serialized[0])
    if load_format == "flattened_bucket":
        return unflatten(payload)
    if not isinstance(payload, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in payload):
        raise ValueError("serialized tensors: expected a list of (name, tensor) pairs")
    return [(name, _tensor(name, value)) for name, value in payload]


def _tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):
        if len(value.values) != 1:
            raise ValueError(f"weight {name!r}: a LocalSerializedTensor of {len(value.values)} ranks (one expected)")
        value = loads(value.values[0])
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"weight {name!r}: expected a tensor, got {type(value).__name__}")
    return value


def unflatten(payload) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a flattened bucket (`flatten`'s, SGLang's): views of its flat tensor."""
    if not isinstance(payload, dict) or not isinstance(payload.get("flattened_tensor"), torch.Tensor):
        raise ValueError("flattened_bucket: expected {'flattened_tensor': tensor, 'metadata': [...]}")
    flat, out = payload["flattened_tensor"], []
    for meta in payload.get("metadata") or []:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise ValueError(f"flattened_bucket: metadata entries must be FlattenedTensorMetadata, got "
                             f"{type(meta).__name__}")
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise ValueError(f"flattened_bucket: {meta.name!r} spans {meta.start_idx}..{meta.end_idx} of a "
                             f"{flat.numel()}-element bucket")
        out.append((meta.name, flat[meta.start_idx:meta.end_idx].view(meta.dtype).view(meta.shape)))
    return out
