"""Run in its own process by test_engine_weights.py: one engine lifetime on ``persist_dir``.
Serves ``prompt`` (after ``warm``, when given, whose donor is then written to disk), and prints
one JSON line: the output, the scheduler's and worker's stats, the fingerprint in use.

    persisted_other_weights.py MODEL PERSIST_DIR JOB_JSON
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from semshare_vllm.testbed import offline  # noqa: E402

model, persist_dir, job_path = sys.argv[1:4]
with open(job_path) as f:
    job = json.load(f)
llm = offline.semshare_llm(
    model, {"persist_dir": persist_dir, "host_store_bytes": "256MiB"}, max_model_len=2048
)
sched, worker = offline.connector_halves(llm)
restored = sched.stats.totals.get("donors_restored", 0)
out = offline.run(llm, job["prompt"], job["max_tokens"])
if job.get("capture"):
    offline.run(llm, job["filler"], 2)  # one more step: the capture starts...
    worker.flush_captures()  # ...and is written to disk
    worker.kv.store.flush()
print(
    json.dumps(
        {
            "out": out,
            "restored": restored,
            "fingerprint": sched.geometry.fingerprint,
            "scheduler": dict(sched.stats.totals),
            "worker": dict(worker.stats.totals),
        }
    )
)
