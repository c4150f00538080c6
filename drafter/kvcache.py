"""A draft session's KV cache that appends in place.

transformers' DynamicCache appends a step's keys/values with `torch.cat`, which copies the whole
cache of every layer at every step: at ~3,000 cached tokens that is ~75 MB per session and step
for Qwen2.5-0.5B (24 layers x keys and values x 2 KV heads x 64 dims x 4 bytes x 3,000), the
cost of a long prompt's every draft token, and each prefill chunk copies all the chunks before
it. `GrowingCache` keeps each layer's keys/values in a buffer with room to spare and writes a
step's new ones into it; `keys` and `values` are views of the buffer's first `length` slots.

Terms:
    length      cached tokens of the layer (keys.shape[-2])
    capacity    slots of the buffer (buffer.shape[-2]); when a step would pass it, a new
                buffer of length + GROW_SLOTS + length / 2 slots takes the cache over (one
                copy, amortised over the steps that fill the spare slots)
    reserve     slots the first buffer gets at least (GrowingCache(reserve)): a session that
                knows its prompt and the tokens it may add allocates them once, without the
                copies of growing through its prefill chunks and without the spare half
                (drafter.memory reserves the same slots of its budget). A reserve grown later
                (`GrowingCache.reserve`, drafter.memory's growth) is the size of the next
                buffer, when a step passes the one held. A step past the reserve itself (a
                commit that landed after the worker grew the reserve for the step) gets a
                buffer of GROW_SLOTS spare slots only, not the half: drafter.memory counts it
                at its size until the next growth
    nbytes      bytes of the buffers the cache holds (`GrowingCache.nbytes`): what the session's
                keys/values take, spare slots included

Everything else is DynamicLayer's: `crop` (a rollback) narrows the views, so the next step
writes over the dropped slots; `batch_repeat_interleave` and `batch_select_indices` (DynamicCache's
batch operations; the drafter's branch rows no longer use them) make new tensors, which the next
append moves into a buffer of their own. The values
read are the ones DynamicCache would hold, so drafts are unchanged.
"""

from __future__ import annotations

import functools
import math
import mmap

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

# Least spare slots a new buffer gets past the tokens it holds (a prefill chunk's worth).
GROW_SLOTS = 256


def buffer_like(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor of `shape` with `like`'s dtype and device. On the CPU its memory
    is an anonymous mapping of its own (mmap), not the heap's: its pages become resident as the
    cache fills them, and they go back to the system when the last view of it is freed. From
    the heap (glibc malloc), a freed cache's buffers stayed resident as holes that later buffers,
    a little larger as caches grow, could not reuse: the drafter's memory grew past its budget
    (drafter.memory) as its sessions' caches grew and ended."""
    if like.device.type != "cpu":
        return like.new_empty(shape)
    count = math.prod(shape)
    mapping = mmap.mmap(-1, max(1, count * like.element_size()))
    return torch.frombuffer(mapping, dtype=like.dtype, count=count).view(shape)  # keeps the mapping alive


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose appends write into a buffer with spare room (module docstring);
    its first buffer has at least `reserve` slots."""

    def __init__(self, reserve: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        self.reserve = reserve

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None  # [B, kv heads, capacity, dim]
        self._value_buffer: torch.Tensor | None = None

    def _in_buffer(self, batch: int, length: int, adding: int) -> bool:
        """Whether keys/values are still views of the buffers, at their start, and the buffers
        fit `batch` rows and `adding` more slots."""
        kb, vb, keys, values = self._key_buffer, self._value_buffer, self.keys, self.values
        if kb is None or vb is None or kb.shape[0] != batch or length + adding > kb.shape[-2]:
            return False
        if length == 0:
            return True
        assert keys is not None and values is not None
        return keys.data_ptr() == kb.data_ptr() and values.data_ptr() == vb.data_ptr()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv heads, T, dim] -> the layer's [B, kv heads, length + T, dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, adding = self.get_seq_length(), key_states.shape[-2]
        kb, vb = self._key_buffer, self._value_buffer
        if kb is None or vb is None or not self._in_buffer(key_states.shape[0], length, adding):
            b, heads, _, dim = key_states.shape
            capacity = length + adding + GROW_SLOTS + (length + adding) // 2
            if self.reserve >= length + adding:  # the slots reserved, when they hold the step
                capacity = self.reserve
            elif kb is None and self.reserve:  # a first step past the reserve: no spare room
                capacity = length + adding
            elif self.reserve:  # a step past a reserve its session had no time to grow: little spare room
                capacity = length + adding + GROW_SLOTS
            kb = buffer_like(key_states, (b, heads, capacity, dim))
            vb = buffer_like(value_states, (b, heads, capacity, dim))
            if length:
                assert self.keys is not None and self.values is not None
                kb[:, :, :length] = self.keys
                vb[:, :, :length] = self.values
            self._key_buffer, self._value_buffer = kb, vb
        kb[:, :, length : length + adding] = key_states
        vb[:, :, length : length + adding] = value_states
        keys, values = kb[:, :, : length + adding], vb[:, :, : length + adding]
        self.keys, self.values = keys, values
        return keys, values

    def nbytes(self) -> int:
        """Bytes of the storage behind this layer's keys and values (its buffers, spare slots included)."""
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values) if t is not None)


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers (made lazily, one per layer the model updates), whose
    first buffers have at least `reserve` slots (0: as many as the first step needs, with the
    spare room of the module's terms)."""

    def __init__(self, reserve: int = 0) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        self.reserve(reserve)

    def reserve(self, slots: int) -> None:
        """Make `slots` the size of every layer's next buffer (module's terms: a grown reserve;
        the buffers held now stay until a step passes them)."""
        # transformers makes each new layer as layer_class_to_replicate(), with no arguments
        self.layer_class_to_replicate = functools.partial(GrowingLayer, slots)  # type: ignore[assignment]
        for layer in self.layers:
            assert isinstance(layer, GrowingLayer)  # the only layers this cache makes
            layer.reserve = slots

    def nbytes(self) -> int:
        """Bytes of the storage behind every layer's keys and values (module's terms)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, GrowingLayer))

    def truncate(self, length: int) -> None:
        """Cut every layer that holds more than `length` tokens to its first `length`: after a
        forward stopped part-way (specdec.models.lean.Stopped), the layers it reached hold the
        step's keys/values and the others do not (`crop` drops as many from every layer)."""
        for layer in self.layers:
            assert isinstance(layer, GrowingLayer)  # the only layers this cache makes
            held = layer.get_seq_length()
            if held > length:
                layer.crop(length - held)
