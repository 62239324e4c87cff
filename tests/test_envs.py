"""Every FP8ENGINE_* variable lives in fp8engine/envs.py's table: docs/environment.md is that table, the code reads
no other, and a value outside its choices is an error naming the variable."""

import re
from pathlib import Path

import pytest

from fp8engine import envs

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_the_code_table():
    text = (ROOT / "docs" / "environment.md").read_text()
    assert envs.markdown_table() in text, "docs/environment.md's table is stale: paste envs.markdown_table()"


def test_the_code_reads_only_the_variables_of_the_table():
    named = set()
    for path in list((ROOT / "fp8engine").rglob("*.py")) + list((ROOT / "fp8engine" / "csrc").glob("*")):
        named |= set(re.findall(r"FP8ENGINE_[A-Z0-9_]+", path.read_text()))
    assert named == {v.name for v in envs.VARIABLES}
    readers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "fp8engine").rglob("*.py")
               if re.search(r"os\.environ(\.get)?\(?\[?\s*[\"']FP8ENGINE_|getenv\(", p.read_text())]
    assert readers == [], "read FP8ENGINE_* variables through fp8engine.envs"


def test_values_are_checked_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", "tiles")
    with pytest.raises(ValueError, match=r"FP8ENGINE_BI_GEMM must be one of \('cpp', 'chunked'\), got 'tiles'"):
        envs.get("FP8ENGINE_BI_GEMM")
    monkeypatch.setenv("FP8ENGINE_BI_GEMM", " chunked ")
    assert envs.get("FP8ENGINE_BI_GEMM") == "chunked"
    monkeypatch.delenv("FP8ENGINE_FUSED_DECODER", raising=False)
    assert envs.flag("FP8ENGINE_FUSED_DECODER") is True
    monkeypatch.setenv("FP8ENGINE_CACHE", "~/somewhere")
    assert envs.cache_root() == Path.home() / "somewhere"
