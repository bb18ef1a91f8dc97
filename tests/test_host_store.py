import os

import pytest
import torch

from semshare_vllm import donor_file
from semshare_vllm.host_store import DonorUnavailable, HostKVStore
from semshare_vllm.metadata import DonorKey

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def kv(tokens, seed=0):
    return torch.randn(len(LAYERS), 2, tokens, 2, 8, generator=torch.Generator().manual_seed(seed))


def test_memory_lru_by_bytes():
    one = kv(10).nbytes
    store = HostKVStore(2 * one, LAYERS)
    keys = [DonorKey("", f"d{i}") for i in range(3)]
    store.put(keys[0], [1] * 10, kv(10, 0))
    store.put(keys[1], [2] * 10, kv(10, 1))
    store.get(keys[0])  # most recent now
    store.put(keys[2], [3] * 10, kv(10, 2))
    assert keys[0] in store and keys[2] in store and keys[1] not in store
    assert store.used_bytes == 2 * one
    with pytest.raises(DonorUnavailable):
        store.get(keys[1])


def test_persist_roundtrip_and_drop(tmp_path):
    key = DonorKey("tenant", "abc")
    store = HostKVStore(1 << 30, LAYERS, "CPU_ATTN/vec/8", tp_rank=1, tp_size=2,
                        persist_root=tmp_path)
    data = kv(12)
    store.put(key, list(range(12)), data)
    store.flush()
    path = tmp_path / "abc.tp1of2.safetensors"
    assert path.is_file() and not list(tmp_path.glob(".tmp-*"))
    header = donor_file.read_header(path)
    assert (header.namespace, header.token_ids, header.layer_names) == ("tenant", list(range(12)),
                                                                        LAYERS)
    store.drop_memory(key)
    assert key not in store
    assert torch.equal(store.get(key), data)  # read back from disk
    other = HostKVStore(1 << 30, LAYERS, "FLASH_ATTN/-/8", tp_rank=1, tp_size=2,
                        persist_root=tmp_path)
    with pytest.raises(DonorUnavailable, match="page layout"):
        other.get(key)  # pages of another backend are never written into this one
    store.drop(key)
    store.flush()
    assert not path.exists()
    store.close()


def test_truncated_and_corrupted_files_are_detected(tmp_path):
    path = tmp_path / "d.tp0of1.safetensors"
    donor_file.write(path, "", "d", [1, 2, 3], LAYERS, "L", kv(3))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) - 10])
    with pytest.raises(donor_file.CorruptDonorFile, match="header promises"):
        donor_file.read_header(path)
    path.write_bytes(good[:-8] + b"\x00" * 8)
    donor_file.read_header(path)  # same size: the header alone cannot tell...
    with pytest.raises(donor_file.CorruptDonorFile, match="checksum"):
        donor_file.read(path)  # ...the checksum does
    path.write_bytes(b"garbage")
    with pytest.raises(donor_file.CorruptDonorFile):
        donor_file.read_header(path)
    store = HostKVStore(1 << 30, LAYERS, "L", persist_root=tmp_path)
    with pytest.raises(DonorUnavailable):
        store.get(DonorKey("", "d"))


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(donor_file, "save_file", boom)
    with pytest.raises(OSError):
        donor_file.write(tmp_path / "x.tp0of1.safetensors", "", "x", [1], LAYERS, "L", kv(1))
    assert os.listdir(tmp_path) == []
