import os

import pytest

# Offline, loopback-only, in-process engine: set before vLLM is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The Triton interpreter runs kernels on CPU tensors; vLLM disables Triton on CPU either way.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _file_digests_kept_apart(tmp_path_factory, monkeypatch):
    """Digests of the tests' temporary files go to a directory of this run, not the user's
    cache (an engine's own processes, which tests start, still use the user's: bounded)."""
    from semshare_vllm.core import file_digest

    root = tmp_path_factory.getbasetemp() / "file-digests"
    monkeypatch.setattr(file_digest, "_cache_root", lambda: root)
