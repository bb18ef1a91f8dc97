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


@pytest.fixture(autouse=True, scope="session")
def _file_digests_kept_apart(tmp_path_factory):
    """Digests of the tests' temporary files go to a directory of this run, not the user's
    cache, for every fixture's engine too (session scope: set up before module fixtures). The
    engines tests start in processes of their own still use the user's (bounded)."""
    from semshare_vllm.core import file_digest

    root = tmp_path_factory.getbasetemp() / "file-digests"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(file_digest, "_cache_root", lambda: root)
        yield
