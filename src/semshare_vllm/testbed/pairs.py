"""Donor/target pairs built from real text.

Synthetic strings say little about what discovery finds, or what a blend of a donor into a target
gives, so every pair here comes from the real corpora of ``testbed.text`` (Wikipedia lead
extracts, the Lee news corpus):

* ``cross-instruction``: one document behind two different instruction templates / chat
  wrappers (the same context, asked different things);
* ``reordered``: 4-6 encyclopedia extracts concatenated under one RAG header as the donor, the
  same extracts permuted under another header as the target;
* ``edited``: a document with a fraction (``level``) of its sentences deleted or replaced by
  sentences of other documents of the same corpus; one donor gives one target per level;
* negatives: unrelated documents (sharing no source text with any donor) dressed in the donors'
  own templates; their true donor is absent, so any hit on them is a false donor.

Everything is drawn with a seeded ``random.Random``: the same arguments give the same pairs.
How well semantic discovery finds their donors is ``testbed.discovery_eval``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from semshare_vllm.testbed.text import lee_background, wiki_document, wiki_extracts

LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9)

# Donor-side and target-side wrappers of one document ({doc} marks it). The two sides share no
# template, so a cross-instruction pair differs in both its prefix and its suffix.
DONOR_TEMPLATES = (
    "Summarize the following article in three bullet points.\n\n{doc}",
    "Read the document below and answer the question at the end.\n\nDocument:\n{doc}\n\n"
    "Question: What are the main facts reported?",
    'You are a careful analyst. Here is a report:\n"""\n{doc}\n"""\n'
    "List every person and organisation it mentions.",
    "Context:\n{doc}\n\nUsing only the context above, write a headline for it.",
)
TARGET_TEMPLATES = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{doc}\n\n"
    "Translate the first paragraph into French.<|im_end|>\n<|im_start|>assistant\n",
    "### Instruction:\nAnswer the user's question using the passage.\n\n### Passage:\n{doc}\n\n"
    "### Question:\nWhen did these events take place?\n\n### Response:\n",
    "User: I'm pasting some text, tell me whether its tone is neutral and why.\n\n{doc}\n\n"
    "Assistant:",
    "[INST] <<SYS>>\nAnswer briefly and quote the text.\n<</SYS>>\n\n{doc}\n\n"
    "Which single sentence matters most here? [/INST]",
)
# RAG headers and closing questions around numbered passages.
DONOR_HEADERS = (
    "Answer the question using only the retrieved documents below. If they do not contain the "
    "answer, say so.\n\n",
    "You are a research assistant. The search engine returned these passages:\n\n",
    "Relevant knowledge base entries:\n\n",
    "Here are some encyclopedia excerpts that may help.\n\n",
)
TARGET_HEADERS = (
    "<|im_start|>system\nGround every claim in the sources provided.<|im_end|>\n"
    "<|im_start|>user\nSources:\n\n",
    "Below are search results. Cite them by number.\n\n",
    "Retrieved context (ranked by a different retriever):\n\n",
    "Consider the following reference material before answering.\n\n",
)
DONOR_QUESTIONS = (
    "Question: Which of these topics is the oldest?",
    "Question: What do these passages have in common?",
)
TARGET_QUESTIONS = (
    "Write a short quiz with one question per source.",
    "Which source would a beginner find most useful? Explain.",
)


@dataclass(frozen=True)
class Pair:
    kind: str  # "cross-instruction", "reordered" or "edited"
    donor: str  # the prompt already computed (its KV is cached)
    target: str  # the new prompt that should find it
    level: float | None  # fraction of sentences changed ("edited"), else None


def wrap(template: str, doc: str) -> str:
    return template.replace("{doc}", doc)  # not str.format: documents may hold braces


def group_of(pair: Pair) -> str:
    return pair.kind if pair.level is None else f"{pair.kind}@{pair.level:g}"


# ---- sentences ---------------------------------------------------------------------------------
# A sentence ends at . ! or ? (optionally closed by a quote or bracket) before whitespace and a
# capital, digit or opening quote. Crude, but it never needs a model and real prose rarely fools
# it in a way that matters here (a missed split merely makes one "sentence" longer).
_BOUNDARY = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))\s+(?=[\"'(A-Z0-9])")


def sentence_pieces(text: str) -> list[tuple[str, str]]:
    """(sentence, the whitespace after it): joining them all gives ``text`` back."""
    pieces, start = [], 0
    for m in _BOUNDARY.finditer(text):
        pieces.append((text[start : m.start()], m.group()))
        start = m.end()
    if start < len(text):
        pieces.append((text[start:], ""))
    return pieces


def split_sentences(text: str) -> list[str]:
    return [s for s, _ in sentence_pieces(text) if s.strip()]


def edit_document(text: str, level: float, op: str, rng: random.Random, filler: list[str]) -> str:
    """``text`` with ``round(level * n)`` of its n sentences deleted (``op="delete"``) or
    replaced by sentences drawn from ``filler`` (``op="replace"``). At least one sentence
    changes and at least one survives, so every level is an edit and never a new document."""
    pieces = sentence_pieces(text)
    n = len(pieces)
    changed = set(rng.sample(range(n), min(n - 1, max(1, round(level * n)))))
    out = []
    for i, (sentence, gap) in enumerate(pieces):
        if i in changed:
            if op == "delete":
                continue
            sentence = rng.choice(filler)
        out.append(sentence + (gap or " "))
    return "".join(out).strip()


def reword_document(text: str, level: float, rng: random.Random, words: list[str]) -> str:
    """``text`` with each word replaced, with probability ``level``, by a word of ``words``
    (spacing and punctuation kept): word-level edits inside every sentence, the case sentence
    edits never produce."""

    def swap(m: re.Match) -> str:
        return rng.choice(words) if rng.random() < level else m.group()

    return re.sub(r"[A-Za-z]+", swap, text)


# ---- sources -----------------------------------------------------------------------------------
class Sources:
    """Hands out real texts without reuse, so no two pairs (and no negative) share source text:
    a negative that quoted a donor would not be a negative, and two donors holding the same
    document would make "the right donor" ambiguous."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        # The Lee background corpus repeats a few articles (and a few updated versions of one
        # story); keep one per opening.
        seen, unique = set(), []
        for article in lee_background():
            if article[:60] not in seen:
                seen.add(article[:60])
                unique.append(article)
        self.rng.shuffle(unique)
        self._lee = unique
        self._wiki_used = bytearray(len(wiki_extracts()))
        self._filler: dict[str, list[str]] = {}

    def lee_article(self, ok: Callable[[str], bool] = lambda a: True) -> str:
        for j, article in enumerate(self._lee):
            if ok(article):
                return self._lee.pop(j)
        raise ValueError(
            "the Lee background corpus ran out of suitable articles; ask for fewer pairs"
        )

    def _claim(self, span: list[int]) -> bool:
        if any(self._wiki_used[i] for i in span):
            return False
        for i in span:
            self._wiki_used[i] = 1
        return True

    def wiki_doc(self, min_chars: int = 1500, max_chars: int = 3000) -> str:
        """``wiki_document`` from a random start, between the sizes, of unused extracts."""
        extracts = wiki_extracts()
        for _ in range(10_000):
            start = self.rng.randrange(len(extracts))
            span, size = [], 0
            while size < min_chars:  # the extracts wiki_document(start, min_chars) will join
                title, body = extracts[(start + len(span)) % len(extracts)]
                span.append((start + len(span)) % len(extracts))
                size += len(title) + 1 + len(body)
            if size + 2 * (len(span) - 1) <= max_chars and self._claim(span):
                return wiki_document(start, min_chars)
        raise ValueError("no unused Wikipedia span left")

    def wiki_bundle(self, k: int, window: int = 12) -> list[tuple[str, str]]:
        """``k`` unused extracts from ``window`` neighbouring ones (the package orders extracts
        by subject, so neighbours are related, as a retriever's hits would be)."""
        extracts = wiki_extracts()
        for _ in range(10_000):
            start = self.rng.randrange(len(extracts) - window)
            free = [i for i in range(start, start + window) if not self._wiki_used[i]]
            if len(free) >= k:
                chosen = self.rng.sample(free, k)
                self._claim(chosen)
                return [extracts[i] for i in chosen]
        raise ValueError("no unused Wikipedia extracts left")

    def filler(self, corpus: str) -> list[str]:
        """Sentences of documents no pair uses, claimed once: what edits put in."""
        if corpus not in self._filler:
            if corpus == "lee":
                docs = [self.lee_article() for _ in range(40)]
            else:
                docs = [body for _, body in self.wiki_bundle(60, window=400)]
            self._filler[corpus] = [s for d in docs for s in split_sentences(d) if len(s) > 40]
        return self._filler[corpus]

    def document(self, i: int, ok: Callable[[str], bool] = lambda a: True) -> tuple[str, str]:
        """(corpus, document): Lee background articles and Wikipedia spans alternately."""
        if i % 2 == 0:
            return "lee", self.lee_article(ok)
        while not ok(doc := self.wiki_doc()):
            pass  # the span stays claimed: nothing else may use it half
        return "wiki", doc


