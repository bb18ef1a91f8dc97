"""What a request asks of the connector, read from vLLM's ``Request``.

Per-request control comes from the OpenAI request body's ``"kv_transfer_params"``:
``{"semshare": mode}`` and ``{"semshare_reuse_limit": N}``. A bad value is ignored with one
warning (a request never fails because of us).
"""

from __future__ import annotations

import logging

from semshare_vllm.logs import warn_once

logger = logging.getLogger("vllm.semshare.scheduler")

REUSE_MODES = ("auto", "off", "exact", "semantic")


def _transfer_param(request, name: str, default=None):
    params = getattr(request, "kv_transfer_params", None)
    return params.get(name, default) if isinstance(params, dict) else default


def reuse_mode(request) -> str:
    """ "auto" (the config decides), "off" (no reuse, and the request is not kept as a donor),
    "exact" (exact-prefix reuse only), "semantic" (a semantic donor is used whatever its
    alignment coverage, as long as the worker can repair it)."""
    mode = _transfer_param(request, "semshare", "auto")
    if mode not in REUSE_MODES:
        warn_once(
            logger,
            f"mode:{mode!s:.40}",
            'SemShare: kv_transfer_params semshare=%r is not one of %s; using "auto"',
            mode,
            ", ".join(REUSE_MODES),
        )
        return "auto"
    return mode


def reuse_limit(request) -> int | None:
    """``"semshare_reuse_limit": N``: reuse KV for at most the prompt's first N tokens; vLLM
    computes the rest. With it a request may also ask for prompt logprobs (vLLM's own prefix
    cache stays off for those): the positions from N on are scored by vLLM, the ones served are
    marked (``vllm_compat.prompt_logprobs``)."""
    limit = _transfer_param(request, "semshare_reuse_limit")
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        warn_once(
            logger,
            "reuse_limit",
            "SemShare: kv_transfer_params semshare_reuse_limit=%r "
            "is not a non-negative integer; ignored",
            limit,
        )
        return None
    return limit


def reusable_prompt(request) -> list[int]:
    """The prompt tokens a donor is searched and aligned for: the whole prompt, or with a reuse
    limit N its first N + 1, the prompt as if it ended there (vLLM computes token N itself). A
    request scoring a continuation (prompt + continuation, the limit at the prompt's end) is
    then planned exactly as its prompt served alone, never on the continuation's text."""
    return list(request.all_token_ids[: reusable_length(request)])


def reusable_length(request) -> int:
    """How many tokens ``reusable_prompt`` holds."""
    limit = reuse_limit(request)
    n = request.num_prompt_tokens
    return n if limit is None else min(n, limit + 1)


def wants_prompt_logprobs(request) -> bool:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is not None


def claim_limit(request, block_size: int) -> int:
    """Where any claim must end: vLLM computes at least the last token itself, a reuse limit
    caps it, and claims end on a block boundary."""
    limit = reuse_limit(request)
    end = request.num_tokens - 1 if limit is None else min(request.num_tokens - 1, limit)
    return (end // block_size) * block_size
