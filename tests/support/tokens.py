"""Seeded random token ids in [1000, 40000), for alignment and planning tests that need prompts
without a tokenizer."""

import numpy as np


def random_ids(n, seed):
    """``n`` ids from ``seed``, as a numpy array."""
    return np.random.default_rng(seed).integers(1000, 40000, n)


def random_id_list(n, seed):
    """The same ids as ``random_ids(n, seed)``, as a list of ints (``+`` concatenates)."""
    return random_ids(n, seed).tolist()
