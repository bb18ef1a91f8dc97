"""Run in its own process by test_engine_prefix_cache.py: the connector next to vLLM's own prefix
cache (on, as vLLM's default), with a KV cache small enough that vLLM evicts the donor's blocks.
Prints one JSON line."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from transformers import AutoTokenizer  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402

from semshare_vllm.testbed import offline  # noqa: E402
from semshare_vllm.testbed.text import wiki_document  # noqa: E402

model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model)


def ids(text):
    return tok(text, add_special_tokens=False)["input_ids"]


doc = ids(wiki_document(500, 1500))
a, b = doc + ids("\nQuestion one?"), doc + ids("\nAnd question two, please?")
fillers = [ids(wiki_document(2000 + 40 * i, 3000))[:900] for i in range(4)]
llm = offline.make_llm(
    model,
    {
        "kv_connector": "SemShareConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "semshare_vllm.connector",
        "kv_connector_extra_config": {"host_store_bytes": "256MiB"},
    },
    enable_prefix_caching=True,
    num_gpu_blocks_override=40,
    max_model_len=1024,
)


def run(prompt):
    return offline.summarize(
        llm.generate([{"prompt_token_ids": prompt}], offline.greedy(12), use_tqdm=False)
    )[0]


first = run(a)
again = run(b)  # vLLM's own prefix cache still holds the document
sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
hits_before_eviction = sched.stats.totals["hit_tokens"]
for f in fillers:  # 4 x 900 tokens through a 1,280-token cache: the document's blocks go
    run(f)
last = run(b)
print(
    json.dumps(
        {
            "b_with_vllm_cache": again,
            "b_after_eviction": last,
            "prompt_b": b,
            "hit_tokens_before_eviction": hits_before_eviction,
            "scheduler": dict(sched.stats.totals),
            "worker": dict(get_kv_transfer_group().worker.stats.totals),
        }
    )
)
