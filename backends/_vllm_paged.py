"""vLLM's paged KV cache seen as pool blocks: one pool block per token block, holding that block of
every attention layer, moved between the pool and vLLM's per-layer KV tensors through one staging
buffer. (A token block larger than `_vllm_plan.MAX_PART_BYTES` is stored as several pool blocks of
whole layers.)

Why one pool block per token block (all layers) rather than one per (token block, layer): the pool's
cost per key (~30 us for a same-node worker) is far above the cost of copying a layer's block
(~3 us for 32 KiB); with L layers, per-layer keys cost L times the keys for the same bytes. vLLM's
CPU backend lays the cache out layer-major (`LBHNC`), so a token block's layers are not adjacent and
one staging copy per direction is the price of one key per block.

On a GPU the layers are CUDA tensors: the staging buffer is on their device too, so the gather and
scatter stay there, and the pool moves the staged blocks to and from the host a batch at a time,
through pinned memory (`kvpool.core.cuda_staging`). The copies run on the current stream, after the
forward pass that wrote the KV and before the one that reads it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvpool.core import InvalidArgument, PoolClient

from ._hostio import HostIO
from ._vllm_plan import MAX_PART_BYTES, layer_groups, part_keys

STAGING_BYTES = 64 << 20
"""Largest staging buffer (bytes); bigger transfers go through it in chunks of whole blocks."""

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


class PagedKV:
    """The KV tensors of one worker, indexed by vLLM block id.

    `layers` are vLLM's per-layer views with blocks as the first dimension (`[B, H, N, C]` in vLLM
    0.32). A view split into kernel blocks (`[k*B, H, N/k, C]`: an attention backend whose kernel takes
    smaller blocks) is regrouped into `num_blocks` blocks, and moved in the order of an unsplit one
    (`[H, N, C]`: an instance of the other backend reads the same KV from the same key). All layers must
    have the same block shape and dtype, on one device (the CPU, or one CUDA device). A token block is
    `[layers, *block shape]` of their bytes, stored as one pool block per `layer_groups` part.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, staging_bytes: int = STAGING_BYTES,
                 max_part_bytes: int = MAX_PART_BYTES) -> None:
        if not layers:
            raise InvalidArgument("no KV cache layers to move")
        grouped = [t if t.shape[0] == num_blocks else torch.unflatten(t, 0, (num_blocks, -1)) for t in layers]
        shape, dtype, device = grouped[0].shape, grouped[0].dtype, grouped[0].device
        for t in grouped:
            if t.shape != shape or t.dtype != dtype or t.device != device or device.type not in ("cpu", "cuda"):
                raise InvalidArgument(f"KV layers differ or are on no CPU or CUDA device: {tuple(t.shape)} {t.dtype} "
                                      f"{t.device} vs {tuple(shape)} {dtype} {device}; kvpool moves uniform layers "
                                      "on one CPU or CUDA device only")
        self.device = device
        self.layer_block_bytes = math.prod(shape[1:]) * grouped[0].element_size()
        self.block_bytes = len(grouped) * self.layer_block_bytes
        """Bytes of one token block of every layer."""
        self.groups = layer_groups(len(grouped), self.layer_block_bytes, max_part_bytes)
        """[first, end) layers of each pool block a token block is stored as."""
        self._part_bytes = [(hi - lo) * self.layer_block_bytes for lo, hi in self.groups]
        self.num_blocks = num_blocks
        self._layers = grouped
        self._word = _common_word(grouped, self.layer_block_bytes)
        rows = [r for t in grouped if (r := _rows(t, self._word)) is not None]
        self._rows = rows if len(rows) == len(grouped) else None
        """Each layer as [blocks, words] when every layer's blocks are contiguous, else None."""
        self._cap = max(1, staging_bytes // self.block_bytes)
        self._stage: torch.Tensor | None = None
        g = grouped[0]  # kernel-split blocks [B, k, H, n, C]: moved as [H, k*n, C], through a second buffer
        self._split = (g.shape[1], g.shape[2], g.shape[3], g.shape[4] * g.element_size()) \
            if g is not layers[0] and g.dim() == 5 else None
        """(k, H, n, bytes of C) of kernel-split blocks, else None."""
        self._ordered: torch.Tensor | None = None

    @property
    def fast(self) -> bool:
        """True when every layer's blocks are contiguous (vectorized gather/scatter); else one copy
        per (block, layer)."""
        return self._rows is not None

    def _staging(self, n: int) -> torch.Tensor:
        """[n, layers, words per layer block] of the reused staging buffer."""
        stage = self._stage
        have = 0 if stage is None else stage.shape[0]
        if stage is None or have < n:
            words = self.layer_block_bytes // _size(self._word)
            rows = min(self._cap, max(n, 2 * have, 8))
            stage = self._stage = torch.empty((rows, len(self._layers), words), dtype=self._word, device=self.device)
        return stage[:n]

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' bytes as [n, layers, words]; a view of the staging buffer, valid until the
        next gather or load."""
        stage = self._staging(len(block_ids))
        if self._rows is not None:
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            for j, rows in enumerate(self._rows):
                torch.index_select(rows, 0, idx, out=stage[:, j])
        else:
            for i, b in enumerate(block_ids):
                for j, t in enumerate(self._layers):
                    stage[i, j].view(t.dtype).view(t.shape[1:]).copy_(t[b])
        return stage if self._split is None else self._reorder(stage, split=False)

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Write `src` ([n, layers, words], as gather returns) into the blocks."""
        if self._split is not None:
            src = self._reorder(src, split=True)
        if self._rows is not None:
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            for j, rows in enumerate(self._rows):
                rows.index_copy_(0, idx, src[:, j])
        else:
            for i, b in enumerate(block_ids):
                for j, t in enumerate(self._layers):
                    t[b].copy_(src[i, j].view(t.dtype).view(t.shape[1:]))

    def _reorder(self, src: torch.Tensor, split: bool) -> torch.Tensor:
        """`src` ([n, layers, words]) with each layer block's kernel blocks interleaved (`split`: from
        `[H, k*n, C]` to `[k, H, n, C]`; else back), in a buffer of its own (valid until the next call)."""
        assert self._split is not None
        k, heads, n, c = self._split
        out = self._ordered
        if out is None or out.shape[0] < src.shape[0]:
            out = self._ordered = torch.empty((self._cap, *src.shape[1:]), dtype=src.dtype, device=src.device)
        out = out[:src.shape[0]]
        kernel_first = (src.shape[0], src.shape[1], k, heads, n, c)
        heads_first = (src.shape[0], src.shape[1], heads, k, n, c)
        to, fro = (kernel_first, heads_first) if split else (heads_first, kernel_first)
        out.view(torch.uint8).view(to).copy_(src.view(torch.uint8).view(fro).transpose(2, 3))
        return out

    def chunks(self, n: int) -> list[range]:
        """Index ranges of at most one staging buffer of blocks each."""
        return [range(s, min(n, s + self._cap)) for s in range(0, n, self._cap)]

    # ----- pool I/O (never raises for a pool failure: HostIO turns it into a miss) --------------

    def _parts(self, stage: torch.Tensor, keys: Sequence[str]) -> tuple[list[str], list[torch.Tensor]]:
        """Pool keys and staging views of `keys`' token blocks (`stage[i]` holds block i), part by part."""
        bufs = [stage[i, lo:hi] for i in range(len(keys)) for lo, hi in self.groups]
        return part_keys(keys, len(self.groups)), bufs

    def save(self, io: HostIO, keys: Sequence[str], block_ids: Sequence[int]) -> int:
        """Store each block under its key; the number stored (0 when the pool is unavailable)."""
        stored = 0
        for r in self.chunks(len(keys)):
            ks, bufs = self._parts(self.gather([block_ids[i] for i in r]), [keys[i] for i in r])
            if not _put(io, ks, bufs):
                break
            stored += len(r)
        return stored

    def load(self, io: HostIO, keys: Sequence[str], block_ids: Sequence[int]) -> int:
        """Read the blocks of `keys` into `block_ids`, in order, stopping at the first block that is
        missing (any part) or of the wrong size: the number of leading blocks written whole."""
        loaded = 0
        n_parts = len(self.groups)
        for r in self.chunks(len(keys)):
            stage = self._staging(len(r))
            ks, bufs = self._parts(stage, [keys[i] for i in r])
            sizes = _get_into(io, ks, bufs)
            bad = next((j for j, n in enumerate(sizes) if n != self._part_bytes[j % n_parts]), len(sizes))
            whole = bad // n_parts
            if whole:
                self.scatter([block_ids[i] for i in r][:whole], stage[:whole])
            loaded += whole
            if whole < len(r):
                if sizes[bad] >= 0:
                    io.once("size", "kvpool: block %s is %d bytes, expected %d (another KV layout under the same "
                            "key?); treated as a miss", ks[bad], sizes[bad], self._part_bytes[bad % n_parts])
                break
        return loaded


def _put(io: HostIO, keys: list[str], bufs: list[torch.Tensor]) -> bool:
    """Store the parts: False when the pool is unavailable."""
    def put(client: PoolClient) -> bool:
        client.batch_put(keys, bufs)
        return True

    return io.call(put, lambda st: False)


def _get_into(io: HostIO, keys: list[str], bufs: list[torch.Tensor]) -> list[int]:
    """Bytes read into each part (-1: a miss), or the pool's status for every part when it cannot answer."""
    return io.call(lambda c: c.batch_get_into(keys, bufs), lambda st: [int(st)] * len(keys))


def _size(word: torch.dtype) -> int:
    return torch.empty((), dtype=word).element_size()


def _byte_rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as [blocks, bytes] (a view: writes land in `t`), or None when a block is not contiguous."""
    if not _block_contiguous(t):
        return None
    flat = t.reshape(t.shape[0], -1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _common_word(layers: Sequence[torch.Tensor], block_bytes: int) -> torch.dtype:
    """The widest integer type every layer's block rows can be viewed as (uint8 when some layer's
    blocks are not contiguous): index_select and index_copy_ run several times faster on int64 rows
    than on bf16 or uint8 ones."""
    rows = [_byte_rows(t) for t in layers]
    for word in _WORDS:
        size = _size(word)
        if all(r is not None and block_bytes % size == 0 and r.data_ptr() % size == 0 and r.stride(0) % size == 0
               for r in rows):
            return word
    return torch.uint8


def _rows(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """`t` as [blocks, words of `word`] (a view), or None when a block is not contiguous."""
    r = _byte_rows(t)
    return None if r is None else r.view(word)


def _block_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True

