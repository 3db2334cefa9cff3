"""The rule cache (onnx_qrewrite/rewriter/rule_cache.py): the shipped rule files' TOML kept as
JSON, used only for the very text it was parsed from; the catalogue is the same with it or without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

from onnx_qrewrite.rewriter import catalogue, rule_cache, rule_cache_prune
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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_a_link_or_an_oversized_file_at_an_entrys_name_is_not_read(cache):
    """Opening a FIFO waits for a writer: an entry's name taken by one (a shared cache folder, a
    stray mkfifo) hung every command. Links and files too large for their text are not read either."""
    import threading

    text = 'title = "t"\n'
    cache.mkdir(parents=True)
    name = rule_cache._entry(cache, text)
    os.mkfifo(name, 0o600)
    answer = []
    reader = threading.Thread(target=lambda: answer.append(rule_cache.load(text)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and answer == [None]
    os.unlink(name)
    rule_cache.store(text, tomllib.loads(text))
    assert rule_cache.load(text) == {"title": "t"}
    real = name.with_suffix(".real")
    name.rename(real)
    name.symlink_to(real)
    assert rule_cache.load(text) is None
    name.unlink()
    stored = json.loads(real.read_text(encoding="utf-8"))
    name.write_text(json.dumps(stored) + " " * rule_cache._limit(text), encoding="utf-8")
    name.chmod(0o600)
    assert rule_cache.load(text) is None


def test_no_home_folder_means_no_cache_not_an_error(monkeypatch):
    """Containers run as a uid without a passwd entry and no HOME: Path.home() raises there."""
    monkeypatch.delenv("ONNX_QREWRITE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(catalogue, "_PARSED", {})

    def no_home() -> None:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(rule_cache.Path, "home", staticmethod(no_home))
    assert rule_cache.cache_dir() is None
    assert len(load_catalogue()) > 0


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


def test_an_entry_of_another_format_is_not_read_and_not_trusted(cache):
    """An entry's layout is in its name and its ``format`` field: a package with another layout
    (the entries before format 2 had no field and no prefix) neither finds nor trusts it."""
    text = 'title = "t"\n'
    rule_cache.store(text, tomllib.loads(text))
    (entry,) = _entries(cache)
    assert entry.name.startswith(f"v{rule_cache.FORMAT}-")
    stored = json.loads(entry.read_text(encoding="utf-8"))
    assert stored == {"format": rule_cache.FORMAT, "text": text, "toml": {"title": "t"}}
    for other in ({"text": text, "toml": {"title": "t"}}, {**stored, "format": rule_cache.FORMAT + 1}):
        entry.write_text(json.dumps(other), encoding="utf-8")
        assert rule_cache.load(text) is None  # parsed again, never trusted
    entry.unlink()
    old_name = cache / entry.name.removeprefix(f"v{rule_cache.FORMAT}-")  # format 1's name
    old_name.write_text(json.dumps({"text": text, "toml": {"title": "old"}}), encoding="utf-8")
    old_name.chmod(0o600)
    assert rule_cache.load(text) is None
    rule_cache.store(text, tomllib.loads(text))
    assert rule_cache.load(text) == {"title": "t"}


def _fill(cache, monkeypatch, count):
    """``count`` entries written one second apart (oldest first), without pruning."""
    monkeypatch.setattr(rule_cache_prune, "_pruned", {cache})
    texts = [f'title = "t{i}"\n' for i in range(count)]
    for i, text in enumerate(texts):
        rule_cache.store(text, tomllib.loads(text))
        os.utime(rule_cache._entry(cache, text), (1_000_000 + i, 1_000_000 + i))
    return texts


def test_the_folder_keeps_the_entries_written_last(cache, monkeypatch):
    """A process that writes an entry prunes the folder once: the KEEP written last stay (any
    format), a killed writer's old temporary file goes, one in progress and other files stay."""
    texts = _fill(cache, monkeypatch, 4)
    old = cache / "0123456789abcdef-10.json"  # a format-1 entry, the oldest
    old.write_text("{}", encoding="utf-8")
    os.utime(old, (1, 1))
    stale, fresh, other = cache / ".entry-a.tmp", cache / ".entry-b.tmp", cache / "notes.txt"
    for path in (stale, fresh, other):
        path.write_text("", encoding="utf-8")
    os.utime(stale, (1, 1))
    monkeypatch.setattr(rule_cache, "KEEP", 3)
    monkeypatch.setattr(rule_cache_prune, "_pruned", set())
    rule_cache.store('title = "new"\n', {"title": "new"})
    kept = {p.name for p in cache.iterdir()}
    newest = [rule_cache._entry(cache, t).name for t in ('title = "new"\n', texts[3], texts[2])]
    assert kept == {*newest, fresh.name, other.name}
    assert rule_cache.load(texts[1]) is None and rule_cache.load(texts[3]) == {"title": "t3"}
    rule_cache.store(texts[1], {"title": "t1"})  # pruned once per process: not again
    assert len(_entries(cache)) == 4


