"""The alignment stages after the exact runs (edit, sentence, LSH), the input-embedding table,
and the whole pipeline on real donor/target pairs tokenised with the served model's tokenizer."""

import random

import numpy as np
import pytest
import torch
from support.safetensors_versions import run_as_version
from support.tokens import random_ids as tokens

from semshare_vllm.alignment import (
    AlignParams,
    DonorFeatures,
    EmbeddingTable,
    EmbeddingUnavailable,
    LshParams,
    MatchKind,
    SentenceSplitter,
    align,
    lsh_similarity,
)
from semshare_vllm.alignment.exact_runs import align_exact
from semshare_vllm.alignment.lsh import lsh_codes, rope_rotate
from semshare_vllm.config import SemShareConfig, SemShareConfigError
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.models import smollm2, smollm2_tokenizer

EDIT_ONLY = AlignParams(stages=("exact", "edit"))


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def table():
    return EmbeddingTable.load(smollm2())


@pytest.fixture(scope="module")
def splitter(tok):
    return SentenceSplitter.from_tokenizer(tok)


def check_consistent(al, target, donor):
    t, d = np.asarray(target), np.asarray(donor)
    aligned = al.donor_pos >= 0
    assert (al.donor_pos < len(d)).all()
    assert np.array_equal(aligned, al.kind != MatchKind.NONE)
    same = np.zeros(len(t), dtype=bool)
    same[aligned] = t[aligned] == d[al.donor_pos[aligned]]
    assert np.array_equal(al.kind == MatchKind.EXACT, same)  # EXACT means the same token
    assert sum(al.stage_counts.values()) == aligned.sum()
    for run in al.runs:
        span = slice(run.target_start, run.target_start + run.length)
        assert np.array_equal(t[span], d[run.donor_start : run.donor_start + run.length])


# ---- edit stage --------------------------------------------------------------------------------
def test_edit_stage_fills_the_gaps_of_a_lightly_edited_document():
    donor = tokens(400, 1)
    target = donor.copy()
    target[5::9] = tokens(len(target[5::9]), 2)  # a replaced token every 9: no 16-run
    assert align_exact(target, donor).coverage == 0.0
    al = align(target, donor, EDIT_ONLY)
    check_consistent(al, target, donor)
    assert np.array_equal(al.donor_pos, np.arange(400))  # everything in place
    assert al.fuzzy_coverage == pytest.approx(len(target[5::9]) / 400)
    assert al.stage_counts == {"exact": 0, "edit": 400}
    assert al.num_runs == len(target[5::9]) + 1  # the equal pieces between edits


def test_edit_stage_aligns_inserted_and_deleted_words_between_runs():
    a, b, c = tokens(100, 3), tokens(30, 4), tokens(100, 5)
    donor = np.r_[a, b, c]
    edited_b = np.r_[b[:10], tokens(3, 6), b[10:20], b[24:]]  # 3 inserted, 4 deleted
    target = np.r_[a, edited_b, c]
    al = align(target, donor, EDIT_ONLY)
    check_consistent(al, target, donor)
    gap = al.donor_pos[100 : 100 + len(edited_b)]
    assert np.array_equal(gap[:10], 100 + np.arange(10))  # equal pieces land in place
    assert np.array_equal(gap[-6:], 124 + np.arange(6))
    assert al.coverage > 0.98


def test_edit_precheck_leaves_unrelated_gaps_alone():
    a, c = tokens(100, 7), tokens(100, 8)
    donor = np.r_[a, tokens(40, 9), c]
    target = np.r_[a, tokens(40, 10), c]  # the middle shares nothing
    al = align(target, donor, EDIT_ONLY)
    assert (al.donor_pos[100:140] == -1).all()
    loose = align(target, donor, AlignParams(stages=("exact", "edit"), edit_min_similarity=0.0))
    assert (loose.donor_pos[100:140] >= 0).all()  # without the pre-check: mapped
    check_consistent(loose, target, donor)


# ---- sentences ---------------------------------------------------------------------------------
def test_splitter_finds_sentence_ends_in_the_vocabulary(tok, splitter):
    text = "The cat sat. It was warm!\nWhy? Because the sun was out."
    ids = np.asarray(tok(text)["input_ids"])
    starts = splitter.starts(ids)
    pieces = [tok.decode(ids[a:b]) for a, b in zip(starts, np.r_[starts[1:], len(ids)])]
    assert [p.strip() for p in pieces] == [
        "The cat sat.",
        "It was warm!",
        "Why?",
        "Because the sun was out.",
    ]


