"""Per-layer FP8 KV-cache scales and their three modes.

recompute: the first forward pass after start-up and after every weight-version change measures
           |k| and |v| amax per layer (and |q| with full-FP8 attention) and sets
           scale = amax * margin / 448 before that pass writes any FP8 KV. The default margin,
           1.2, leaves room for later prompts whose activations exceed the calibration batch.
external:  scales come from the trainer, via update_weights(kv_scales=...) or named tensors
           model.layers.{i}.self_attn.{k,v}_scale, and are used exactly as given.
static:    scales from the checkpoint (or 1.0), never changed.
With a non-FP8 KV cache every scale is 1.0 and nothing is measured.

When a layer's k/v scale changes while its cache holds values (an update with in_flight="keep" and
kv_on_update="keep", or prefix-cache blocks kept with flush_cache=False), `rescale(layer index, old (k, v),
new (k, v))` (set by the engine) converts what is stored to the new scale first: a later read returns what was
written, within one more E4M3 rounding.

With batch_invariant the recompute forward is not the first batch of requests (whose amax depends on
what happened to be in it) but one forward of CALIBRATION_TEXT against a private cache, so the scales
are a function of the weights alone, the same for every batch and reproducible by a trainer.
"""

import contextlib
import math
import time
from collections.abc import Callable

import torch

from fp8engine.config import EngineConfig

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max

CALIBRATION_TEXT = (
    "Calibrate the key and value scales on ordinary text: prose, numbers such as 3.14159 and 2026, code like "
    "`for i in range(10): print(i ** 2)`, a list (apples, pears, plums), a question? An answer! And a long "
    "sentence that runs on for a while, so that attention sees more than a handful of positions before it ends."
)


