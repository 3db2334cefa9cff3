"""The test run's rule-cache folder: a run killed before its atexit leaves one, which the next run
removes (review 5 R2)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import conftest
import pytest


def test_the_caches_of_dead_runs_are_removed_and_others_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = tmp_path / f"{conftest._CACHE_PREFIX}{int(gone.stdout)}-abc"
    alive = tmp_path / f"{conftest._CACHE_PREFIX}{os.getpid()}-abc"
    old_style = tmp_path / f"{conftest._CACHE_PREFIX}n051nhoh"
    elsewhere = tmp_path / "elsewhere"
    for folder in (dead, alive, old_style, elsewhere):
        folder.mkdir()
        (folder / "rules.json").write_text("{}")
    link = tmp_path / f"{conftest._CACHE_PREFIX}{int(gone.stdout) + 1}-lnk"
    link.symlink_to(elsewhere)
    conftest._remove_dead_runs_caches()
    assert not dead.exists()
    assert alive.exists() and old_style.exists() and (elsewhere / "rules.json").exists() and link.is_symlink()
