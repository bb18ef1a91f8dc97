"""What the benchmark sends: groups of donor and target prompts, built from real text with a
fixed seed, sized to a context length.

Each ``BenchRequest`` has a ``group`` and a ``role``: within a group the donors are sent first
(they become the server's donors), then each target is measured cold and through the connector.
A group with no donor measures misses (``negative``).

* ``cross-instruction``: one document under two different instruction templates;
* ``rag-reorder``: the same retrieved passages in another order, another header and question;
* ``rag-qa``: the same retrieved passages (fact extracts among others) in another order, another
  header, and a question one of the passages answers (``answer``);
* ``doc-qa``: the same passages behind different questions whose answers they state (``answer``);
* ``entity-swap``: the same passages with some names, years or counts changed, asked for a changed
  one (``answer``, and the donor's value ``donor_answer``: a served answer giving the donor's
  value is the donor's text leaking into the target's);
* ``chat-instruction``: one document under two different instructions in chat turns (the model's
  chat template when the tokenizer has one);
* ``edit``: a document with 10-90% of its sentences removed or replaced by other documents'
  (SemShareKV's sweep; ``level``);
* ``multi-turn``: ShareGPT conversations turn by turn (each turn's prompt holds the ones before);
* ``negative``: unrelated documents, no donor;
* a user's JSONL file: ``{"prompt", "group", "role": "donor"|"target", "answer"?,
  "reference"?, "donor_answer"?}`` per line.

Targets carry a ``reference`` where one exists: text the prompt should make likely, whose
perplexity after the prompt is measured cold and after a hit. Documents: the source text that
follows the document (kept out of the prompt); doc-qa, rag-qa, entity-swap: the answer, then the
sentence of its passage that states it (``pairs.fact_reference``: read from the prompt, so it
scores whether the served KV still reads that passage; the answer alone is too few tokens for a
ratio); multi-turn: the reply the assistant really gave in ShareGPT. rag-reorder has none (its
questions have no reference answer).

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

WORKLOADS = (
    "cross-instruction",
    "chat-instruction",
    "rag-reorder",
    "rag-qa",
    "doc-qa",
    "entity-swap",
    "edit",
    "multi-turn",
    "negative",
)
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
    donor_answer: str | None = None  # entity-swap: the value the donor's text gave instead


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


def build_within(
    name: str, groups: int, tokens: int, sizer: Sizer, seed: int, limit: int | None
) -> tuple[list[BenchRequest], int]:
    """``build``, at a smaller size where a request would not fit ``limit`` tokens (the
    server's context less the output; a scored reference counts with its prompt): the requests
    and the size they were built at. Near a model's context limit (SmolLM2's 8,192) a
    workload's instructions, questions and passages would otherwise push prompts past it."""
    size = tokens
    for _ in range(4):
        requests = build(name, groups, size, sizer, seed)
        longest = max(sizer.count(r.prompt + (r.reference or "")) for r in requests)
        if limit is None or longest <= limit:
            return requests, size
        size -= longest - limit + 8  # (a re-cut can land a few tokens long)
        if size < 64:
            break
    raise WorkloadError(f"{name} does not fit {limit} tokens at ~{tokens}")


def build(name: str, groups: int, tokens: int, sizer: Sizer, seed: int = 0) -> list[BenchRequest]:
    """``groups`` groups of workload ``name`` at about ``tokens`` prompt tokens."""
    if name not in _BUILDERS:
        raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return _BUILDERS[name](groups, tokens, sizer, random.Random(f"{name}/{seed}/{tokens}"))


def longest(requests: list[BenchRequest], sizer: Sizer) -> int:
    """Tokens of the longest request, a scored reference counted with its prompt."""
    return max((sizer.count(r.prompt + (r.reference or "")) for r in requests), default=0)


