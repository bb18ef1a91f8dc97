"""With echoes on, a passage naming what the target asks about is read as cold reads it after a
semantic hit (real vLLM engine on CPU, SmolLM2-135M, the bench's doc-qa workload at 1K tokens).

The donor asks about one work, the target about another; both prompts hold the same passages.
The donor's KV of the passage on the target's work was computed under the donor's question, and
the deeper layers read it differently: without echoes (``alignment/echoes.py``) the adaptive
repair leaves it as the donor had it (its check layer ranked it past the first 15% of tokens),
and the perplexity of the reference (the answer, then the passage's sentence stating it) is
1.07x cold's. Scored as the bench scores it: the reference after the prompt, the prompt's loaded
positions repaired, the rest computed after them (``BlendBench.continuation_nll``); only the
prompt aligned, as the connector aligns a served request (the reference must not mark echoes).
"""

import math

import numpy as np
import pytest

from semshare_vllm.bench import workloads
from semshare_vllm.config import SemShareConfig
from semshare_vllm.recompute.policy import make_selection
from semshare_vllm.scheduler.planner import plan_claim
from semshare_vllm.testbed import offline
from semshare_vllm.testbed.blend_eval import BlendBench

pytestmark = pytest.mark.engine

ASKED = "Who wrote Death of a Salesman?"
ECHO_SPAN = SemShareConfig().recompute_echo_span  # 24, capped at recompute_echo_max_share


@pytest.fixture(scope="module")
def llm(model):
    engine = offline.semshare_llm(
        model, {"recompute_policy": "all", "embedder": "none", "capture": False}
    )
    yield engine
    del engine
    offline.drop_connector()


@pytest.fixture(scope="module")
def pair(tok):
    """The doc-qa group whose target asks ``ASKED``: its donor and target token ids, and where
    the target's prompt ends (its reference follows)."""
    requests = workloads.build("doc-qa", 2, 1024, workloads.Sizer(tok), 0)
    ending = f"Question: {ASKED}\nShort answer:"
    target = next(r for r in requests if r.role == "target" and r.prompt.endswith(ending))
    donor = next(r for r in requests if r.role == "donor" and r.group == target.group)
    assert ASKED not in donor.prompt
    head = tok(target.prompt)["input_ids"]
    tail = tok(target.reference, add_special_tokens=False)["input_ids"]
    return tok(donor.prompt)["input_ids"], head + tail, len(head)


def test_the_passage_on_what_the_target_asks_is_read_as_cold_reads_it(llm, pair):
    donor, target, prompt_len = pair
    worker = offline.connector_halves(llm)[1]
    bench = BlendBench.on_engine(worker, donor, target, prompt_len=prompt_len)
    assert len(bench.alignment.echoes) > 0
    config = SemShareConfig()
    loaded = np.arange(prompt_len - 1)
    cold = bench.continuation_nll(None, prompt_len)

    def ratio(echo_span: int) -> tuple[float, float]:
        plan = plan_claim(
            None,
            bench.alignment,
            0,
            len(loaded),
            config.recompute_run_head,
            config.recompute_tail,
            echo_span,
            config.recompute_echo_max_share,
        )
        always = np.asarray(plan.always, dtype=np.int64)
        selection = make_selection("adaptive", loaded, always, config, len(bench.runner.layers))
        served = bench.continuation_nll(selection, prompt_len)
        assert not selection.declined
        return math.exp(served - cold), len(always) / len(loaded)

    assert ECHO_SPAN > 0  # on by default (docs/benchmarks.md, echoes)
    served, share = ratio(ECHO_SPAN)
    before, _ = ratio(0)
    assert before > 1.05, "the case no longer shows what echoes are for: pick another"
    assert served <= 1.03, (served, before)
    assert share < 0.2  # echoes are a few passages, not the prompt
