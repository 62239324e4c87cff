"""The engine's CUDA code path on a CPU, with "the device" tracked.

`FakeCuda` is a TorchFunctionMode: a tensor created for device "cuda" (a `device=` argument, `.to("cuda")`,
`.cuda()`, a `torch.device("cuda")` context) is made on the CPU and remembered as a device tensor (by its
storage, so views, parameters and in-place results stay device tensors); an op's outputs are device tensors when
one of its inputs is. What a GPU would refuse or stall on is checked:

  * an op that mixes a device tensor with a host tensor (a Python scalar is fine, a 0-dim host tensor is not)
    raises MixedDevices, naming the op: on CUDA it raises or copies behind the caller's back. Copies are the
    exception: `copy_` and `.to` move data between the two on purpose (a host-to-device copy is not a sync).
  * every host synchronisation on a device tensor (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`,
    `.cpu()` / `.to("cpu")`, `.numpy()`, a device-to-host `copy_`) is counted, by op, in `syncs`;
  * Triton kernels run on the interpreter (TRITON_INTERPRET=1 must be set before triton is imported), outside
    the tracking (the interpreter copies its arguments to the host itself), and are counted in `launches`.

`live_bytes()` sums the storages of the device tensors alive (what sleep must hand back).
`torch.cuda.Event` is a stand-in whose synchronize() counts as a host synchronisation (a non-blocking copy to the
host does not); `torch.cuda.is_available()` answers True, `torch.cuda.device_count()` `num_devices` (every one the
same CPU: `set_device` only records `current_device`), `torch.cuda.mem_get_info()` a fixed budget (`free_bytes`),
`max_memory_allocated()` the mode's `peak_bytes` (`memory_allocated()` 0), and `synchronize()`, `empty_cache()` and
`reset_peak_memory_stats()` return at once while the mode is on.
`torch_calls` counts every torch call (metadata queries such as `.device` or `.stride()` included) and
`device_ops` those that return device tensors (a kernel launch on a GPU, a view or an allocation); with
`stub_kernels=True` the Triton kernels are counted but not run (for counting a big model's step).

What a GPU would launch is counted apart: `torch_kernels` (by op in `torch_kernel_names`) are the torch calls on
device tensors that are neither a view (every output shares an input's storage and is not the input itself, or it
is the input returned unchanged by an out-of-place call such as `.contiguous()`) nor an allocation (`empty*`); with
`launches` (Triton) they are the step's kernels. `bytes_moved` sums what those kernels' tensor arguments hold
(each distinct tensor once, inputs and outputs; a gather, the rows it reads, not its whole source): a kernel's
traffic if it reads and writes each argument once. Tensors whose storage is in `paged` (the KV caches, which a
kernel reads in part through its block table) are left out and counted in `paged_args` instead.

CUDA graphs (model_executor/cuda_graphs.py) cannot be captured on a CPU; without `graphs=` the engine's capture
fails and its decode steps run eagerly. `graphs="replay"` puts a stand-in capture in its place: the captured
function runs once with no host synchronisation allowed inside, and each replay runs it again on the static
buffers and writes the captured output in place (what a graph does); `graphs="stub"` replays nothing (the work a
GPU would do alone: for counting the host side of a graph step). `captured` lists the captured batch sizes.
"""

import collections
import contextlib
import gc
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

Tensor = torch.Tensor
CUDA_FREE_BYTES, CUDA_TOTAL_BYTES = 4 << 30, 8 << 30

# Methods that hand a device tensor's values to Python: each one is a host synchronisation.
_SYNCS = {Tensor.item: "item", Tensor.tolist: "tolist", Tensor.__bool__: "bool", Tensor.__int__: "int",
          Tensor.__float__: "float", Tensor.__index__: "index", Tensor.numpy: "numpy", Tensor.cpu: "cpu",
          Tensor.__repr__: "repr", Tensor.__format__: "format", torch.equal: "equal"}
