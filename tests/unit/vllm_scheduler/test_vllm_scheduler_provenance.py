"""Per-request provenance through vLLM's real scheduler: the dict ``request_finished`` returns
is in the request's final ``EngineCoreOutput`` that ``update_from_output`` builds, survives the
engine core's msgpack wire and vLLM's ``OutputProcessor`` into the ``RequestOutput`` (whose
``kv_transfer_params`` the OpenAI server returns); a request finishing in the step that loaded
it (max_tokens 1) gets the worker's figures of that step although vLLM finishes it before
handing the connector the step's report; when the report is not in that output, the figures
stay unknown and a late report never changes the dict vLLM sent."""

import pytest
from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput

from semshare_vllm.metadata import RepairReport, SemShareWorkerMetadata
from semshare_vllm.scheduler.provenance import KEY


def repaired(load, share=1.0) -> KVConnectorOutput:
    """The worker's output of the step that repaired ``load`` (``worker/loads.py``)."""
    figures = RepairReport(load.req_id, load.seq, share)
    return KVConnectorOutput(kv_connector_worker_meta=SemShareWorkerMetadata(repairs=[figures]))


def through_the_frontend(core, req):
    """``req``'s final output as vLLM's frontend gets it: over the engine core's msgpack wire,
    then through the ``OutputProcessor``; the ``RequestOutput``."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = EngineCoreOutputs(outputs=[core.final_output(req.request_id)])
    wire = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent))
    processor = OutputProcessor(None, log_stats=False)
    processor.add_request(
        EngineCoreRequest(
            request_id=req.request_id,
            external_req_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=1, detokenize=False),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        ),
        None,
    )
    (out,) = processor.process_outputs(wire.outputs).request_outputs
    assert out.finished
    return out


def provenance(core, req):
    return core.final_output(req.request_id).kv_transfer_params[KEY]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_provenance_reaches_the_request_output_vllm_builds(async_scheduling):
    # recompute_policy "all": exact loads are repaired too, so the worker has figures to send
    config = engine_config(
        prefix_caching=True, extra={"recompute_policy": "all"}, async_scheduling=async_scheduling
    )
    core = EngineCore(config)
    bs = core.block_size
    donor = core.add(core.request(ids(10 * bs + 5, 31), max_tokens=1))
    core.run_to_end(donor)
    nothing = provenance(core, donor)
    assert nothing["served"] == "none" and nothing["donor"] is None
    assert nothing["prompt_tokens"] == 10 * bs + 5 and nothing["vllm_cached_tokens"] == 0
    core.drain()
    core.capture(donor)
    core.scheduler.reset_prefix_cache()  # vLLM's own copy evicted: only ours is left

    # finishes in the step that loads it, the worker's figures in that step's output
    prompt = list(donor.prompt_token_ids[: 7 * bs + 3]) + ids(40, 32)
    target = core.add(core.request(prompt, max_tokens=1))
    if async_scheduling:  # the next step is scheduled before this one's output is processed
        (load,) = core.pipeline().kv_connector_metadata.loads
        core.pipeline(repaired(load))
        core.drain()
    else:
        out = core.schedule()
        (load,) = out.kv_connector_metadata.loads
        core.answer(out, repaired(load))
    assert target.is_finished() and load.policy == "all" and load.seq > 0
    got = provenance(core, target)
    assert got == {
        "version": 1,
        "served": "exact",
        "prompt_tokens": len(prompt),
        "vllm_cached_tokens": 0,
        "exact_tokens": 7 * bs,
        "semantic_tokens": 0,
        "donor": got["donor"],
        "recompute_policy": "all",
        "recompute_share": 1.0,
        "deviation_before": None,  # policy "all" measures nothing
        "deviation_after": None,
        "gate_residual": None,
        "repair_report": "received",
        "load_failed": False,
        "preemptions": 0,
        "escalations": 0,
        "declined": False,
        # the report made here names no worker times (real ones: tests/engine)
        "timings_ms": {"search": 0.0, "align": 0.0, "load": None, "recompute": None},
        "recompute_layers_ms": None,
        "recompute_whole_ms": None,
    }
    assert len(got["donor"]) == 32 and load.key.donor_id not in got["donor"]
    assert through_the_frontend(core, target).kv_transfer_params == {KEY: got}
    assert core.ours.stats.observed["served_recompute_share"] == [1.0]
    core.connector.shutdown()


def test_without_the_report_in_its_finishing_output_the_figures_stay_unknown():
    core = EngineCore(engine_config(prefix_caching=True, extra={"recompute_policy": "all"}))
    bs = core.block_size
    donor = core.add(core.request(ids(6 * bs + 5, 33), max_tokens=1))
    core.capture(donor)
    core.scheduler.reset_prefix_cache()
    prompt = list(donor.prompt_token_ids[: 5 * bs]) + ids(20, 34)
    target = core.add(core.request(prompt, max_tokens=1))
    out = core.schedule()
    (load,) = out.kv_connector_metadata.loads
    core.answer(out)  # the worker's report is not in this output
    sent = provenance(core, target)
    assert sent["served"] == "exact" and sent["repair_report"] == "missing"
    assert sent["recompute_share"] is None
    before = dict(sent)
    core.step(repaired(load))  # late: the dict vLLM sent is not written any more
    assert provenance(core, target) == before
    assert "served_recompute_share" not in core.ours.stats.observed
    core.connector.shutdown()


def test_vllms_own_prefix_cache_hit_is_reported_and_a_miss_serves_nothing():
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    first = core.add(core.request(ids(4 * bs + 5, 35), params={"semshare": "off"}))
    core.run_to_end(first)
    again = core.add(core.request(list(first.prompt_token_ids) + ids(3, 36), max_tokens=1))
    core.run_to_end(again)
    got = provenance(core, again)
    assert got["served"] == "none" and got["vllm_cached_tokens"] == 4 * bs
    assert got["recompute_share"] is None and got["repair_report"] is None
    miss = core.add(core.request(ids(3 * bs, 37), max_tokens=1))
    core.run_to_end(miss)
    assert provenance(core, miss)["vllm_cached_tokens"] == 0
    assert through_the_frontend(core, miss).kv_transfer_params[KEY]["served"] == "none"
    core.connector.shutdown()