def passages(extracts: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"[{i}] {title}\n{body}" for i, (title, body) in enumerate(extracts, 1))


# ---- questions with checkable answers -----------------------------------------------------------
# Six encyclopedia extracts (by title) and questions whose answers they state. SmolLM2-135M,
# computed cold, answers these four right in ``fact_prompt``'s form (of twelve tried, with the
# question before and after the passages; it gets the other eight, and every question in a chat
# template, wrong): a hit must give its own question's answer, not the donor's.
FACT_TITLES = (
    "Candide",
    "Death of a Salesman",
    "Les Demoiselles d'Avignon",
    "Moby-Dick",
    "Superman",
    "The Structure of Scientific Revolutions",
)
FACT_QUESTIONS = (
    ("Who wrote Candide?", "Voltaire"),
    ("Who wrote Death of a Salesman?", "Miller"),
    ("Who wrote Moby-Dick?", "Melville"),
    ("In what year did Death of a Salesman premiere?", "1949"),
)


# Questions whose answer is one value (a name, a year, a count) that one fact passage states:
# FACT_QUESTIONS, then more of the same kind. The value is the only text the answer must hold, so
# a workload can also change it in the passage and ask for the new one (semshare-bench's
# entity-swap).
FACT_VALUE_QUESTIONS = FACT_QUESTIONS + (
    ("In what year was Candide first published?", "1759"),
    ("In what year was Les Demoiselles d'Avignon painted?", "1907"),
    ("In what year did Superman first appear in Action Comics?", "1938"),
    ("In what year was The Structure of Scientific Revolutions published?", "1962"),
    ("How many performances did Death of a Salesman run for on Broadway?", "742"),
)


