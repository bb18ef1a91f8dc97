"""The connector beside vLLM's own prefix cache (vLLM's default): it stays out of the way while
vLLM's cache holds a prefix, serves it once vLLM has evicted it, and the answer is cold's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semshare_vllm.testbed import models, offline

pytestmark = pytest.mark.engine


def test_connector_serves_what_vllms_prefix_cache_evicted():
    model = str(models.tiny_llama())
    script = Path(__file__).parent / "scenarios" / "prefix_cache_on.py"
    proc = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    b = out["b_after_eviction"]
    assert out["hit_tokens_before_eviction"] == 0  # vLLM's own cache served the first repeat
    assert out["b_with_vllm_cache"]["num_cached_tokens"] > 0
    claim = out["scheduler"]["hit_tokens"]
    assert claim > 0 and b["num_cached_tokens"] >= claim
    assert out["worker"]["loaded_tokens"] == claim
    assert out["scheduler"]["lookups"] == 7  # once per request, though vLLM re-asks waiting ones
    cold = offline.reference_outputs(model, [out["prompt_b"]], 12)[0]
    assert b["token_ids"] == out["b_with_vllm_cache"]["token_ids"] == cold["token_ids"]
