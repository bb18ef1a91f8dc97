"""One engine lifetime in its own process (``tests/engine/scenarios/persisted_other_weights.py``):
what a restart sees of the donors an earlier lifetime persisted."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCENARIO = Path(__file__).parents[1] / "engine" / "scenarios" / "persisted_other_weights.py"


def lifetime(model, persist_dir, tmp_path, max_tokens: int, **job) -> dict:
    """Run ``job`` (the scenario's keys) on ``persist_dir``; the scenario's JSON line."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dict(job, max_tokens=max_tokens)))
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(model), str(persist_dir), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