class KVScaleManager:
    """layers: the model's attention layers (each holds k_scale, v_scale, q_scale and an `observer` slot);
    checkpoint: {layer index: {"k" | "v" | "q": scale}} as the checkpoint holds them (static mode's values)."""

    def __init__(self, config: EngineConfig, layers: list, checkpoint: dict[int, dict[str, float]]):
        self.enabled = config.kv_is_fp8
        self.mode = config.kv_scale_mode
        self.margin = config.kv_scale_margin
        self.fp8_attention = config.fp8_attention
        self.layers = layers
        self.seconds_total = 0.0
        self.rescale_seconds_total = 0.0
        self.num_calibrations = 0
        # batch_invariant: runs the fixed calibration forward (set by the engine); None measures the live batch
        self.fixed_calibration: Callable[[], None] | None = None
        self.rescale: Callable[[int, tuple[float, float], tuple[float, float]], None] | None = None
        # tensor parallelism: the amax of every rank's heads (each rank sees its own), so all hold the T = 1 scales
        self.reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        # a checkpoint names a scale by its decoder layer (model.layers.{i}.self_attn); in a hybrid model the
        # attention layers are only some of them
        self._by_decoder_layer = {int(layer.name.split(".")[2]): i for i, layer in enumerate(layers)}
        if self.enabled:
            for layer in layers:
                layer.q_scale = 1.0 if self.fp8_attention else 0.0
            self._apply({self._by_decoder_layer[i]: pair for i, pair in checkpoint.items()
                         if i in self._by_decoder_layer})
        self.pending = self.enabled and self.mode == "recompute"

    def current(self) -> dict[str, tuple[float, float]]:
        return {layer.name: (float(layer.k_scale), float(layer.v_scale)) for layer in self.layers}

    # ------------------------------------------------------------- recompute
    @contextlib.contextmanager
    def calibrating(self):
        """Around one forward pass: measure and set scales if this is the first of a weight version."""
        if not self.pending:
            yield
            return
        for layer in self.layers:
            layer.observer = self._observe
        try:
            if self.fixed_calibration is None:
                yield
            else:
                self.fixed_calibration()
        finally:
            for layer in self.layers:
                layer.observer = None
            self.pending = False
            self.num_calibrations += 1
        if self.fixed_calibration is not None:
            yield

    def _observe(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Runs inside the forward pass; seconds_total counts only this extra work."""
        start = time.perf_counter()
        amax = torch.stack([k.abs().amax(), v.abs().amax(), q.abs().amax()]).float()
        if self.reduce_amax is not None:
            amax = self.reduce_amax(amax)
        k_s, v_s, q_s = (self._scale(float(a)) for a in amax.tolist())
        self.seconds_total += time.perf_counter() - start
        self._set(self._index[id(layer)], k_s, v_s)  # before the layer writes or reads its cache
        if self.fp8_attention:
            layer.q_scale = q_s

    def _scale(self, amax: float) -> float:
        return max(amax, 1e-6) * self.margin / FP8_MAX

    def on_weights_changed(self, staged: dict[int, dict[str, float]]) -> None:
        """After a weight update: apply scales that came with it, or recalibrate in recompute mode."""
        if not self.enabled:
            return
        if self.mode == "external":
            self._apply(staged)
        elif self.mode == "recompute":
            self.pending = True

    # ------------------------------------------------------------- external
    def attention_index(self, name: str, decoder_layer: int) -> int:
        """The attention layer (its index here) of KV scale tensor `name` for decoder layer decoder_layer."""
        if decoder_layer not in self._by_decoder_layer:
            raise ValueError(f"{name!r}: the model has no attention layer {decoder_layer} (its attention layers: "
                             f"{sorted(self._by_decoder_layer)})")
        return self._by_decoder_layer[decoder_layer]

    def check_scale_tensor(self, name: str, layer: int, tensor: torch.Tensor) -> float:
        """The value of KV scale tensor `name` for attention layer `layer` (attention_index) in a weight update;
        ValueError if it cannot be applied."""
        if tensor.numel() != 1:
            raise ValueError(f"{name!r}: a KV scale must be a single value, got shape {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        self._check_value(name, value)
        if self.mode != "external":
            raise ValueError(f"{name!r}: KV scales are accepted only with kv_scale_mode='external' "
                             f"(this engine uses {self.mode!r})")
        return value

    def check_external(self, kv_scales) -> dict[int, dict[str, float]]:
        """Validate update_weights(kv_scales={layer: (k_scale, v_scale)}); layer = index or name."""
        if not kv_scales:
            return {}
        if self.mode != "external" or not self.enabled:
            raise ValueError(f"kv_scales given, but kv_scale_mode is {self.mode!r} and kv_cache_dtype "
                             f"is {'fp8_e4m3' if self.enabled else 'auto'}; use kv_scale_mode='external' "
                             f"with an FP8 KV cache")
        names = {layer.name: i for i, layer in enumerate(self.layers)}
        out = {}
        for key, pair in kv_scales.items():
            index = names.get(key, key)
            if not isinstance(index, int) or not 0 <= index < len(self.layers):
                raise ValueError(f"kv_scales: unknown layer {key!r} (use 0..{len(self.layers) - 1} or "
                                 f"names like {self.layers[0].name!r})")
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"kv_scales[{key!r}] must be (k_scale, v_scale), got {pair!r}")
            k, v = (float(x) for x in pair)
            self._check_value(f"kv_scales[{key!r}]", k)
            self._check_value(f"kv_scales[{key!r}]", v)
            out[index] = {"k": k, "v": v}
        return out

    @staticmethod
    def _check_value(name: str, value: float) -> None:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: a KV scale must be finite and > 0, got {value}")

    def _apply(self, scales: dict[int, dict[str, float]]) -> None:
        for index, pair in scales.items():
            layer = self.layers[index]
            self._set(index, pair.get("k", layer.k_scale), pair.get("v", layer.v_scale))
            if self.fp8_attention and "q" in pair:
                layer.q_scale = pair["q"]

    def _set(self, index: int, k_scale: float, v_scale: float) -> None:
        """A layer's new k/v scales, the values its cache already holds converted to them."""
        layer = self.layers[index]
        old = (float(layer.k_scale), float(layer.v_scale))
        if self.rescale is not None and old != (k_scale, v_scale):
            start = time.perf_counter()
            self.rescale(index, old, (k_scale, v_scale))
            self.rescale_seconds_total += time.perf_counter() - start
        layer.k_scale, layer.v_scale = k_scale, v_scale
