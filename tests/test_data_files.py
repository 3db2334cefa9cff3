"""The test data checked in under tests/data is complete and unchanged: every file its SHA256SUMS
lists is there with that digest, nothing unlisted sits beside it, and the real models the tests
parametrize over are exactly the ones on disk. A missing file fails here (and in the tests that read
it), never turns into a skip."""

from __future__ import annotations

import hashlib

import pytest
from conftest import DATA, REAL_MODEL_NAMES, REAL_MODELS

FOLDERS = ("models", "quark_vectors", "genai", "exported")


def _listed(folder: str) -> dict[str, str]:
    lines = (DATA / folder / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_listed_file_is_present_and_unchanged(folder):
    listed = _listed(folder)
    assert listed, f"{folder}/SHA256SUMS lists nothing"
    for name, digest in listed.items():
        path = DATA / folder / name
        assert path.is_file(), f"{path} is missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{path} changed"


@pytest.mark.parametrize("folder", FOLDERS)
def test_nothing_unlisted_and_provenance_written(folder):
    on_disk = {p.name for p in (DATA / folder).iterdir()} - {"SHA256SUMS", "README.md"}
    assert on_disk == set(_listed(folder))
    assert (DATA / folder / "README.md").is_file()


def test_real_model_names_are_the_models_on_disk():
    assert sorted(p.stem for p in REAL_MODELS.glob("*.onnx")) == sorted(REAL_MODEL_NAMES)
    for name in REAL_MODEL_NAMES:
        for kind in ("inputs", "outputs"):
            assert (REAL_MODELS / f"{name}.{kind}.npz").is_file()
