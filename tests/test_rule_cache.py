"""The rule cache (onnx_qrewrite/rewriter/rule_cache.py): the shipped rule files' TOML kept as
JSON, used only for the very text it was parsed from; the catalogue is the same with it or without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from onnx_qrewrite.rewriter import catalogue, rule_cache
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form, shipped_rules_dir

SAMPLES = shipped_rules_dir().parent / "sample_models"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_QREWRITE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(catalogue, "_PARSED", {})  # parse_rules' memory would answer instead
    return rule_cache.cache_dir()


def _entries(folder):
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def test_the_catalogue_read_from_the_cache_is_the_one_parsed(cache, monkeypatch):
    parsed = load_catalogue([named_form("qdq")])
    files = [*shipped_rules_dir().glob("*.toml"), named_form("qdq")]
    assert len(_entries(cache)) == len(files)
    for entry in _entries(cache):
        stored = json.loads(entry.read_text(encoding="utf-8"))
        assert stored["toml"] == tomllib.loads(stored["text"])
    monkeypatch.setattr(catalogue, "_PARSED", {})
    monkeypatch.setattr(tomllib, "loads", lambda *a, **k: pytest.fail("parsed although cached"))
    again = load_catalogue([named_form("qdq")])
    assert again.rules == parsed.rules


def test_an_entry_is_used_only_for_its_own_text(cache):
    text = '[[rule]]\nid = "x"\n'
    rule_cache.store(text, tomllib.loads(text))
    assert rule_cache.load(text) == {"rule": [{"id": "x"}]}
    (entry,) = _entries(cache)
    stored = json.loads(entry.read_text(encoding="utf-8"))
    entry.write_text(json.dumps({**stored, "text": text + " "}), encoding="utf-8")  # as if another text
    assert rule_cache.load(text) is None
    rule_cache.store(text, {"rule": []})
    assert json.loads(entry.read_text(encoding="utf-8"))["text"] == text + " "  # not written over
    entry.write_text("{not json", encoding="utf-8")
    assert rule_cache.load(text) is None


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_an_entry_others_may_write_is_ignored(cache):
    text = 'title = "t"\n'
    rule_cache.store(text, tomllib.loads(text))
    (entry,) = _entries(cache)
    entry.chmod(0o666)
    assert rule_cache.load(text) is None


def test_values_json_would_change_are_not_kept_and_a_cache_off_or_unwritable_is_skipped(cache, monkeypatch):
    dated = "when = 2026-11-28\n"
    rule_cache.store(dated, tomllib.loads(dated))
    assert _entries(cache) == []
    monkeypatch.setenv("ONNX_QREWRITE_CACHE_DIR", "")
    rule_cache.store('title = "t"\n', {"title": "t"})
    assert rule_cache.cache_dir() is None and rule_cache.load('title = "t"\n') is None
    blocked = cache.parent.parent / "a-file"
    blocked.write_text("", encoding="utf-8")
    monkeypatch.setenv("ONNX_QREWRITE_CACHE_DIR", str(blocked))
    rule_cache.store('title = "t"\n', {"title": "t"})  # cannot make the folder: nothing, no error
    assert len(load_catalogue()) > 0


def test_a_user_rule_file_is_not_cached(cache, tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text('title = "mine"\n', encoding="utf-8")
    load_catalogue([user], include_shipped=False)
    assert _entries(cache) == []


def test_a_cached_inspect_imports_no_tomllib_and_answers_the_same(tmp_path):
    """The console script's ``inspect``, cold then warm: the same answer, and the warm one without
    tomllib (its import and its parse were the point, see rule_cache.py)."""
    env = {**os.environ, "ONNX_QREWRITE_CACHE_DIR": str(tmp_path / "cache")}
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('tomllib' in sys.modules))\n"
        f"sys.argv = ['onnx-qrewrite', 'inspect', {str(SAMPLES / 'dynamic_mlp.onnx')!r}]\n"
        "from onnx_qrewrite.cli import console\n"
        "console()"
    )
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env) for _ in "ab"]
    assert [r.returncode for r in runs] == [0, 0]
    cold, warm = (r.stdout.rsplit("\n", 2) for r in runs)
    assert cold[0] == warm[0] and "quantization ops" in cold[0]
    assert (cold[1], warm[1]) == ("True", "False")
