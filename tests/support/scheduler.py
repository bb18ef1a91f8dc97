"""Hand-built requests and geometry for the scheduler half (no engine): used by the scheduler,
request-identity, discovery and ``vllm_compat.block_hashes`` tests."""

from types import SimpleNamespace

import torch

from semshare_vllm.layout.geometry import KVGeometry

BS = 32
LAYERS = ("l0", "l1")


def geometry(**kw):
    base = dict(
        layer_names=LAYERS,
        block_size=BS,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
        tp_size=1,
        fingerprint="fp",
    )
    base.update(kw)
    return KVGeometry(**base)


def request(req_id, tokens, salt=None, computed=0, outputs=()):
    all_ids = list(tokens) + list(outputs)
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        all_token_ids=all_ids,
        num_tokens=len(all_ids),
        num_prompt_tokens=len(tokens),
        num_output_tokens=len(all_ids) - len(tokens),
        cache_salt=salt,
        num_computed_tokens=computed,
    )


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def finish(s, tokens, salt=None, outputs=(7, 8)):
    r = request("done", tokens, salt, outputs=outputs)
    r.num_computed_tokens = r.num_tokens - 1
    return s.request_finished(r, list(range(100, 100 + r.num_tokens // BS + 1)))


def found(s, req_id):
    """The donors the scheduler's search found for a live request (None: none, or not live)."""
    state = s.requests.get(req_id)
    return None if state is None else state.found
