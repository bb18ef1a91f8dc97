from semshare_vllm.catalog.donor_index import DonorIndex, DonorRecord
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for

BS = 4


def record(ns, tokens, nbytes=100):
    return DonorRecord(
        DonorKey(ns, donor_id_for(ns, tokens)), list(tokens), nbytes, block_hashes(tokens, BS)
    )


def test_longest_block_aligned_prefix():
    idx = DonorIndex(BS, 10_000)
    a = record("", range(0, 20))
    b = record("", list(range(0, 8)) + [99] * 12)
    idx.add(a)
    idx.add(b)
    m = idx.longest_prefix("", list(range(0, 13)) + [7, 7])
    assert m.key == a.key and m.num_tokens == 12  # 13 common tokens -> 3 whole blocks
    m = idx.longest_prefix("", list(range(0, 8)) + [99] * 5)
    assert m.key == b.key and m.num_tokens == 12
    assert idx.longest_prefix("", [1, 2, 3, 4, 5]) is None
    assert idx.longest_prefix("", [0, 1, 2]) is None  # shorter than one block


def test_namespaces_are_hard_walls():
    idx = DonorIndex(BS, 10_000)
    idx.add(record("tenant-a", range(16)))
    assert idx.longest_prefix("tenant-b", list(range(16))) is None
    assert idx.longest_prefix("", list(range(16))) is None  # "" is a namespace, not "all"
    assert idx.longest_prefix("tenant-a", list(range(16))).num_tokens == 16


def test_lru_eviction_by_bytes_and_touch():
    idx = DonorIndex(BS, 300)
    r1, r2, r3 = (record("", range(i * 100, i * 100 + 8)) for i in range(3))
    assert idx.add(r1) == [] and idx.add(r2) == [] and idx.add(r3) == []
    idx.touch(r1.key)
    r4 = record("", range(900, 908))
    assert idx.add(r4) == [r2.key]
    assert idx.used_bytes == 300 and r2.key not in idx
    assert idx.longest_prefix("", list(range(100, 108))) is None  # its hashes went with it
    too_big = record("", range(5000, 5008), nbytes=301)
    assert idx.add(too_big) == [too_big.key] and too_big.key not in idx


def test_covers():
    idx = DonorIndex(BS, 10_000)
    idx.add(record("", range(10)))
    assert idx.covers("", list(range(10)))
    assert idx.covers("", list(range(6)))
    assert not idx.covers("", list(range(11)))
    assert not idx.covers("", list(range(5)) + [42])
    assert not idx.covers("x", list(range(6)))


def test_shrink_to_the_workers_real_capacity():
    idx = DonorIndex(BS, 1000)
    recs = [record("", range(i * 10, i * 10 + 8)) for i in range(5)]
    for r in recs:
        idx.add(r)
    assert idx.shrink(250) == [recs[0].key, recs[1].key, recs[2].key]
    assert idx.used_bytes == 200 and idx.capacity_bytes == 250


def test_two_namespaces_never_share_a_donor_id():
    """A namespace holds the client's ``cache_salt``, which may hold NULs: with the namespace
    ended by a NUL, ``("t", [1, 7, 9, 11])`` and ``("t\\0\\x01" + six NULs, [7, 9, 11])`` hashed
    the same bytes, and one tenant could overwrite another's persisted donor file or readiness
    mark (a recompute, not wrong KV: the file's header and the digests are checked)."""
    assert donor_id_for("t", [1, 7, 9, 11]) != donor_id_for("t\0\x01" + "\0" * 6, [7, 9, 11])
    assert donor_id_for("t", [1, 7]) == donor_id_for("t", [1, 7])