def test_runs_are_cut_where_they_spill_into_the_next_sentence():
    end = 5
    splitter = SentenceSplitter([end])
    s1, s2 = tokens(40, 11), tokens(30, 12)
    s1[-1] = end
    donor = np.r_[s1, s2[:3], tokens(30, 13)]  # the next sentence starts alike
    target = np.r_[tokens(5, 14), s1, s2]
    plain = align_exact(target, donor)
    assert plain.runs[0].length == 43  # s1 and 3 tokens of s2
    snapped = align(target, donor, AlignParams(stages=("exact",)), splitter=splitter)
    assert snapped.runs[0].length == 40  # s1 only
    check_consistent(snapped, target, donor)


def test_sentence_stage_pairs_moved_and_reworded_sentences(tok, table, splitter):
    doc = P.Sources(3).wiki_doc(min_chars=1500)
    sentences = P.split_sentences(doc)
    rng = random.Random(0)
    words = "river mountain quickly ancient station harbour music engine".split()
    reworded = [P.reword_document(s, 0.15, rng, words) for s in sentences]
    order = list(range(len(sentences)))
    rng.shuffle(order)
    donor = np.asarray(tok(" ".join(sentences))["input_ids"])
    target = np.asarray(tok(" ".join(reworded[i] for i in order))["input_ids"])
    params = AlignParams(stages=("exact", "edit", "sentence"))
    without = align(target, donor, AlignParams(stages=("exact", "edit")), table, splitter)
    al = align(target, donor, params, table, splitter)
    check_consistent(al, target, donor)
    assert al.stage_counts.get("sentence", 0) > 0.2 * len(target)
    assert al.coverage > without.coverage + 0.2
    # each target sentence's tokens come from the donor sentence it was made from
    d_starts = splitter.starts(donor)
    t_starts = splitter.starts(target)
    hits = total = 0
    for a, b in zip(t_starts, np.r_[t_starts[1:], len(target)]):
        src = np.searchsorted(d_starts, al.donor_pos[a:b][al.donor_pos[a:b] >= 0], "right") - 1
        if len(src):
            hits += np.bincount(src).max()
            total += len(src)
    assert hits / total > 0.9


# ---- LSH ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_rotation_is_relative(style):
    x = torch.randn(2, 64)
    rot = lambda v, p: rope_rotate(v, np.array([p]), 1e4, style)[0]  # noqa: E731
    assert torch.allclose(rot(x[:1], 0), x[0])
    assert torch.allclose(rot(x[:1], 37).norm(), x[0].norm())
    # <R(p) x, R(q) y> depends on q - p only: what makes position part of the match
    assert torch.allclose(
        rot(x[:1], 10) @ rot(x[1:], 25), rot(x[:1], 110) @ rot(x[1:], 125), atol=1e-4
    )


def test_lsh_maps_an_identical_prompt_onto_itself(tok, table):
    ids = np.asarray(tok(P.Sources(4).wiki_doc())["input_ids"])
    al = align(ids, ids, AlignParams(stages=("lsh",)), table)
    assert np.array_equal(al.donor_pos, np.arange(len(ids)))
    assert al.stage_counts == {"lsh": len(ids)}


def test_lsh_similarity_falls_as_text_is_reworded(tok, table):
    sources = P.Sources(5)
    doc, other = sources.wiki_doc(), sources.wiki_doc()
    donor = tok(doc)["input_ids"]
    words = other.split()
    scores = [
        lsh_similarity(
            table, tok(P.reword_document(doc, lvl, random.Random(1), words))["input_ids"], donor
        )
        for lvl in (0.0, 0.2, 0.5)
    ]
    unrelated = lsh_similarity(table, tok(other)["input_ids"], donor)
    assert scores[0] == 1.0
    assert scores[0] > scores[1] > scores[2] > unrelated


def test_lsh_candidates_break_ties_by_the_predicted_position(table):
    x = 1234
    donor = np.r_[tokens(10, 20), [x], tokens(39, 21), [x], tokens(20, 22)]  # x at 10 and 50
    target = np.r_[tokens(2, 23), donor[:48], [x], donor[51:]]  # offset +2
    target[2 + 10] = 999  # the early x is not in the target
    lsh = LshParams(rope_style="none", candidates=4, max_distance=0.0)
    al = align(target, donor, AlignParams(stages=("exact", "lsh"), lsh=lsh), table)
    assert al.donor_pos[50] == 50 and al.kind[50] == MatchKind.EXACT
    check_consistent(al, target, donor)


