"""One OpenAI-compatible vLLM endpoint: streaming completions timed on the client, and the
connector's Prometheus counters."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

import requests


class EndpointError(RuntimeError):
    """The server cannot be benchmarked (unreachable, no model, no SemShare connector)."""


@dataclass
class Completion:
    text: str
    ttft_s: float  # first streamed text chunk, measured on the client
    total_s: float  # end to end
    cached_tokens: int | None  # prompt_tokens_details.cached_tokens (vLLM's and ours)
    prompt_tokens: int | None
    output_tokens: int | None = None  # usage.completion_tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (``vllm bench serve``'s TPOT; None: fewer than
        two, or not reported): a decode step, one token's forward over the whole context."""
        if not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.output_tokens - 1)


_COUNTER = re.compile(r"^vllm:semshare_(\w+)_total\{[^}]*\} (\S+)$", re.M)
# a histogram's sum and count, read as counters named <histogram>_sum / <histogram>_count
_HISTOGRAM = re.compile(r"^vllm:semshare_(\w+_(?:sum|count))\{(?![^}]*layer=)[^}]*\} (\S+)$", re.M)
# a per-layer histogram's, read as <histogram>_sum/<layer> and <histogram>_count/<layer>
_LAYER_HISTOGRAM = re.compile(
    r'^vllm:semshare_(\w+_(?:sum|count))\{[^}]*\blayer="(\d+)"[^}]*\} (\S+)$', re.M
)
# vLLM's CacheConfig as an info gauge: one label per field
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class Endpoint:
    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600):
        self.url = base_url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.timeout_s = timeout_s
        self.model = model
        self.max_model_len: int | None = None

    def check(self, need_connector: bool = True) -> None:
        """Fail clearly unless the server answers, serves a model and (``need_connector``)
        runs the SemShare connector."""
        try:
            models = requests.get(self.url + "/v1/models", timeout=10)
            models.raise_for_status()
        except requests.RequestException as exc:
            raise EndpointError(f"no vLLM server at {self.url}: {exc}") from None
        data = models.json().get("data") or []
        if self.model is None:
            if not data:
                raise EndpointError(f"{self.url} serves no model")
            self.model = data[0]["id"]
        # vLLM's model card names the context it serves: the workloads are fitted to it
        self.max_model_len = next(
            (m.get("max_model_len") for m in data if m.get("id") == self.model), None
        )
        if need_connector and not self.counters():
            raise EndpointError(
                f"{self.url} does not run the SemShare connector (no vllm:semshare_* metrics); "
                'start it with --kv-transfer-config \'{"kv_connector":"SemShareConnector",'
                '"kv_connector_module_path":"semshare_vllm.connector","kv_role":'
                '"kv_both"}\''
            )

    def counters(self) -> dict[str, float]:
        """The connector's counters (``vllm:semshare_<name>_total``, summed over engines), and
        each histogram's ``<name>_sum`` and ``<name>_count`` (per layer: ``<name>_sum/<layer>``
        and ``<name>_count/<layer>``)."""
        try:
            text = requests.get(self.url + "/metrics", timeout=10).text
        except requests.RequestException:
            return {}
        out: dict[str, float] = {}
        for name, value in _COUNTER.findall(text) + _HISTOGRAM.findall(text):
            out[name] = out.get(name, 0.0) + float(value)
        for name, layer, value in _LAYER_HISTOGRAM.findall(text):
            out[f"{name}/{layer}"] = out.get(f"{name}/{layer}", 0.0) + float(value)
        return out

    def cache_config(self) -> dict[str, str]:
        """What the server caches KV with, from vLLM's ``vllm:cache_config_info``:
        ``block_size`` and ``enable_prefix_caching`` (as vLLM prints them; {} where the server
        does not say), so that every result names the configuration it was measured in."""
        try:
            text = requests.get(self.url + "/metrics", timeout=10).text
        except requests.RequestException:
            return {}
        found = _CACHE_INFO.search(text)
        labels = dict(_LABEL.findall(found.group(1))) if found else {}
        return {k: labels[k] for k in ("block_size", "enable_prefix_caching") if k in labels}

    def complete(
        self,
        prompt: str | list[int],
        max_tokens: int = 16,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        ignore_eos: bool = True,
    ) -> Completion:
        """Greedy streaming completion; TTFT to the first text chunk, as ``vllm bench serve``
        measures it."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True},
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        t0 = time.perf_counter()
        ttft, text, usage = None, [], {}
        with requests.post(
            self.url + "/v1/completions", json=body, stream=True, timeout=self.timeout_s
        ) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(chunk["choices"][0].get("text", ""))
                if chunk.get("usage"):
                    usage = chunk["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            "".join(text),
            ttft if ttft is not None else float("nan"),
            time.perf_counter() - t0,
            details.get("cached_tokens"),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
        )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` under the served model's tokenizer (vLLM's ``/tokenize``)."""
        resp = requests.post(
            self.url + "/tokenize",
            json={"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens},
            timeout=self.timeout_s,
        )
        resp.raise_for_status()
        return resp.json()["tokens"]

    def reference_nll(
        self, prompt: str, reference: str, reuse: bool, cache_salt: str | None = None
    ) -> tuple[float, int]:
        """Mean negative log-likelihood of ``reference`` after ``prompt`` (nats per token), from
        vLLM's prompt logprobs, and how many tokens it is the mean of. ``reuse``: the connector
        may serve the prompt (its reuse is limited to the prompt, so vLLM scores every reference
        token); else it is opted out."""
        head = self.tokenize(prompt)
        tail = self.tokenize(reference, add_special_tokens=False)
        if not tail:
            return float("nan"), 0
        params = {"semshare_reuse_limit": len(head) - 1} if reuse else {"semshare": "off"}
        body = {
            "model": self.model,
            "prompt": head + tail,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "kv_transfer_params": params,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        resp = requests.post(self.url + "/v1/completions", json=body, timeout=self.timeout_s)
        resp.raise_for_status()
        rows = resp.json()["choices"][0]["prompt_logprobs"][len(head) :]
        nll = [-row[str(tok)]["logprob"] for row, tok in zip(rows, tail)]
        return math.fsum(nll) / len(nll), len(nll)