# The sentence of its passage that states each answer: with the answer before it, the reference
# text a target's perplexity is scored on (``fact_reference``), long enough (15-40 tokens) for a
# ratio to mean something, where the answer alone is 1-5 tokens.
FACT_STATEMENTS = {
    "Who wrote Candide?": (
        "Candide, ou l'Optimisme is a French satire written by Voltaire, a philosopher of the "
        "Age of Enlightenment, first published in 1759."
    ),
    "Who wrote Death of a Salesman?": (
        "Death of a Salesman is a 1949 stage play written by the American playwright Arthur Miller."
    ),
    "Who wrote Moby-Dick?": (
        "Moby-Dick; or, The Whale is an 1851 epic novel by American writer Herman Melville."
    ),
    "In what year did Death of a Salesman premiere?": (
        "The play premiered on Broadway on February 10, 1949, running for 742 performances."
    ),
    "In what year was Candide first published?": (
        "Candide, ou l'Optimisme is a French satire written by Voltaire, a philosopher of the "
        "Age of Enlightenment, first published in 1759."
    ),
    "In what year was Les Demoiselles d'Avignon painted?": (
        "Les Demoiselles d'Avignon is a large oil painting created in 1907 by the Spanish artist "
        "Pablo Picasso."
    ),
    "In what year did Superman first appear in Action Comics?": (
        "Superman is a superhero created by writer Jerry Siegel and artist Joe Shuster, first "
        "appearing in issue #1 of Action Comics, published in the United States on April 18, 1938."
    ),
    "In what year was The Structure of Scientific Revolutions published?": (
        "The Structure of Scientific Revolutions is a 1962 book about the history of science by "
        "the philosopher Thomas S. Kuhn."
    ),
    "How many performances did Death of a Salesman run for on Broadway?": (
        "The play premiered on Broadway on February 10, 1949, running for 742 performances."
    ),
}


def fact_reference(question: str, replace: dict[str, str] | None = None) -> str:
    """The text a fact target's perplexity is scored on: its answer, then the sentence of the
    passage that states it, with ``replace``'s values changed as the target's passages were
    (entity swap). The model reads it from the prompt, so a served KV that lost or blurred the
    passage shows in every token of it."""
    answer = dict(FACT_VALUE_QUESTIONS)[question]
    statement = FACT_STATEMENTS[question]
    for old, new in (replace or {}).items():
        answer, statement = answer.replace(old, new), statement.replace(old, new)
    return f" {answer}. {statement}"


