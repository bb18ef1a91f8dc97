"""Send a workload and measure each target on the same server: cold (the connector opted out
through ``kv_transfer_params`` and a fresh ``cache_salt``, so neither the connector nor vLLM's own
prefix cache reuses anything) and through the connector, in alternating order so that a drifting
machine favours neither; then, for the noise floor, cold once more beside another request (what
exact computation itself varies by: a repeat in another batch composition)."""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from semshare_vllm.bench.client import Completion, Endpoint
from semshare_vllm.bench.workloads import BenchRequest

OPT_OUT = {"semshare": "off"}
# The parts of a request's time the connector reports (its provenance's ``timings_ms``, observed
# in the ``served_<part>_ms`` histograms for a hit, ``declined_`` / ``missed_`` ones otherwise;
# they do not overlap): held back waiting for the donor search, and for the alignment; moving
# the donor KV; recomputing (a miss: the first two only).
TIMINGS = ("search", "align", "load", "recompute")


@dataclass
class Measured:
    request: BenchRequest
    cold: Completion
    served: Completion  # through the connector
    connector_tokens: int  # prompt tokens the connector claimed for it (counter delta)
    # The reference's mean NLL after the prompt (nats per token), cold and through the
    # connector, and the prompt tokens the connector claimed for the latter (None: not scored)
    cold_nll: float | None = None
    served_nll: float | None = None
    scored_tokens: int = 0
    reference_tokens: int = 0  # the reference's tokens both NLLs are the mean of
    # the target cold again, beside another request (None: no noise floor measured)
    noise: Completion | None = None
    # the served request's repair, from the connector's metrics (None: not repaired, or the
    # figures did not arrive): its recompute share, and whether the gate escalated it
    recompute_share: float | None = None
    escalated: bool | None = None
    # how many times its gate found the error left above the bound (each time, it widened the
    # recompute or declined: a decline at 2 came after a second pass)
    escalations: int | None = None
    # what its gate estimated the tokens not recomputed still carried (None: no gate ran, or
    # the figure did not arrive); against ``recompute_error_bound``
    gate_residual: float | None = None
    # the connector claimed it, then declined its repair (``recompute_decline_share``): vLLM
    # computed the prompt, so it is no hit, and what trying cost shows in its TTFT
    declined: bool = False
    # where the served request's time went, as its provenance reports it (ms, by part of
    # ``TIMINGS``; a part missing: it did not run, or its figure did not arrive)
    timings: dict[str, float] = field(default_factory=dict)
    # of its recompute, the time in the layers that ran every position (layer 0, the probe)
    recompute_whole_ms: float | None = None
    # its recompute's time in each layer of the model (None: not reported)
    recompute_layers_ms: list[float] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.served.prompt_tokens or self.cold.prompt_tokens or 0

    @property
    def claimed(self) -> bool:
        """The connector claimed at least half of the prompt."""
        return self.prompt_tokens > 0 and self.connector_tokens >= 0.5 * self.prompt_tokens

    @property
    def hit(self) -> bool:
        """The connector served at least half of the prompt: claimed it, and did not decline."""
        return self.claimed and not self.declined

    @property
    def vllm_cached(self) -> bool:
        """Not a hit: vLLM's own prefix cache served at least half of the prompt (the served
        request's cached tokens less the connector's; with prefix caching on, the next turn of
        a chat is vLLM's to serve, and neither a hit nor a miss of ours)."""
        cached = (self.served.cached_tokens or 0) - self.connector_tokens
        return not self.claimed and self.prompt_tokens > 0 and cached >= 0.5 * self.prompt_tokens

    @property
    def perplexity_ratio(self) -> float | None:
        """The reference's perplexity after a hit over its perplexity cold (None unless the
        target and its scoring request were both hits: after a miss, the scoring request reuses
        the served request's own exact KV)."""
        if (
            not self.hit
            or self.cold_nll is None
            or self.served_nll is None
            or self.scored_tokens < 0.5 * max(self.prompt_tokens, 1)
        ):
            return None
        return math.exp(self.served_nll - self.cold_nll)


