"""Run in its own process by test_engine_weights.py and test_engine_lora.py: one engine lifetime
on ``persist_dir``. Serves ``prompt`` (with the LoRA adapter ``lora``, ``[name, path]``, when
given, and vLLM's own ``engine_args``, such as ``load_format``; then, with ``cold``, the same
prompt opted out under its own salt), writes its donor to disk with ``capture``, and prints one
JSON line: the outputs, the scheduler's and worker's stats, the fingerprint in use. With
``swap`` (``[link, target]``), ``link`` is pointed at ``target`` right after vLLM loaded the
model (a trainer replacing ``latest`` while the engine starts).

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
lora, engine_args = None, dict(job.get("engine_args", {}))
if job.get("lora"):
    from vllm.lora.request import LoRARequest

    lora = LoRARequest(job["lora"][0], 1, job["lora"][1])
    engine_args.update(enable_lora=True, max_lora_rank=8, max_loras=1)
if job.get("swap"):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    link, target = job["swap"]
    load_model = CPUModelRunner.load_model

    def load_then_swap(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        os.unlink(link)
        os.symlink(target, link)
        return out

    CPUModelRunner.load_model = load_then_swap
llm = offline.semshare_llm(
    model,
    {"persist_dir": persist_dir, "host_store_bytes": "256MiB"},
    max_model_len=2048,
    **engine_args,
)
sched, worker = offline.connector_halves(llm)
restored = sched.stats.totals.get("donors_restored", 0)
out = offline.run(llm, job["prompt"], job["max_tokens"], lora_request=lora)
scheduler = dict(sched.stats.totals)  # before the cold run below adds its lookup
cold = None
if job.get("cold"):
    cold = offline.run(
        llm,
        job["prompt"],
        job["max_tokens"],
        salt="cold-" + os.urandom(8).hex(),
        kv_transfer_params={"semshare": "off"},
        lora_request=lora,
    )
if job.get("capture"):
    offline.run(llm, job["filler"], 2)  # one more step: the capture starts...
    worker.flush_captures()  # ...and is written to disk
    worker.kv.store.flush()
print(
    json.dumps(
        {
            "out": out,
            "cold": cold,
            "restored": restored,
            "fingerprint": sched.geometry.fingerprint,
            "local_only": [sched.geometry.local_only, worker.geometry.local_only],
            "workers_confirmed": sched.workers_confirmed,
            "block_size": sched.geometry.block_size,
            "prefix_caching": bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching),
            "scheduler": scheduler,
            "worker": dict(worker.stats.totals),
        }
    )
)
