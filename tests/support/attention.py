"""A plain reference for the recompute's attention math: per query head, in fp64."""

import torch


def causal_probs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """``[Hq, S, n]``: each query head's softmax over the keys up to its query's position
    (q ``[S, Hq, D]``, k ``[n, Hkv, D]``, grouped KV heads repeated to the query heads)."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale
    seen = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
