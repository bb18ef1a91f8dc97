"""What the benchmark sends: groups of donor and target prompts, built from real text with a
fixed seed, sized to a context length.

Each ``BenchRequest`` has a ``group`` and a ``role``: within a group the donors are sent first
(they become the server's donors), then each target is measured cold and through the connector.
A group with no donor measures misses (``negative``).

* ``cross-instruction``: one document under two different instruction templates;
* ``rag-reorder``: the same retrieved passages in another order, another header and question;
* ``doc-qa``: the same passages behind different questions whose answers they state (``answer``);
* ``edit``: a document with 10-90% of its sentences removed or replaced by other documents'
  (SemShareKV's sweep; ``level``);
* ``multi-turn``: ShareGPT conversations turn by turn (each turn's prompt holds the ones before);
* ``negative``: unrelated documents, no donor;
* a user's JSONL file: ``{"prompt", "group", "role": "donor"|"target", "answer"?,
  "reference"?}`` per line.

Targets carry a ``reference`` where one exists: held-out text the prompt should make likely,
whose perplexity after the prompt is measured cold and after a hit. Documents: the source text
that follows the document (kept out of the prompt); doc-qa: the answer; multi-turn: the reply the
assistant really gave in ShareGPT. rag-reorder has none (its questions have no reference answer).

Context length is in tokens of ``tokenizer`` when given, else estimated at 4 characters a token.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.text import sharegpt_conversations, wiki_document, wiki_extracts

WORKLOADS = ("cross-instruction", "rag-reorder", "doc-qa", "edit", "multi-turn", "negative")
EDIT_LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)
CHARS_PER_TOKEN = 4
REFERENCE_TOKENS = 48  # length of a held-out continuation


class WorkloadError(ValueError):
    """A workload that cannot be built (unknown name, malformed file line)."""


@dataclass(frozen=True)
class BenchRequest:
    workload: str
    group: str
    role: str  # "donor" or "target"
    prompt: str
    answer: str | None = None  # doc-qa: text the answer must contain
    level: float | None = None  # edit: share of sentences changed
    reference: str | None = None  # held-out text scored after the prompt (perplexity)


class Sizer:
    """Cuts text to a number of tokens (of the served model's tokenizer when known)."""

    def __init__(self, tokenizer=None):
        self.tok = tokenizer

    def cut(self, text: str, tokens: int) -> str:
        if self.tok is None:
            return text[: tokens * CHARS_PER_TOKEN]
        ids = self.tok(text, add_special_tokens=False)["input_ids"][:tokens]
        return self.tok.decode(ids)

    def split(self, text: str, tokens: int, more: int) -> tuple[str, str]:
        """The first ``tokens`` tokens of ``text`` and the ``more`` tokens after them."""
        if self.tok is None:
            cut = tokens * CHARS_PER_TOKEN
            return text[:cut], text[cut : cut + more * CHARS_PER_TOKEN]
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return self.tok.decode(ids[:tokens]), self.tok.decode(ids[tokens : tokens + more])

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text) // CHARS_PER_TOKEN
        return len(self.tok(text, add_special_tokens=False)["input_ids"])


def build(name: str, groups: int, tokens: int, sizer: Sizer, seed: int = 0) -> list[BenchRequest]:
    """``groups`` groups of workload ``name`` at about ``tokens`` prompt tokens."""
    if name not in _BUILDERS:
        raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return _BUILDERS[name](groups, tokens, sizer, random.Random(f"{name}/{seed}/{tokens}"))


def load_file(path: str | Path) -> list[BenchRequest]:
    """A user's JSONL workload; every malformed line is named."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            prompt, role = item["prompt"], item.get("role", "target")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("'prompt' must be a non-empty string")
            if role not in ("donor", "target"):
                raise ValueError(f'\'role\' must be "donor" or "target", not {role!r}')
            answer, reference = item.get("answer"), item.get("reference")
            for key, value in (("answer", answer), ("reference", reference)):
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"'{key}' must be a non-empty string")
            out.append(
                BenchRequest(
                    "file",
                    str(item.get("group", f"line-{number}")),
                    role,
                    prompt,
                    answer,
                    reference=reference,
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise WorkloadError(f"{path}, line {number}: {reason}") from None
    if not out:
        raise WorkloadError(f"{path}: no requests")
    return out


# ---- builders ------------------------------------------------------------------------------------
def _document(rng: random.Random, tokens: int, sizer: Sizer) -> tuple[str, str]:
    """A document of ``tokens`` tokens, and the source text that follows it (the reference)."""
    start = rng.randrange(len(wiki_extracts()))
    source = wiki_document(start, (tokens + REFERENCE_TOKENS) * CHARS_PER_TOKEN * 2)
    return sizer.split(source, tokens, REFERENCE_TOKENS)


def _cross_instruction(groups, tokens, sizer, rng):
    out = []
    for g in range(groups):
        doc, following = _document(rng, tokens, sizer)
        group = f"cross-instruction-{g}"
        out += [
            BenchRequest(
                "cross-instruction", group, "donor", P.wrap(rng.choice(P.DONOR_TEMPLATES), doc)
            ),
            BenchRequest(
                "cross-instruction",
                group,
                "target",
                P.wrap(rng.choice(P.TARGET_TEMPLATES), doc),
                reference=following,
            ),
        ]
    return out


def _passages_of(rng, tokens, sizer) -> list[tuple[str, str]]:
    extracts = wiki_extracts()
    bundle, size = [], 0
    while size < tokens or len(bundle) < 3:
        title, body = extracts[rng.randrange(len(extracts))]
        bundle.append((title, body))
        size += sizer.count(title + body)
    return bundle


def _rag_reorder(groups, tokens, sizer, rng):
    out = []
    for g in range(groups):
        bundle = _passages_of(rng, tokens, sizer)
        permuted = bundle[:]
        while permuted == bundle:
            rng.shuffle(permuted)
        group = f"rag-reorder-{g}"
        out += [
            BenchRequest(
                "rag-reorder",
                group,
                "donor",
                rng.choice(P.DONOR_HEADERS)
                + P.passages(bundle)
                + "\n\n"
                + rng.choice(P.DONOR_QUESTIONS),
            ),
            BenchRequest(
                "rag-reorder",
                group,
                "target",
                rng.choice(P.TARGET_HEADERS)
                + P.passages(permuted)
                + "\n\n"
                + rng.choice(P.TARGET_QUESTIONS),
            ),
        ]
    return out


def _doc_qa(groups, tokens, sizer, rng):
    """The fact passages (about 1,270 tokens) followed by other extracts up to the context length,
    at least 128 tokens of them so that groups differ (after the facts, where the model reads them
    best); each group's donor asks another question first."""
    out = []
    facts = P.fact_document()
    for g in range(groups):
        pad = max(tokens - sizer.count(facts) - 40, 128)
        doc = facts + "\n\n" + _document(rng, pad, sizer)[0]
        group = f"doc-qa-{g}"
        questions = (
            P.FACT_QUESTIONS[g % len(P.FACT_QUESTIONS) :]
            + P.FACT_QUESTIONS[: g % len(P.FACT_QUESTIONS)]
        )  # each group asks another first
        (q0, a0), *rest = questions
        out.append(BenchRequest("doc-qa", group, "donor", P.fact_prompt(doc, q0), a0))
        out += [
            BenchRequest("doc-qa", group, "target", P.fact_prompt(doc, q), a, reference=" " + a)
            for q, a in rest
        ]
    return out


