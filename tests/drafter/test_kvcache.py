"""The drafter's in-place KV cache (drafter.kvcache): the same keys/values as transformers'
DynamicCache through appends, rollbacks, branch copies and batch repeats, without copying the
cache on an append that fits its spare room."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from drafter.kvcache import GROW_SLOTS, GrowingCache


def _kv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)  # [B, kv, T, dim]


def _same(a: DynamicCache, b: DynamicCache) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_appends_and_rollbacks_hold_what_a_dynamic_cache_holds() -> None:
    plain, growing = DynamicCache(), GrowingCache()
    seed = 0
    # a prefill in chunks, steps of one token, a commit's tokens, rollbacks of a rejected tail
    for op in [("add", 128), ("add", 128), ("add", 37), ("add", 1), ("crop", -3), ("add", 4), ("add", 1)] * 3:
        if op[0] == "add":
            seed += 1
            for layer in range(2):
                k, v = _kv(1, op[1], seed * 10 + layer)
                out_plain = plain.update(k, v, layer)
                out_growing = growing.update(k, v, layer)
                assert all(torch.equal(x, y) for x, y in zip(out_plain, out_growing, strict=True))
        else:
            plain.crop(op[1])
            growing.crop(op[1])
        _same(plain, growing)


def test_an_append_within_the_spare_room_writes_in_place() -> None:
    cache = GrowingCache()
    cache.update(*_kv(1, 10, 1), 0)
    buffer = cache.layers[0].keys.data_ptr()
    for i in range(GROW_SLOTS):  # the first buffer has GROW_SLOTS spare slots and more
        cache.update(*_kv(1, 1, 2 + i), 0)
        assert cache.layers[0].keys.data_ptr() == buffer
    cache.crop(-5)
    cache.update(*_kv(1, 2, 999), 0)  # over the dropped slots
    assert cache.layers[0].keys.data_ptr() == buffer
    assert cache.get_seq_length() == 10 + GROW_SLOTS - 5 + 2


def test_a_branch_copy_and_a_batch_repeat_keep_the_values_and_part_from_the_original() -> None:
    plain, growing = DynamicCache(), GrowingCache()
    for c in (plain, growing):
        c.update(*_kv(1, 20, 7), 0)
    plain_copy, growing_copy = copy.deepcopy(plain), copy.deepcopy(growing)
    for c in (plain_copy, growing_copy):
        c.crop(-6)
        c.batch_repeat_interleave(3)
        c.update(*_kv(3, 2, 8), 0)
    _same(plain_copy, growing_copy)
    assert growing_copy.layers[0].keys.shape == (3, 2, 16, 4)
    growing.update(*_kv(1, 1, 9), 0)  # the original goes on as before, untouched by its copy
    plain.update(*_kv(1, 1, 9), 0)
    _same(plain, growing)