def fact_passages() -> dict[str, str]:
    """The fact extracts by title."""
    by_title = dict(wiki_extracts())
    return {title: by_title[title] for title in FACT_TITLES}


def fact_title(question: str) -> str:
    """The fact extract a question asks about (the one whose title it names)."""
    named = [title for title in FACT_TITLES if title in question]
    if len(named) != 1:
        raise ValueError(f"{question!r} names {len(named)} fact titles, not one")
    return named[0]


def fact_document() -> str:
    return "\n\n".join(f"{title}\n{body}" for title, body in fact_passages().items())


def fact_prompt(document: str, question: str) -> str:
    """The question before the passages and again after them: another question moves every
    passage token (no common prefix), so only a semantic hit can serve it."""
    return f"Question: {question}\n\n{document}\n\nQuestion: {question}\nShort answer:"


# ---- scenarios ---------------------------------------------------------------------------------
def cross_instruction_pairs(n: int, sources: Sources) -> list[Pair]:
    rng = sources.rng
    pairs = []
    for i in range(n):
        _, doc = sources.document(i, ok=lambda a: len(a) >= 1500)
        pairs.append(
            Pair(
                "cross-instruction",
                wrap(rng.choice(DONOR_TEMPLATES), doc),
                wrap(rng.choice(TARGET_TEMPLATES), doc),
                None,
            )
        )
    return pairs


def reordered_pairs(n: int, sources: Sources) -> list[Pair]:
    rng = sources.rng
    pairs = []
    for _ in range(n):
        bundle = sources.wiki_bundle(rng.randint(4, 6))
        permuted = bundle[:]
        while permuted == bundle:
            rng.shuffle(permuted)
        donor = rng.choice(DONOR_HEADERS) + passages(bundle) + "\n\n" + rng.choice(DONOR_QUESTIONS)
        target = (
            rng.choice(TARGET_HEADERS) + passages(permuted) + "\n\n" + rng.choice(TARGET_QUESTIONS)
        )
        pairs.append(Pair("reordered", donor, target, None))
    return pairs


def edited_pairs(n: int, sources: Sources, levels=LEVELS) -> list[Pair]:
    """``n`` donors, each edited once per level; even donors lose sentences, odd donors get
    sentences of other documents instead. Donor and target share their wrapper, so only the
    edit separates them."""
    rng = sources.rng
    pairs = []
    for i in range(n):
        corpus, doc = sources.document(i, ok=lambda a: len(split_sentences(a)) >= 10)
        template = rng.choice(DONOR_TEMPLATES)
        op = "delete" if i % 2 == 0 else "replace"
        for level in levels:
            edited = edit_document(doc, level, op, rng, sources.filler(corpus))
            pairs.append(Pair("edited", wrap(template, doc), wrap(template, edited), level))
    return pairs


def negative_targets(n: int, sources: Sources) -> list[str]:
    """Unrelated documents shaped like the donors (the same three kinds, in the donors' own
    templates and headers): shared boilerplate is exactly what could lure a false donor."""
    rng = sources.rng
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(
                wrap(rng.choice(DONOR_TEMPLATES), sources.lee_article(ok=lambda a: len(a) >= 600))
            )
        elif i % 3 == 1:
            out.append(wrap(rng.choice(DONOR_TEMPLATES), sources.wiki_doc()))
        else:
            out.append(
                rng.choice(DONOR_HEADERS)
                + passages(sources.wiki_bundle(rng.randint(4, 6)))
                + "\n\n"
                + rng.choice(DONOR_QUESTIONS)
            )
    return out


def build(
    n: int, levels=LEVELS, negatives: int | None = None, seed: int = 0
) -> tuple[list[Pair], list[str]]:
    """All scenarios from one pool of sources: ``n`` pairs each (``n`` donors x levels for
    "edited") and ``negatives`` negative targets (3n by default)."""
    sources = Sources(seed)
    pairs = (
        cross_instruction_pairs(n, sources)
        + reordered_pairs(n, sources)
        + edited_pairs(n, sources, levels)
    )
    return pairs, negative_targets(3 * n if negatives is None else negatives, sources)