_COPIES = (Tensor.copy_, Tensor.to, Tensor.cuda, Tensor.cpu, Tensor.type_as)
# Calls that only allocate (no kernel on a GPU), and gathers (they read the rows they index, not their source).
_ALLOCS = {torch.empty, torch.empty_like, torch.empty_strided, Tensor.new_empty, Tensor.new_empty_strided}
_GATHERS = {torch.nn.functional.embedding, torch.embedding, torch.index_select, Tensor.index_select,
            Tensor.__getitem__}
# Properties that say where a tensor lives: a device tensor answers as a CUDA one would.
_DEVICE, _IS_CUDA = torch._C.TensorBase.device, torch._C.TensorBase.is_cuda


def _no_graphs():
    raise RuntimeError("FakeCuda(graphs=None) captures no CUDA graphs")


class MixedDevices(RuntimeError):
    """An op got device and host tensors together."""


def _is_view(func, inputs, outs) -> bool:
    """No kernel: every output tensor shares an input's storage, being a new view of it or (out of place) the input
    itself; an in-place op (name ending in `_`, `__setitem__`, `__i*__`) that returns its input is a kernel."""
    name = getattr(func, "__name__", "")
    if not outs:
        return name != "__setitem__"  # a metadata query; __setitem__ writes without returning a tensor
    in_place = (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))
    storages = {t.untyped_storage()._cdata for t in inputs if t.numel()}
    ids = {id(t) for t in inputs}
    return all(t.numel() == 0 or (t.untyped_storage()._cdata in storages and not (in_place and id(t) in ids))
               for t in outs)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, (str, int)) and not isinstance(device, bool) and (
        isinstance(device, int) or str(device).startswith("cuda"))


