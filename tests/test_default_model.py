"""The default model's one-time conversion: atomic under kill, safe under concurrent processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PREPARE = "import fp8engine; print(fp8engine.default_model_path())"


def _start(cache: Path) -> subprocess.Popen:
    env = dict(os.environ, FP8ENGINE_CACHE=str(cache))
    return subprocess.Popen([sys.executable, "-c", PREPARE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def test_killed_conversion_leaves_nothing_and_concurrent_ones_agree(tmp_path):
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    victim = _start(tmp_path)
    deadline = time.time() + 600
    while not list((tmp_path / "models").glob(".SmolLM2-135M-Instruct.tmp-*")):
        assert victim.poll() is None, f"the conversion exited ({victim.returncode}) before its temporary directory appeared"
        assert time.time() < deadline, "the conversion's temporary directory never appeared in 600 s"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not target.exists()
    first, second = _start(tmp_path), _start(tmp_path)
    outs = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in (first, second)]
    assert outs == [str(target)] * 2
    assert sorted(p.name for p in target.parent.iterdir() if p.name.startswith(".")) == []
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30
    assert (target / "model.safetensors").stat().st_size > 200e6
    assert "{% for message in messages %}" in (target / "chat_template.jinja").read_text()
