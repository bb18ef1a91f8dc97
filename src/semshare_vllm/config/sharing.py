"""The sharing section: the LMCache KV tier and the donor index shared across instances."""

from __future__ import annotations

import re
from dataclasses import dataclass

from semshare_vllm.config.knobs import Section, SemShareConfigError, knob


@dataclass(frozen=True)
class SharingConfig(Section):
    """Where donor KV lives besides the host store (LMCache, local or remote) and how instances
    announce their donors to each other (a signed index on Redis / Valkey)."""

    TITLE = "Donor KV tier and sharing across instances"

    kv_tier: str = knob(
        "host",
        'Where donor KV lives besides the host store: "host" (the host store only, '
        'this instance), "lmcache" (every captured donor is also put in LMCache, pinned to '
        "0.5.6, the [lmcache] extra; a donor missing from the host store, such as another "
        "instance's or one the pool let go, is fetched from LMCache into the host store on use). "
        "If LMCache cannot be set up, the worker warns once and keeps the host store alone.",
        choices=("host", "lmcache"),
    )
    lmcache_local_cpu_bytes: int = knob(
        2 * 2**30,
        'With kv_tier "lmcache": LMCache\'s local CPU backend size, per rank '
        "(LMCache evicts LRU past it).",
        minimum=0,
        size=True,
    )
    lmcache_remote_url: str | None = knob(
        None,
        'With kv_tier "lmcache": LMCache\'s remote backend, e.g. '
        '"redis://host:6379" (Redis or Valkey; LMCache\'s other remote_url schemes pass '
        "through), shared by every instance. Unset: LMCache's local CPU backend only.",
    )
    shared_index_url: str | None = knob(
        None,
        "A Redis / Valkey URL (redis://, rediss://, unix://) where the donor index is "
        "shared across instances: each donor's record (namespace, token ids, embedding) is "
        "published to a stream, and every instance adds the others' donors to its own index "
        "once their KV is readable from lmcache_remote_url (catching up from the stream's start "
        'when it starts). Needs kv_tier "lmcache" and lmcache_remote_url (usually the same '
        "server). Unset: this instance's donors only.",
    )
    shared_index_secret: str | None = knob(
        None,
        "With shared_index_url (required there): the key every instance signs its donor "
        "records and KV readiness marks with (HMAC-SHA256); records or marks not signed with it "
        "are dropped (counted as shared_records_forged), and a shared donor's KV is checked "
        "against the digest its instance signed before it is used (else the load is recomputed, "
        "counted as tier_digest_mismatches). Give every instance the "
        "same long random value, preferably as SEMSHARE_SHARED_INDEX_SECRET (vLLM logs its "
        "arguments; this key is never logged here).",
        secret=True,
    )

    def validate(self) -> None:
        if self.lmcache_remote_url and "://" not in self.lmcache_remote_url:
            raise SemShareConfigError(
                f"lmcache_remote_url: expected a URL such as "
                f"redis://127.0.0.1:6379; got {self.lmcache_remote_url!r}"
            )
        if self.shared_index_url:
            if not re.match(r"^(redis|rediss|unix)://", self.shared_index_url):
                raise SemShareConfigError(
                    f"shared_index_url: expected a redis://, rediss:// or "
                    f"unix:// URL; got {self.shared_index_url!r}"
                )
            if self.kv_tier != "lmcache" or not self.lmcache_remote_url:
                raise SemShareConfigError(
                    'shared_index_url needs kv_tier "lmcache" and lmcache_remote_url: other '
                    "instances must be able to read the KV of the donors it announces"
                )
            if not self.shared_index_secret:
                raise SemShareConfigError(
                    "shared_index_url needs shared_index_secret (or SEMSHARE_SHARED_INDEX_SECRET):"
                    " the key every instance signs its records with; without it any client of "
                    "the Redis server could announce donors"
                )
