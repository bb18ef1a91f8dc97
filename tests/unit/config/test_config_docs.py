"""docs/configuration.md is generated from SemShareConfig and committed: it must be what the
generator writes today, with every key in exactly one section and no secret's value."""

import dataclasses

from semshare_vllm import config_docs
from semshare_vllm.config import SemShareConfig

FIELDS = [f.name for f in dataclasses.fields(SemShareConfig)]


def test_the_committed_page_is_the_generated_one():
    committed = config_docs.DOCS_PATH.read_text(encoding="utf-8")
    assert committed == config_docs.render(), (
        "docs/configuration.md is out of date with src/semshare_vllm/config/: run "
        "`python -m semshare_vllm.config_docs` and commit the result"
    )


def test_every_field_is_in_exactly_one_section_in_the_dataclass_order():
    grouped = [(title, [f.name for f in fields]) for title, fields in config_docs.sections()]
    assert [t for t, _ in grouped] == [t for t, _ in config_docs.SECTIONS]
    assert all(names for _, names in grouped), "a section without keys"
    assert [n for _, names in grouped for n in names] == FIELDS


def test_every_field_appears_in_the_page_with_its_doc():
    page = config_docs.render()
    for f in dataclasses.fields(SemShareConfig):
        rows = [line for line in page.splitlines() if line.startswith(f"| `{f.name}` |")]
        assert len(rows) == 1, f"{f.name}: {len(rows)} rows in docs/configuration.md"
        assert " ".join(f.metadata["doc"].split()).replace("|", "\\|") in rows[0]


def test_a_secret_default_is_shown_unset(monkeypatch):
    secrets = [f for f in dataclasses.fields(SemShareConfig) if f.metadata.get("secret")]
    assert secrets
    for f in secrets:
        assert config_docs.format_default(f) == "unset"
        # even if a default value were ever given, it would not be printed
        monkeypatch.setattr(f, "default", "s3cret-default")
        assert config_docs.format_default(f) == "unset"
        assert "s3cret-default" not in config_docs.render()


def test_defaults_and_allowed_values_are_rendered_from_the_fields():
    fields = {f.name: f for f in dataclasses.fields(SemShareConfig)}
    assert config_docs.format_default(fields["host_store_bytes"]) == "`4GiB`"
    assert config_docs.format_default(fields["persist_dir"]) == "unset"
    assert config_docs.format_default(fields["capture"]) == "`true`"
    assert config_docs.format_default(fields["kv_tier"]) == '`"host"`'
    assert config_docs.format_allowed(fields["kv_tier"]) == '`"host"`, `"lmcache"`'
    assert config_docs.format_allowed(fields["similarity_threshold"]) == "number, -1 to 1"
    assert config_docs.format_allowed(fields["top_k"]) == "integer ≥ 1"


def test_main_writes_the_page(tmp_path):
    out = tmp_path / "configuration.md"
    assert config_docs.main([str(out)]) == 0
    assert out.read_text(encoding="utf-8") == config_docs.render()