def test_lsh_distance_cap_and_codes(table):
    params = LshParams(bits=16, tables=3)
    codes = lsh_codes(table, np.arange(100, 140), np.arange(40), params)
    assert codes.shape == (40, 6) and codes.dtype == np.uint8
    donor, target = tokens(200, 30), tokens(200, 31)
    strict = align(
        target, donor, AlignParams(stages=("lsh",), lsh=LshParams(max_distance=0.05)), table
    )
    loose = align(
        target, donor, AlignParams(stages=("lsh",), lsh=LshParams(max_distance=1.0)), table
    )
    assert loose.coverage == 1.0 and strict.coverage < 0.2
    check_consistent(strict, target, donor)
    with pytest.raises(ValueError, match="multiple of 8"):
        LshParams(bits=5, tables=1)


def test_kept_donor_features_give_the_same_alignment(tok, table, splitter):
    pairs, _ = P.build(1, seed=2)
    pair = next(p for p in pairs if p.kind == "edited" and p.level == 0.5)
    t, d = tok(pair.target)["input_ids"], tok(pair.donor)["input_ids"]
    kept = DonorFeatures(d, table, splitter).warm()
    a = align(t, d, AlignParams(), table, splitter)
    b = align(t, kept, AlignParams(), table, splitter)
    assert np.array_equal(a.donor_pos, b.donor_pos) and a.stage_counts == b.stage_counts
    with pytest.raises(ValueError, match="other LSH parameters"):
        align(t, kept, AlignParams(lsh=LshParams(bits=64)), table, splitter)


# ---- the embedding table -----------------------------------------------------------------------
def test_embedding_table_reads_only_the_embedding(table):
    assert table.vectors.shape == (49152, 576) and not table.sketched
    assert table.rope_base == 100000.0
    sketch = EmbeddingTable.load(smollm2(), sketch_dim=128)
    assert sketch.vectors.shape == (49152, 128) and sketch.sketched
    ids = np.random.default_rng(0).integers(0, 49152, (300, 2))

    def cosines(v):
        a, b = v[ids[:, 0]], v[ids[:, 1]]
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    assert np.corrcoef(cosines(table.vectors), cosines(sketch.vectors))[0, 1] > 0.8


def test_embedding_table_bf16_and_missing(tmp_path):
    from safetensors.torch import save_file

    weight = torch.randn(50, 8)
    save_file(
        {
            "model.embed_tokens.weight": weight.to(torch.bfloat16),
            "model.norm.weight": torch.ones(8),
        },
        str(tmp_path / "model.safetensors"),
    )
    t = EmbeddingTable.load(tmp_path)
    assert np.allclose(t.vectors, weight.to(torch.bfloat16).float().numpy())
    assert t.rope_base == 10000.0  # no config.json: the common default
    with pytest.raises(EmbeddingUnavailable):
        EmbeddingTable.load(tmp_path / "nowhere")


# ---- config ------------------------------------------------------------------------------------
def test_alignment_config_keys():
    cfg = SemShareConfig.from_extra_config(
        {"align_stages": "exact, lsh", "lsh_bits": 16, "lsh_tables": 4, "lsh_rope_base": 500000.0},
        environ={},
    )
    params = AlignParams.from_config(cfg)
    assert params.stages == ("exact", "lsh") and params.lsh.total_bits == 64
    assert params.lsh.rope_base == 500000.0
    assert AlignParams.from_config(SemShareConfig()) == AlignParams()
    with pytest.raises(SemShareConfigError, match="align_stages"):
        SemShareConfig.from_extra_config({"align_stages": "exact,fuzzy"}, environ={})
    with pytest.raises(SemShareConfigError, match="lsh_bits"):
        SemShareConfig.from_extra_config({"lsh_bits": 5, "lsh_tables": 1}, environ={})


def test_lsh_params_built_directly_obey_the_config_rules():
    # one rule (config.alignment.check_lsh) for the config's keys and for LshParams
    with pytest.raises(SemShareConfigError, match="lsh_bits"):
        LshParams(bits=5, tables=1)
    with pytest.raises(SemShareConfigError, match="lsh_rope_style"):
        LshParams(rope_style="alibi")