class FakeCuda(TorchFunctionMode):
    def __init__(self, stub_kernels: bool = False, graphs: str | None = None, num_devices: int = 1,
                 free_bytes: int = CUDA_FREE_BYTES):
        super().__init__()
        self.num_devices = num_devices  # torch.cuda.device_count(); set_device only records current_device
        self.current_device = 0
        self.free_bytes = free_bytes  # what torch.cuda.mem_get_info() says is free
        if graphs not in (None, "replay", "stub"):
            raise ValueError(f"graphs must be None, 'replay' or 'stub', got {graphs!r}")
        self.stub_kernels = stub_kernels
        self.graphs = graphs
        self.captured: list[int] = []
        self.peak_bytes = 0  # what torch.cuda.max_memory_allocated() answers (the allocator is not tracked)
        self.torch_calls = 0
        self.device_ops = 0
        # the device's storages by address, each with a weak reference to itself: an address a freed device storage
        # leaves may come back for a host storage made outside the mode (unpickled, say), which is not the same one
        self.device_storages: dict[int, weakref.ref] = {}
        self.syncs: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.torch_kernels = 0
        self.torch_kernel_names: collections.Counter = collections.Counter()
        self.bytes_moved = 0
        self.paged: set[int] = set()  # storages (`_cdata`) that bytes_moved leaves out
        self.paged_args = 0
        self.mixed_ok = 0  # > 0 inside `allow_mixing()`
        self._saved = {}

    # ------------------------------------------------------------------ bookkeeping
    def is_device(self, t) -> bool:
        return isinstance(t, Tensor) and t.numel() > 0 and self._on_device(t.untyped_storage())

    def _on_device(self, storage: torch.UntypedStorage) -> bool:
        ref = self.device_storages.get(storage._cdata)
        return ref is not None and ref() is storage

    def _mark(self, out, device: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.numel() > 0:
                storage = t.untyped_storage()  # the storage, not its bytes: a resize_ keeps it
                if device:
                    self.device_storages[storage._cdata] = weakref.ref(storage)
                else:  # a host allocation that reuses a freed device block's address
                    self.device_storages.pop(storage._cdata, None)

    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def live_bytes(self) -> int:
        """Bytes of device memory that live tensors hold now (each storage once): what a device's allocator has
        handed out to them (its cache aside)."""
        gc.collect()
        with torch.overrides._pop_mode_temporarily():
            storages = {}
            for obj in gc.get_objects():
                if isinstance(obj, Tensor) and self.is_device(obj):
                    storage = obj.untyped_storage()
                    storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    @contextlib.contextmanager
    def allow_mixing(self):
        """For code that is host-side by design (a test's own checks)."""
        self.mixed_ok += 1
        try:
            yield
        finally:
            self.mixed_ok -= 1

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE or owner is _IS_CUDA:
            device = self.is_device(args[0])
            return (torch.device("cuda", 0) if device else func(*args)) if owner is _DEVICE else device
        to_device = False
        if _is_cuda(kwargs.get("device")):
            kwargs["device"], to_device = "cpu", True
        if func in (Tensor.to, Tensor.cuda):
            args, to_device = self._device_args(func, args, kwargs, to_device)
        if func is Tensor.set_ and len(args) > 1 and isinstance(args[1], torch.UntypedStorage):
            to_device = self._on_device(args[1])  # a view of a device storage is on the device
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        on_device = [t for t in tensors if self.is_device(t)]
        self.torch_calls += 1
        name = _SYNCS.get(func)
        if on_device and func in _SYNCS and name is not None:
            self.syncs[name] += 1
        if (on_device and func is Tensor.copy_ and not self.is_device(args[0])
                and not kwargs.get("non_blocking", len(args) > 2 and args[2])):
            self.syncs["copy_to_host"] += 1  # a non-blocking one waits for nothing (its event does: _Event)
        if on_device and func is Tensor.to and not to_device and self._to_host(args, kwargs):
            self.syncs["to_host"] += 1
        if (on_device and not self.mixed_ok and func not in _COPIES
                and any(not self.is_device(t) and (t.numel() > 0 or t.dim() == 0) for t in tensors)):
            shapes = [(tuple(t.shape), "device" if self.is_device(t) else "host") for t in tensors]
            raise MixedDevices(f"{getattr(func, '__qualname__', func)} mixes device and host tensors: {shapes}")
        out = func(*args, **kwargs)
        if func is Tensor.cpu or (func is Tensor.to and not to_device and self._to_host(args, kwargs)):
            if isinstance(out, Tensor) and out.untyped_storage()._cdata == args[0].untyped_storage()._cdata:
                out = out.clone()  # a CPU tensor's .cpu() is itself; a device tensor's is a new host tensor
            self._mark(out, False)
            return out
        if func is Tensor.copy_ or func in _SYNCS:
            return out
        device = bool(on_device) or to_device
        self._mark(out, device)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        self.device_ops += device and bool(outs)
        if device and func not in _ALLOCS and not _is_view(func, tensors, outs):
            self.torch_kernels += 1
            self.torch_kernel_names[getattr(func, "__name__", str(func))] += 1
            index = [t for t in tensors if t.dtype in (torch.int32, torch.int64, torch.bool)]
            if func in _GATHERS and outs and index:
                self._count_bytes(index + outs + outs)  # the index, the rows read and the rows written
            else:
                self._count_bytes(tensors + outs)
        return out

    def _count_bytes(self, tensors) -> None:
        seen = set()
        for t in tensors:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                nbytes = t.numel() * t.element_size()
                if t.numel() and t.untyped_storage()._cdata in self.paged:
                    self.paged_args += nbytes
                else:
                    self.bytes_moved += nbytes

    def _device_args(self, func, args, kwargs, to_device):
        """`.cuda()` and `.to(cuda)` (device positional or keyword) become `.to(cpu)`, marked as device."""
        if func is Tensor.cuda:
            return (args[0],), True
        rest = list(args[1:])
        for i, a in enumerate(rest):
            if _is_cuda(a):
                rest[i], to_device = torch.device("cpu"), True
        return (args[0], *rest), to_device

    @staticmethod
    def _to_host(args, kwargs) -> bool:
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is not None and torch.device(target).type == "cpu"

    # ------------------------------------------------------------------ CUDA stand-ins
    def stand_in_capture(self, replay: bool = True):
        """A stand-in for cuda_graphs.capture_cuda (see the module docstring); replay=False: replays do nothing."""
        def capture_cuda():
            def capture(forward):
                before = self.host_syncs()
                out = forward()
                if self.host_syncs() != before:
                    raise AssertionError(f"host synchronisation inside a captured region: {dict(self.syncs)}")
                self.captured.append(out.shape[0])

                def run_again():
                    syncs = self.host_syncs()
                    out.copy_(forward())
                    if self.host_syncs() != syncs:
                        raise AssertionError(f"host synchronisation inside a replay: {dict(self.syncs)}")
                return (run_again if replay else lambda: None), out
            return capture
        return capture_cuda

    def __enter__(self):
        import triton.runtime.interpreter as interpreter

        from fp8engine.model_executor import cuda_graphs
        from tests import interpreter as fast_helpers
        fast_helpers.install()  # before the launch is wrapped below, so that the wrapper calls it
        mode = self
        grid_call = interpreter.GridExecutor.__call__

        def launch(executor, *args, **kwargs):
            mode.launches[executor.fn.__name__] += 1
            with torch.overrides._pop_mode_temporarily():  # the counting's own tensor queries are not the step's
                mode._count_bytes([a for a in list(args) + list(kwargs.values()) if isinstance(a, Tensor)])
                return None if mode.stub_kernels else grid_call(executor, *args, **kwargs)
        self._saved = {(interpreter.GridExecutor, "__call__"): grid_call,
                       (torch.cuda, "is_available"): torch.cuda.is_available,
                       (torch.cuda, "mem_get_info"): torch.cuda.mem_get_info,
                       (torch.cuda, "synchronize"): torch.cuda.synchronize,
                       (torch.cuda, "empty_cache"): torch.cuda.empty_cache,
                       (torch.cuda, "reset_peak_memory_stats"): torch.cuda.reset_peak_memory_stats,
                       (torch.cuda, "memory_allocated"): torch.cuda.memory_allocated,
                       (torch.cuda, "max_memory_allocated"): torch.cuda.max_memory_allocated,
                       (torch.cuda, "Event"): torch.cuda.Event,
                       (torch.cuda, "device_count"): torch.cuda.device_count,
                       (torch.cuda, "current_device"): torch.cuda.current_device,
                       (torch.cuda, "set_device"): torch.cuda.set_device,
                       (torch.cuda, "current_stream"): torch.cuda.current_stream}
        self._saved[cuda_graphs, "capture_cuda"] = cuda_graphs.capture_cuda
        if self.graphs is not None:
            cuda_graphs.capture_cuda = self.stand_in_capture(self.graphs == "replay")
        else:
            cuda_graphs.capture_cuda = _no_graphs
        interpreter.GridExecutor.__call__ = launch
        torch.cuda.is_available = lambda: True
        torch.cuda.mem_get_info = lambda device=None: (mode.free_bytes, CUDA_TOTAL_BYTES)
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_stream = lambda device=None: None  # what an Event records on (every op is done)
        torch.cuda.empty_cache = lambda: None
        torch.cuda.reset_peak_memory_stats = lambda device=None: None
        torch.cuda.memory_allocated = lambda device=None: 0
        torch.cuda.max_memory_allocated = lambda device=None: mode.peak_bytes
        torch.cuda.device_count = lambda: mode.num_devices
        torch.cuda.current_device = lambda: mode.current_device

        def set_device(device):
            mode.current_device = device if isinstance(device, int) else torch.device(device).index or 0
        torch.cuda.set_device = set_device

        class Event:
            """torch.cuda.Event: every op of the stand-in device is done when it returns, so a recorded event has
            completed; waiting for one is a host synchronisation (counted)."""

            def __init__(self, *args, **kwargs):
                pass

            def record(self, stream=None):
                pass

            def query(self):
                return True

            def synchronize(self):
                mode.syncs["event"] += 1
        torch.cuda.Event = Event
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), value in self._saved.items():
            setattr(owner, name, value)
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def in_this_thread(self):
        """The mode in another thread too (mode stacks are per thread): the server's engine thread."""
        torch.overrides._push_mode(self)
        try:
            yield
        finally:
            torch.overrides._pop_mode()