def wait_for_donors(
    endpoint: Endpoint,
    before: dict[str, float],
    donors: int,
    timeout_s: float,
    embed_wait_s: float = 15.0,
) -> None:
    """Until the server has captured the group's donors and embedded every donor it captured
    (earlier requests' captures queue ahead of this group's, so a count since ``before`` alone
    could be theirs); the second wait is short, for servers whose discovery is off."""
    if donors <= 0:
        return
    deadline = time.monotonic() + timeout_s
    captured_at = None
    while time.monotonic() < deadline:
        now = endpoint.counters()
        if (
            captured_at is None
            and now.get("captured_donors", 0) - before.get("captured_donors", 0) >= donors
        ):
            captured_at = time.monotonic()
        if captured_at is not None and (
            now.get("donors_embedded", 0) + now.get("donors_evicted", 0)
            >= now.get("captured_donors", 0)
            or time.monotonic() > captured_at + embed_wait_s
        ):
            return
        # a finished request is captured when the engine steps again: give it a step
        endpoint.complete("ping", max_tokens=1, kv_transfer_params=OPT_OUT)
        time.sleep(0.2)


def _claimed(endpoint: Endpoint, before: dict[str, float], timeout_s: float = 3.0) -> int:
    """The connector's claimed tokens since ``before``: its counters reach the API server with
    the engine's next stats, so wait until this request's lookup is counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = endpoint.counters()
        if now.get("lookups", 0) > before.get("lookups", 0) or time.monotonic() > deadline:
            return int(now.get("hit_tokens", 0) - before.get("hit_tokens", 0))
        time.sleep(0.05)


def _served(endpoint: Endpoint, prompt: str, max_tokens: int) -> tuple[Completion, int, dict]:
    """A completion through the connector, the prompt tokens it claimed for it, and the
    connector's metrics before and after it."""
    before = endpoint.counters()
    result = endpoint.complete(prompt, max_tokens)
    claimed = _claimed(endpoint, before)
    return result, claimed, {"before": before, "after": endpoint.counters()}


def _repair_figures(m: "Measured", metrics: dict) -> None:
    """The served request's repair from the metrics' change over it (the bench sends one
    request at a time there): whether the gate escalated it, whether the repair was declined,
    and the provenance's ``served_recompute_share`` and ``served_gate_residual`` histograms' one
    observation each (none for a declined load: vLLM computed it), and its time breakdown's (one
    observation of each ``served_<part>_ms``, and of ``served_recompute_layer_ms`` per
    layer; of a declined load or a miss, of each ``declined_<part>_ms`` or ``missed_<part>_ms``:
    what trying cost)."""
    before, after = metrics["before"], metrics["after"]

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    if delta("recompute_gate_checks") or delta("recompute_escalated_loads"):
        escalated = delta("recompute_escalated_loads")
        m.escalated = escalated > 0
        # every tensor-parallel rank counts both (vLLM sums the workers' stats): their ratio is
        # the one load's own count
        m.escalations = round(delta("recompute_escalations") / escalated) if escalated else 0
    if delta("served_recompute_share_count") == 1:
        m.recompute_share = delta("served_recompute_share_sum")
    if delta("served_gate_residual_count") == 1:
        m.gate_residual = delta("served_gate_residual_sum")
    m.declined = delta("recompute_declined") > 0
    # a request is observed on one side: served from a donor, declined, or missed (every side
    # observes its search wait)
    sides = ("served", "declined", "missed")
    side = next((s for s in sides if delta(f"{s}_search_ms_count") == 1), "served")
    for part in TIMINGS:
        if delta(f"{side}_{part}_ms_count") == 1:
            m.timings[part] = delta(f"{side}_{part}_ms_sum")
    if delta("served_recompute_whole_ms_count") == 1:
        m.recompute_whole_ms = delta("served_recompute_whole_ms_sum")
    layers = []
    while delta(f"served_recompute_layer_ms_count/{len(layers)}") == 1:
        layers.append(delta(f"served_recompute_layer_ms_sum/{len(layers)}"))
    m.recompute_layers_ms = layers or None


def warm_up(endpoint: Endpoint, donor_wait_s: float = 60.0) -> None:
    """One unmeasured donor and target (another instruction over a short real document), as
    ``vllm bench serve`` warms up: the server's first hit pays one-time loads (the alignment's
    embedding table, the embedder's first runs) that no measured request should."""
    from semshare_vllm.testbed.text import wiki_document

    doc = wiki_document(11, 1500)
    before = endpoint.counters()
    endpoint.complete("Summarise this text.\n\n" + doc, max_tokens=2)
    wait_for_donors(endpoint, before, 1, donor_wait_s)
    endpoint.complete("Read the following and list its places.\n\n" + doc, max_tokens=2)