# ---- real pairs --------------------------------------------------------------------------------
def test_real_pairs(tok, table, splitter):
    """Cross-instruction, reordered and edited pairs of real text: the pipeline is consistent,
    never aligns less than the exact stage, and covers what each scenario shares."""
    pairs, _ = P.build(2, seed=1)
    coverage: dict[str, list[float]] = {}
    for pair in pairs:
        t, d = tok(pair.target)["input_ids"], tok(pair.donor)["input_ids"]
        al = align(t, d, AlignParams(), table, splitter)
        check_consistent(al, t, d)
        assert al.coverage >= align_exact(t, d).coverage
        coverage.setdefault(P.group_of(pair), []).append(al.coverage)
    assert min(coverage["cross-instruction"]) > 0.9
    assert min(coverage["reordered"]) > 0.9
    assert min(coverage["edited@0.1"]) > 0.9


def test_rope_far_positions_match_the_kept_table():
    from semshare_vllm.alignment import lsh

    x = torch.randn(3, 32)
    far = np.array([5, 40_000, 70_000])
    got = rope_rotate(x, far, 1e4)  # beyond the kept table
    angle = torch.from_numpy(far.astype(np.float64))[:, None] * lsh._inv_freq(1e4, 32)
    a, b = x[:, :16].double(), x[:, 16:].double()
    want = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], 1)
    assert torch.allclose(got.double(), want, atol=1e-5)
    near = rope_rotate(x[:1], np.array([5]), 1e4)  # the kept table gives the same
    assert torch.allclose(near, got[:1], atol=1e-6)


_REWRITTEN_CHECKPOINT = """
from pathlib import Path
import numpy as np, torch
from safetensors.torch import save_file
from semshare_vllm.alignment import EmbeddingTable

root = Path(sys.argv[1])
path = root / "model.safetensors"
save_file({"model.embed_tokens.weight": torch.randn(4096, 64)}, str(path))
table = EmbeddingTable.load(root)
before = table.rows(np.arange(4096)).copy()
open(path, "wb").close()  # a trainer starts writing new weights over it
assert np.array_equal(table.rows(np.arange(4096)), before)
print("whole")
"""


@pytest.mark.parametrize("safetensors_version", ["0.8", "before-0.8"])
def test_a_checkpoint_rewritten_in_place_leaves_the_table_whole(tmp_path, safetensors_version):
    """Training loops write new weights over the served checkpoint, then ``reload_weights``. The
    table was a view of the file's memory map (safetensors maps what it reads): the file cut
    short, the next alignment died of SIGBUS, and the engine core with it (the likely cause of a
    CI run's engine core dying in the weight-reload serve test). Run in a child process, as the
    failure is a signal."""
    rc, out, err = run_as_version(_REWRITTEN_CHECKPOINT, tmp_path, safetensors_version)
    assert rc == 0 and out == "whole", (rc, err)


def test_short_lines_do_not_make_the_sentence_stage_quadratic_in_memory():
    """Prompts of short lines (logs, CSV rows, number lists) are thousands of "sentences" a
    side; the stage compared every target sentence with every donor sentence at once (review:
    a 2 GiB peak on the lookup thread at 32K tokens, ~30 GB projected at 128K). Past
    SENTENCE_MAX_PAIRS the stage is skipped (the exact and edit stages still align)."""
    import tracemalloc

    from semshare_vllm.alignment import sentences

    rng = np.random.default_rng(0)
    small = EmbeddingTable(rng.standard_normal((1000, 64)).astype(np.float32), False, 10000.0)
    n = 16_384  # 8,192 one-token lines a side ("<token>\n": token 0 ends each)
    target = np.stack([rng.integers(1, 1000, n // 2), np.zeros(n // 2, int)], 1).ravel()
    donor = np.stack([rng.integers(1, 1000, n // 2), np.zeros(n // 2, int)], 1).ravel()
    assert (n // 2) ** 2 > sentences.SENTENCE_MAX_PAIRS
    tracemalloc.start()
    al = align(
        target,
        donor,
        AlignParams(stages=("exact", "edit", "sentence")),
        small,
        SentenceSplitter([0]),
    )
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert al.stage_counts.get("sentence", 0) == 0
    assert peak < 100 * 2**20, peak
