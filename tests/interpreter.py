"""Triton's interpreter, minus a cost that changes nothing: inside a launch it patches triton.language again for
every call of a @triton.jit helper (triton/runtime/interpreter.py: `_patch_lang` in InterpretedFunction.__call__),
five `inspect.getmembers` walks a call, though the launch (GridExecutor.__call__) patched the same modules for its
whole grid and restores them only at its end. The fused kernels call a helper at every rounding point, so on the
stand-in device this was over a quarter of a CUDA-path test's time. `install()` skips a helper's patch when the
launch's, or an earlier helper's in the same launch, covers the modules the helper sees; everything else runs as
Triton wrote it.

Installed by tests/conftest.py and tests/fake_cuda.py (the gpu-check dry run imports the latter)."""

import threading

_state = threading.local()


def _langs(fn) -> frozenset:
    """The modules `_patch_lang(fn)` patches: triton.language / triton.language.core where fn's globals hold them."""
    import triton.language as tl
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def install() -> bool:
    """Patch the interpreter once; False where this Triton has not the shape this was written for (then nothing
    changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_fp8engine_fast_helpers", False):
        return True
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang, launch = getattr(interpreter, "_patch_lang", None), getattr(executor, "__call__", None)
    if patch_lang is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return False

    def _patch_lang(fn):
        patched, langs = getattr(_state, "patched", None), _langs(fn)
        if patched is not None and langs <= patched:  # a helper inside a launch that patched these already
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if getattr(_state, "launching", False):  # the launch's own patch, for its whole grid
            _state.launching, _state.patched = False, langs
        elif patched is not None:  # a helper seeing triton.language.core (Triton's own tl.sum, tl.max, ...): the
            _state.patched = patched | langs  # patch stays for the rest of the launch (Triton never undoes it)
        return scope

    def _launch(self, *args, **kwargs):
        _state.launching, _state.patched = True, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.launching, _state.patched = False, None

    interpreter._patch_lang = _patch_lang
    executor.__call__ = _launch
    interpreter._fp8engine_fast_helpers = True
    return True
