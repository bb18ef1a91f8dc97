"""Pages of a backend we cannot read by token (or quantised KV, whose pages must move byte for
byte): only whole-block copies (``PageSpec.copy_blocks``) work on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PageSpec, UnsupportedKVLayout


@dataclass(frozen=True)
class WholePagesSpec(PageSpec):
    def check(self, kv_cache: torch.Tensor) -> None:
        super().check(kv_cache)
        raise UnsupportedKVLayout(f"attention backend {self.backend!r} has no KV view")

    def offsets(self, kv_cache):
        self.check(kv_cache)

    def read(self, kv_cache, slots):
        self.check(kv_cache)

    def write(self, kv_cache, slots, k, v):
        self.check(kv_cache)

    def read_blocks(self, kv_cache, blocks):
        self.check(kv_cache)

    def write_blocks(self, kv_cache, blocks, k, v):
        self.check(kv_cache)
