import dataclasses
import re
from pathlib import Path

import pytest

from semshare_vllm.config import SemShareConfig, SemShareConfigError


def test_defaults():
    cfg = SemShareConfig.from_extra_config({}, environ={})
    assert cfg == SemShareConfig()
    assert cfg.persist_dir is None and cfg.capture is True


def test_values_and_sizes():
    cfg = SemShareConfig.from_extra_config(
        {"host_store_bytes": "512MiB", "persist_dir": "/tmp/x", "min_reuse_tokens": 64}, environ={}
    )
    assert cfg.host_store_bytes == 512 * 2**20
    assert cfg.persist_dir == "/tmp/x" and cfg.min_reuse_tokens == 64


def test_environment_overrides_extra_config():
    cfg = SemShareConfig.from_extra_config(
        {"capture": True},
        environ={
            "SEMSHARE_CAPTURE": "false",
            "SEMSHARE_HOST_STORE_BYTES": "1GB",
            "SEMSHARE_CACHE_DIR": "/elsewhere",
        },
    )
    assert cfg.capture is False and cfg.host_store_bytes == 10**9


@pytest.mark.parametrize(
    "extra, environ, named",
    [
        ({"host_store_byte": 1}, {}, "host_store_byte"),  # typo
        ({"capture": "yes"}, {}, "capture"),  # JSON wants a bool
        ({"min_reuse_tokens": 0}, {}, "min_reuse_tokens"),  # out of range
        ({"min_donor_tokens": 1.5}, {}, "min_donor_tokens"),  # wrong type
        ({"host_store_bytes": "lots"}, {}, "host_store_bytes"),  # not a size
        ({"persist_dir": 3}, {}, "persist_dir"),
        ({}, {"SEMSHARE_MIN_REUSE_TOKENS": "ten"}, "SEMSHARE_MIN_REUSE_TOKENS"),
        ({}, {"SEMSHARE_CAPTUR": "1"}, "SEMSHARE_CAPTUR"),  # unknown variable
        ({"kv_tier": "redis"}, {}, "kv_tier"),
        ({"kv_tier": "lmcache", "lmcache_remote_url": "localhost:6379"}, {}, "lmcache_remote_url"),
        ({"shared_index_url": "redis://h:6379"}, {}, "shared_index_url"),  # no shared KV tier
        (
            {
                "kv_tier": "lmcache",
                "lmcache_remote_url": "redis://h:6379",
                "shared_index_url": "http://h:6379",
                "shared_index_secret": "s",
            },
            {},
            "shared_index_url",
        ),  # not Redis
        (
            {
                "kv_tier": "lmcache",
                "lmcache_remote_url": "redis://h:6379",
                "shared_index_url": "redis://h:6379",
            },
            {},
            "shared_index_secret",
        ),  # records unsigned
        (
            {
                "kv_tier": "lmcache",
                "lmcache_remote_url": "redis://h:6379",
                "shared_index_url": "redis://h:6379",
            },
            {"SEMSHARE_SHARED_INDEX_SECRET": ""},
            "shared_index_secret",
        ),  # empty is none
    ],
)
def test_bad_config_names_the_key(extra, environ, named):
    with pytest.raises(SemShareConfigError, match=re.escape(named)):
        SemShareConfig.from_extra_config(extra, environ=environ)


def test_the_shared_index_secret_comes_from_the_environment_and_is_never_shown():
    shared = {
        "kv_tier": "lmcache",
        "lmcache_remote_url": "redis://h:6379",
        "shared_index_url": "redis://h:6379",
    }
    cfg = SemShareConfig.from_extra_config(
        shared, environ={"SEMSHARE_SHARED_INDEX_SECRET": "s3cret-value"}
    )
    assert cfg.shared_index_secret == "s3cret-value"
    assert "s3cret-value" not in repr(cfg) and "s3cret-value" not in str(cfg.describe())


def test_the_configuration_page_documents_every_key():
    # generated from the fields (semshare_vllm.config_docs; kept current by test_config_docs.py)
    page = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(SemShareConfig):
        assert f"`{f.name}`" in page, f"docs/configuration.md does not document {f.name}"


def test_each_section_validates_itself_and_the_config_is_their_union():
    from semshare_vllm.config import SECTIONS, AlignmentConfig, SharingConfig

    with pytest.raises(SemShareConfigError, match="lsh_bits"):
        AlignmentConfig(lsh_bits=5, lsh_tables=1)
    with pytest.raises(SemShareConfigError, match="shared_index_url"):
        SharingConfig(shared_index_url="redis://h:6379")
    cfg = SemShareConfig()
    assert all(isinstance(cfg, section) for section in SECTIONS)
    names = [f.name for section in SECTIONS for f in dataclasses.fields(section)]
    assert names == [f.name for f in dataclasses.fields(SemShareConfig)]  # each key once
    # flat access, and a section's keys read from the whole config
    assert cfg.lookup_deadline_ms == 200 and cfg.stages() == ("exact", "edit", "sentence", "lsh")