def _edit(groups, tokens, sizer, rng):
    out = []
    for g in range(groups):
        doc, following = _document(rng, tokens, sizer)
        filler = P.split_sentences(_document(rng, tokens, sizer)[0])
        template = rng.choice(P.DONOR_TEMPLATES)
        op = "delete" if g % 2 == 0 else "replace"
        group = f"edit-{g}"
        out.append(BenchRequest("edit", group, "donor", P.wrap(template, doc)))
        for level in EDIT_LEVELS:
            edited = P.edit_document(doc, level, op, rng, filler)
            out.append(
                BenchRequest(
                    "edit",
                    group,
                    "target",
                    P.wrap(template, edited),
                    level=level,
                    reference=following,
                )
            )
    return out


def _chat(turns: list[tuple[str, str]]) -> str:
    """A conversation in a plain chat format, ending where the assistant answers."""
    return (
        "".join(f"{'User' if who == 'human' else 'Assistant'}: {text}\n\n" for who, text in turns)
        + "Assistant:"
    )


def _multi_turn(groups, tokens, sizer, rng):
    out, g = [], 0
    skip = rng.randrange(2000)  # where in the corpus this seed starts looking
    for i, conv in enumerate(sharegpt_conversations(limit=skip + 4000)):
        if i < skip:
            continue
        msgs = [(m.get("from"), m.get("value", "")) for m in conv.get("conversations", [])]
        msgs = [(w, t) for w, t in msgs if w in ("human", "gpt") and t]
        humans = [i for i, (w, _) in enumerate(msgs) if w == "human"]
        # three turns or more within the context, the first long enough to be kept as a donor
        if (
            len(humans) < 3
            or sizer.count(_chat(msgs[: humans[2] + 1])) > tokens
            or sizer.count(_chat(msgs[: humans[1] + 1])) < tokens // 4
            or sizer.count(_chat(msgs[: humans[0] + 1])) < 64
        ):
            continue
        group = f"multi-turn-{g}"
        turns = [h for h in humans if sizer.count(_chat(msgs[: h + 1])) <= tokens]
        out.append(BenchRequest("multi-turn", group, "donor", _chat(msgs[: turns[0] + 1])))
        out += [
            BenchRequest(
                "multi-turn",
                group,
                "target",
                _chat(msgs[: h + 1]),
                reference=_reply(msgs, h, sizer),
            )
            for h in turns[1:]
        ]
        g += 1
        if g == groups:
            break
    if g < groups:
        raise WorkloadError(
            f"multi-turn: only {g} ShareGPT conversations of 3+ turns fit {tokens} tokens"
        )
    return out


def _reply(msgs: list[tuple[str, str]], turn: int, sizer: Sizer) -> str | None:
    """The start of the reply the assistant gave to ``turn`` (the reference), if any."""
    if turn + 1 >= len(msgs) or msgs[turn + 1][0] != "gpt":
        return None
    return " " + sizer.split(msgs[turn + 1][1], REFERENCE_TOKENS, 0)[0]


def _negative(groups, tokens, sizer, rng):
    out = []
    for g in range(groups):
        template = rng.choice(P.DONOR_TEMPLATES)
        doc, following = _document(rng, tokens, sizer)
        out.append(
            BenchRequest(
                "negative", f"negative-{g}", "target", P.wrap(template, doc), reference=following
            )
        )
    return out


_BUILDERS: dict[str, Callable] = {
    "cross-instruction": _cross_instruction,
    "rag-reorder": _rag_reorder,
    "doc-qa": _doc_qa,
    "edit": _edit,
    "multi-turn": _multi_turn,
    "negative": _negative,
}