def _score(endpoint: Endpoint, m: Measured, salt: str) -> None:
    """The reference's NLL after the prompt, cold (opted out, its own salt) and through the
    connector (reuse limited to the prompt)."""
    r = m.request
    m.cold_nll, m.reference_tokens = endpoint.reference_nll(
        r.prompt, r.reference, reuse=False, cache_salt=salt
    )
    before = endpoint.counters()
    m.served_nll, _ = endpoint.reference_nll(r.prompt, r.reference, reuse=True)
    m.scored_tokens = _claimed(endpoint, before)


def _cold(endpoint: Endpoint, prompt: str, max_tokens: int, salt: str | None = None) -> Completion:
    salt = salt or f"semshare-bench-cold-{uuid.uuid4().hex}"
    return endpoint.complete(prompt, max_tokens, cache_salt=salt, kv_transfer_params=OPT_OUT)


def cold_beside_another(endpoint: Endpoint, prompt: str, max_tokens: int) -> Completion:
    """The prompt cold again while another cold request runs, so that vLLM batches the two:
    what exact computation itself varies by, the floor every fidelity figure is read against.
    The other request is sent first (its prompt made beforehand) and outputs more tokens, so that
    it is still running when this one arrives."""
    from semshare_vllm.testbed.text import wiki_document

    other_prompt, sending = wiki_document(29, 400), threading.Event()

    def other():
        sending.set()
        try:  # its answer is not measured; only its place in the batch matters
            _cold(endpoint, other_prompt, 2 * max_tokens)
        except Exception:  # noqa: BLE001
            pass

    beside = threading.Thread(target=other, daemon=True)
    beside.start()
    sending.wait()
    try:
        return _cold(endpoint, prompt, max_tokens)
    finally:
        beside.join()


def measure_target(
    endpoint: Endpoint,
    r: BenchRequest,
    max_tokens: int,
    cold_first: bool,
    perplexity: bool = True,
    noise_floor: bool = True,
) -> Measured:
    """One target cold (opted out, its own salt) and served, in the order given (callers
    alternate it); with ``noise_floor``, cold again beside another request; with
    ``perplexity``, its reference then scored both ways."""
    salt = f"semshare-bench-cold-{uuid.uuid4().hex}"

    if cold_first:
        c = _cold(endpoint, r.prompt, max_tokens, salt)
        s, claimed, metrics = _served(endpoint, r.prompt, max_tokens)
    else:
        s, claimed, metrics = _served(endpoint, r.prompt, max_tokens)
        c = _cold(endpoint, r.prompt, max_tokens, salt)
    m = Measured(r, c, s, claimed)
    _repair_figures(m, metrics)
    if noise_floor:
        m.noise = cold_beside_another(endpoint, r.prompt, max_tokens)
    if perplexity and r.reference:
        _score(endpoint, m, salt)
    return m


def run(
    endpoint: Endpoint,
    requests: list[BenchRequest],
    max_tokens: int,
    donor_wait_s: float = 60.0,
    on_result: Callable[[Measured, int, int], None] | None = None,
    perplexity: bool = True,
    noise_floor: bool = True,
) -> list[Measured]:
    """Donors of each group first, then its targets (cold and served; with ``noise_floor``, cold
    again beside another request; with ``perplexity``, their reference scored both ways). A
    KeyboardInterrupt stops the run; what was measured so far is returned."""
    groups: dict[str, list[BenchRequest]] = {}
    for r in requests:
        groups.setdefault(r.group, []).append(r)
    total = sum(r.role == "target" for r in requests)
    out: list[Measured] = []
    try:
        for members in groups.values():
            donors = [r for r in members if r.role == "donor"]
            if donors:
                before, to_capture = endpoint.counters(), 0
                for d in donors:
                    sent, claimed, _ = _served(endpoint, d.prompt, max_tokens=2)
                    # a donor served from another donor is not kept itself: nothing to wait for
                    to_capture += claimed < 0.5 * (sent.prompt_tokens or 1)
                wait_for_donors(endpoint, before, to_capture, donor_wait_s)
            for r in (r for r in members if r.role == "target"):
                out.append(
                    measure_target(
                        endpoint,
                        r,
                        max_tokens,
                        cold_first=len(out) % 2 == 1,
                        perplexity=perplexity,
                        noise_floor=noise_floor,
                    )
                )
                if on_result is not None:
                    on_result(out[-1], len(out), total)
    except KeyboardInterrupt:
        pass
    return out
