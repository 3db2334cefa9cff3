"""What the package says about itself is true: one version everywhere, the dependencies the core
install needs and no more, the Python versions CI runs, a docstring on every public name."""

from __future__ import annotations

import email
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
import subprocess
import sys
import zipfile

from conftest import REPO

import onnx_qrewrite


def _wheel_metadata(wheel) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_one_version_everywhere(wheel):
    cli = subprocess.run(
        [sys.executable, "-m", "onnx_qrewrite", "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert cli.stdout.strip() == f"onnx-qrewrite, version {onnx_qrewrite.__version__}"
    assert importlib.metadata.version("onnx-qrewrite") == onnx_qrewrite.__version__
    assert _wheel_metadata(wheel)["Version"] == onnx_qrewrite.__version__
    # Written once: pyproject.toml reads it from the package.
    assert not re.search(r"(?m)^version\s*=", (REPO / "pyproject.toml").read_text())


def test_core_requirements_leave_the_runtime_to_extras(wheel):
    meta = _wheel_metadata(wheel)
    requires = meta.get_all("Requires-Dist")
    core = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert core.isdisjoint({"onnxruntime", "onnxruntime-extensions", "onnxruntime-gpu", "onnxscript", "ml-dtypes"})
    by_extra: dict[str, set[str]] = {extra: set() for extra in meta.get_all("Provides-Extra")}
    for r in requires:
        if m := re.search(r"""extra == ['"]([\w-]+)['"]""", r):
            by_extra[m.group(1)].add(re.split(r"[\s<>=!~;]", r, maxsplit=1)[0].lower())
    assert by_extra["verify"] == {"onnxruntime", "onnxruntime-extensions", "ml-dtypes"}
    assert by_extra["onnxscript"] == {"onnxscript"}
    assert by_extra["test"] >= by_extra["verify"] | by_extra["onnxscript"]


def test_each_runtime_is_an_extra_the_core_install_does_not_need(wheel):
    """Issue 11: the target runtimes are optional extras, never required by the core install, and
    the extra a missing runtime's error names (verify/runtimes.py install_hint) and `targets` lists
    (a profile's `extra`) exists and installs that runtime. TFLite has none: onnx2tf pins onnx and
    onnxruntime below what this package is proven on, so it lives in its own environment."""
    from onnx_qrewrite.targets import load_targets
    from onnx_qrewrite.verify.runtimes import RUNTIMES

    meta = _wheel_metadata(wheel)
    requires = meta.get_all("Requires-Dist")
    core = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    by_extra: dict[str, set[str]] = {extra: set() for extra in meta.get_all("Provides-Extra")}
    for r in requires:
        if m := re.search(r"""extra == ['"]([\w-]+)['"]""", r):
            by_extra[m.group(1)].add(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower())
    assert core.isdisjoint({spec.distribution for spec in RUNTIMES.values()} | {"ai-edge-litert"})
    assert RUNTIMES["tflite"].extra == "" and "onnx2tf" not in set().union(*by_extra.values())
    for name, spec in RUNTIMES.items():
        assert not spec.extra or spec.distribution in by_extra.get(spec.extra, set()), name
    for profile in load_targets().values():
        if profile.extra:
            assert RUNTIMES[profile.runtime].distribution in by_extra.get(profile.extra, set()), profile.id


def test_declared_pythons_are_the_ones_ci_runs(wheel):
    meta = _wheel_metadata(wheel)
    declared = sorted(
        (c.rsplit(":: ", 1)[1] for c in meta.get_all("Classifier") if re.fullmatch(r".*:: 3\.\d+", c)),
        key=lambda v: tuple(map(int, v.split("."))),
    )
    assert meta["Requires-Python"] == f">={declared[0]}"
    ci = (REPO / ".ci" / "run").read_text()
    assert f"OLDEST={declared[0]}" in ci and f"NEWEST={declared[-1]}" in ci
    assert f"Python {declared[0]} to {declared[-1]}" in (REPO / "README.md").read_text()


def _public_modules() -> list[str]:
    names = ["onnx_qrewrite"]
    for info in pkgutil.walk_packages(onnx_qrewrite.__path__, "onnx_qrewrite."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def test_every_public_name_has_a_docstring():
    missing = []
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            missing.append(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants and re-exported values: documented where they are defined
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module_name}.{name}")
    assert not missing, "undocumented: " + ", ".join(missing)


def test_the_api_surface_documents_its_methods():
    """Classes a Python caller gets from onnx_qrewrite and onnx_qrewrite.verify: every public method
    and property says what it does."""
    import onnx_qrewrite.verify as verify_api
    from onnx_qrewrite.rewriter.report import RewriteReport

    classes = [getattr(onnx_qrewrite, n) for n in onnx_qrewrite.__all__ if inspect.isclass(getattr(onnx_qrewrite, n))]
    classes += [getattr(verify_api, n) for n in verify_api.__all__ if inspect.isclass(getattr(verify_api, n))]
    classes.append(RewriteReport)
    missing = []
    for cls in classes:
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (inspect.isfunction(target) or isinstance(value, property)) and not (target.__doc__ or "").strip():
                missing.append(f"{cls.__module__}.{cls.__qualname__}.{attr}")
    assert not missing, "undocumented: " + ", ".join(missing)