def test_pruning_never_fails_a_command(cache, monkeypatch):
    """Files gone or not removable meanwhile (another process pruning, permissions), or no
    folder at all: pruning passes over them, and what is kept is still read right."""
    texts = _fill(cache, monkeypatch, 3)
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "refused", path)

    monkeypatch.setattr(rule_cache_prune.os, "unlink", refuse)
    rule_cache_prune.prune(cache, keep=1)
    assert len(_entries(cache)) == 3
    monkeypatch.setattr(rule_cache_prune.os, "unlink", unlink)
    rule_cache_prune.prune(cache / "missing", keep=1)
    rule_cache_prune.prune(cache, keep=1)
    assert _entries(cache) == [rule_cache._entry(cache, texts[2])]
    assert rule_cache.load(texts[2]) == {"title": "t2"}


def test_concurrent_writers_and_pruners_never_give_a_wrong_entry(cache, monkeypatch):
    """Threads writing, pruning and reading one folder at once: each read is its own text's
    values or nothing, nothing raises, and the folder ends within its bound."""
    import threading

    monkeypatch.setattr(rule_cache, "KEEP", 3)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                text = f'title = "w{n}-{i}"\n'
                rule_cache.store(text, {"title": f"w{n}-{i}"})
                rule_cache_prune.prune(cache, keep=3)
                assert rule_cache.load(text) in (None, {"title": f"w{n}-{i}"})
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rule_cache_prune.prune(cache, keep=3)
    assert len(_entries(cache)) == 3


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="links")
def test_pruning_removes_only_what_the_cache_wrote(cache, monkeypatch, tmp_path):
    """A user's own JSON beside the entries, a link at an entry's name, and a cache folder that is
    a link to a user's folder (planted in a shared cache folder): none is removed or written in
    (review 4, R8: 73 of 200 files of a linked folder were deleted)."""
    _fill(cache, monkeypatch, 3)
    mine = cache / "annotation_1.json"
    mine.write_text("{}", encoding="utf-8")
    linked = cache / "v2-0123456789abcdef-10.json"
    linked.symlink_to(mine)
    os.utime(mine, (1, 1))  # the oldest file of the folder
    rule_cache_prune.prune(cache, keep=1)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [mine.name, linked.name, rule_cache._entry(cache, 'title = "t2"\n').name]
    )
    victim = tmp_path / "victim"
    victim.mkdir()
    for i in range(5):
        (victim / f"{i:016x}-{i}.json").write_text("{}", encoding="utf-8")  # named like entries
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / cache.name).symlink_to(victim)
    monkeypatch.setenv("ONNX_QREWRITE_CACHE_DIR", str(shared))
    monkeypatch.setattr(rule_cache_prune, "_pruned", set())
    monkeypatch.setattr(rule_cache, "KEEP", 1)
    rule_cache.store('title = "x"\n', {"title": "x"})
    rule_cache_prune.prune(shared / cache.name, keep=1)
    assert len(list(victim.iterdir())) == 5  # nothing written in it, nothing removed