def check_fit(requests: list[BenchRequest], sizer: Sizer, limit: int | None) -> None:
    """Name the first request longer than ``limit`` tokens (the server's context less the
    output): the server would refuse it, and every request like it, with a bare HTTP 400."""
    for r in requests if limit else ():
        tokens = sizer.count(r.prompt + (r.reference or ""))
        if tokens > limit:
            raise WorkloadError(
                f"a {r.role} of group {r.group!r} has {tokens} tokens; the server takes at most "
                f"{limit} (its context less --max-tokens): shorten it, or serve a longer context"
            )


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
            texts = {key: item.get(key) for key in ("answer", "reference", "donor_answer")}
            for key, value in texts.items():
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"'{key}' must be a non-empty string")
            if texts["donor_answer"] is not None and texts["answer"] is None:
                raise ValueError(
                    "'donor_answer' needs an 'answer' (the value it is checked against)"
                )
            out.append(
                BenchRequest(
                    "file",
                    str(item.get("group", f"line-{number}")),
                    role,
                    prompt,
                    texts["answer"],
                    reference=texts["reference"],
                    donor_answer=texts["donor_answer"],
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
            BenchRequest(
                "doc-qa", group, "target", P.fact_prompt(doc, q), a, reference=P.fact_reference(q)
            )
            for q, a in rest
        ]
    return out


# ---- passages around facts (rag-qa, entity-swap) -------------------------------------------------
PASSAGE_TOKENS = 160  # longest padding passage: a retriever's chunk, so small contexts hold several
PASSAGE_OVERHEAD = 6  # tokens a passage adds beyond its title and body ("[12] ", line breaks)
FACT_SHARE = 0.6  # most of a context the fact passages may fill (the rest is other passages)
MAX_QUESTIONS = 3  # targets per group


def _fact_questions(g: int, tokens: int, sizer: Sizer) -> list[tuple[str, str]]:
    """Group ``g``'s questions (each group starts at another one), as many as fit: the first
    always, the next while their passages stay within ``FACT_SHARE`` of the context."""
    facts = P.fact_passages()
    k = g % len(P.FACT_VALUE_QUESTIONS)
    rotated = P.FACT_VALUE_QUESTIONS[k:] + P.FACT_VALUE_QUESTIONS[:k]
    chosen, titles = [rotated[0]], {P.fact_title(rotated[0][0])}
    for question, answer in rotated[1:]:
        if len(chosen) == MAX_QUESTIONS:
            break
        more = titles | {P.fact_title(question)}
        if sum(sizer.count(facts[t]) for t in more) <= FACT_SHARE * tokens:
            chosen.append((question, answer))
            titles = more
    return chosen


def _fact_bundle(questions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The fact passages the questions ask about, each once."""
    facts = P.fact_passages()
    titles = dict.fromkeys(P.fact_title(q) for q, _ in questions)
    return [(title, facts[title]) for title in titles]


def _padding(
    rng: random.Random, budget: int, sizer: Sizer, avoid: tuple[str, ...]
) -> list[tuple[str, str]]:
    """Other wiki extracts, each cut to ``PASSAGE_TOKENS``, filling about ``budget`` tokens. None
    is a fact passage or holds a string of ``avoid``: the answers stay where they were put."""
    extracts = wiki_extracts()
    out: list[tuple[str, str]] = []
    left = budget
    while True:
        title, body = extracts[rng.randrange(len(extracts))]
        if title in P.FACT_TITLES or any(a in title or a in body for a in avoid):
            continue
        room = left - PASSAGE_OVERHEAD - sizer.count(title)
        if room < 16:  # too little left for a passage worth reading
            return out
        body = sizer.cut(body, min(PASSAGE_TOKENS, room))
        out.append((title, body))
        left -= sizer.count(title + "\n" + body) + PASSAGE_OVERHEAD


def _rag_qa(groups, tokens, sizer, rng):
    """Fact passages among other wiki extracts; the donor has them in one order under a RAG
    header and a general question, each target in another order under another header, asking a
    question one fact passage answers (before and after the passages, as ``fact_prompt`` does)."""
    out = []
    for g in range(groups):
        questions = _fact_questions(g, tokens, sizer)
        facts = _fact_bundle(questions)
        # the plain headers: in a chat turn SmolLM2-135M got every fact question wrong (pairs.py)
        header = rng.choice(P.TARGET_HEADERS[1:])
        longest = max((q for q, _ in questions), key=sizer.count)
        fixed = sizer.count(_rag_question(header, P.passages(facts), longest))
        bundle = facts + _padding(rng, tokens - fixed, sizer, avoid=())
        if len(bundle) < 2:
            raise WorkloadError(
                f"rag-qa: {tokens} tokens hold one passage, nothing to reorder (ask for 512+)"
            )
        rng.shuffle(bundle)
        reordered = bundle[:]
        while reordered == bundle:
            rng.shuffle(reordered)
        group = f"rag-qa-{g}"
        donor = (
            rng.choice(P.DONOR_HEADERS)
            + P.passages(bundle)
            + "\n\n"
            + rng.choice(P.DONOR_QUESTIONS)
        )
        out.append(BenchRequest("rag-qa", group, "donor", donor))
        out += [
            BenchRequest(
                "rag-qa",
                group,
                "target",
                _rag_question(header, P.passages(reordered), question),
                answer,
                reference=P.fact_reference(question),
            )
            for question, answer in questions
        ]
    return out


def _rag_question(header: str, passages: str, question: str) -> str:
    return f"{header}Question: {question}\n\n{passages}\n\nQuestion: {question}\nShort answer:"


# Surnames a swapped name becomes: common enough to read as names, tied to none of the facts.
SWAP_SURNAMES = ("Halloway", "Brandt", "Lindqvist", "Castellano", "Thorncroft", "Ashdown")
SWAP_OTHERS = 2  # values changed beside the asked one


def _entity_swap(groups, tokens, sizer, rng):
    """Fact passages among other wiki extracts, asked a question whose answer is one value; each
    target is the donor's text with that value changed everywhere (and up to ``SWAP_OTHERS`` of
    the group's other asked values), asking for it. Donor and target differ only in those values
    (and the question), so a hit serves the target nearly all of the donor's KV: a served answer
    that gives the donor's value is the donor's text leaking through."""
    out = []
    for g in range(groups):
        questions = _fact_questions(g, tokens, sizer)
        facts = _fact_bundle(questions)
        values = tuple(answer for _, answer in questions)
        longest = max((q for q, _ in questions), key=sizer.count)
        fixed = sizer.count(P.fact_prompt(_plain_passages(facts), longest))
        bundle = facts + _padding(rng, tokens - fixed, sizer, avoid=values)
        rng.shuffle(bundle)
        document = _plain_passages(bundle)
        donor = P.fact_prompt(document, questions[0][0])
        changed = _new_values(values, donor, rng)
        group = f"entity-swap-{g}"
        out.append(BenchRequest("entity-swap", group, "donor", donor))
        for question, answer in questions:
            others = [v for v in values if v != answer]
            swapped = [answer] + rng.sample(others, min(SWAP_OTHERS, len(others)))
            target_doc = document
            for value in swapped:
                target_doc = target_doc.replace(value, changed[value])
            out.append(
                BenchRequest(
                    "entity-swap",
                    group,
                    "target",
                    P.fact_prompt(target_doc, question),
                    changed[answer],
                    reference=P.fact_reference(question, {v: changed[v] for v in swapped}),
                    donor_answer=answer,
                )
            )
    return out


def _plain_passages(bundle: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"{title}\n{body}" for title, body in bundle)


def _new_values(values: tuple[str, ...], donor: str, rng: random.Random) -> dict[str, str]:
    """Another value of the same kind for each one (a year a few years off, a count of as many
    digits, another surname), found nowhere in the donor's prompt and neither holding nor held by
    any other value, old or new: substring checks of answers then tell them apart."""
    out: dict[str, str] = {}
    for value in values:
        while True:
            if value.isdigit() and len(value) == 4:
                new = str(int(value) + rng.choice([d for d in range(-40, 41) if abs(d) >= 3]))
            elif value.isdigit():
                new = str(rng.randrange(10 ** (len(value) - 1), 10 ** len(value)))
            else:
                new = rng.choice(SWAP_SURNAMES)
            taken = values + tuple(out.values())
            if new not in donor and not any(new in t or t in new for t in taken):
                out[value] = new
                break
    return out


# ---- chat turns (chat-instruction) ------------------------------------------------------------
# (system message, instruction, whether the instruction comes before the document): the donor
# and target sides share none, so the two prompts differ in every turn around the document.
CHAT_DONOR_TURNS = (
    ("You are a concise assistant.", "Summarize the following article in three sentences.", True),
    ("You are an editor at a newspaper.", "Suggest a headline for this text.", False),
)
CHAT_TARGET_TURNS = (
    ("You are a careful fact-checker.", "List every date and number this text mentions.", False),
    ("You answer questions for students.", "Explain the text below to a twelve-year-old.", True),
)


def _chat_turns(sizer: Sizer, system: str, user: str) -> str:
    """A system and a user turn, ending where the assistant answers: in the tokenizer's own chat
    template when it has one (what a chat client sends), else in a plain format."""
    tok = sizer.tok
    if tok is not None and getattr(tok, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"System: {system}\n\nUser: {user}\n\nAssistant:"


def _chat_prompt(sizer: Sizer, turns: tuple[str, str, bool], doc: str) -> str:
    system, instruction, before = turns
    user = f"{instruction}\n\n{doc}" if before else f"{doc}\n\n{instruction}"
    return _chat_turns(sizer, system, user)


def _chat_instruction(groups, tokens, sizer, rng):
    out = []
    for g in range(groups):
        donor_turns = rng.choice(CHAT_DONOR_TURNS)
        target_turns = rng.choice(CHAT_TARGET_TURNS)
        wrapping = max(sizer.count(_chat_prompt(sizer, t, "")) for t in (donor_turns, target_turns))
        doc, following = _document(rng, max(tokens - wrapping, 32), sizer)
        group = f"chat-instruction-{g}"
        out += [
            BenchRequest("chat-instruction", group, "donor", _chat_prompt(sizer, donor_turns, doc)),
            BenchRequest(
                "chat-instruction",
                group,
                "target",
                _chat_prompt(sizer, target_turns, doc),
                reference=following,
            ),
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
    "chat-instruction": _chat_instruction,
    "rag-reorder": _rag_reorder,
    "rag-qa": _rag_qa,
    "doc-qa": _doc_qa,
    "entity-swap": _entity_swap,
    "edit": _edit,
    "multi-turn": _multi_turn,
    "negative": _negative,
}
