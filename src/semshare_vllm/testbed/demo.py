"""`make demo`: a real `vllm serve` with SemShareConnector on SmolLM2-135M (CPU, float32).

Sends one Wikipedia article behind two different questions and prints, for each, the
client-side time to first token, how many prompt tokens came from the connector, and the answer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from semshare_vllm.testbed import models
from semshare_vllm.testbed.server import SEMSHARE, VllmServer
from semshare_vllm.testbed.text import wiki_document


def main() -> None:
    model = models.smollm2()
    article = wiki_document(7, 5000)
    questions = ["\n\nQuestion: Who or what is the text above about? Answer:",
                 "\n\nQuestion: Summarize the text above in one sentence. Answer:"]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        print(f"starting vllm serve {model} with SemShareConnector (log: {log}) ...", flush=True)
        with VllmServer(model, SEMSHARE, ["--block-size", "32"], log) as srv:
            for i, q in enumerate(questions):
                out = srv.complete(article + q, max_tokens=32)
                print(f"\nrequest {i + 1}: prompt {out.prompt_tokens} tokens, "
                      f"{out.cached_tokens} from the connector, TTFT {out.ttft_s:.2f}s")
                print("answer:", out.text.strip())


if __name__ == "__main__":
    main()
