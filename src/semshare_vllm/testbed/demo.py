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
    from transformers import AutoTokenizer

    model = models.smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    article = wiki_document(7, 5000)
    questions = ["What is the first article above about? Answer in one sentence.",
                 "Which places are mentioned in the articles above?"]
    # The chat template puts the article first, so both prompts share it token for token.
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{article}\n\n{q}"}],
                                       tokenize=False, add_generation_prompt=True)
               for q in questions]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        print(f"starting vllm serve {model} with SemShareConnector (log: {log}) ...", flush=True)
        with VllmServer(model, SEMSHARE, ["--block-size", "32"], log) as srv:
            for i, (q, prompt) in enumerate(zip(questions, prompts)):
                out = srv.complete(prompt, max_tokens=48, ignore_eos=False)
                print(f"\nrequest {i + 1}: prompt {out.prompt_tokens} tokens, "
                      f"{out.cached_tokens} from the connector, TTFT {out.ttft_s:.2f}s")
                print("question:", q)
                print("answer:", out.text.strip())


if __name__ == "__main__":
    main()
