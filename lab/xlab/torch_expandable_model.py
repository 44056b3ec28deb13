"""PyTorch's CUDA caching allocator under `expandable_segments:True`, modelled on the host for replays (issue #49).

Read from c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.h of pytorch/pytorch at commit
001074d25084fdb87a799823e395a50f5ec044d3 (AllocatorConfig.h at 007b9bc026a6844ce406a10aa8820a466cf2d770); the GPU
rows it is checked against ran torch 2.11.0 (`data/dynamic_shapes.csv`, arm cupy_torch_expandable: the allocator
serving CuPy, each request a `torch.empty(n, dtype=uint8)` on PyTorch's current stream, xlab.allocators.CupyTorch).
What the model keeps of it, with the defaults (no PYTORCH_CUDA_ALLOC_CONF key but expandable_segments):

- round_size: a request of n bytes takes max(512, n rounded up to 512) (kMinBlockSize; roundup_power2_divisions is
  empty by default, so no power-of-two rounding). A request of 0 bytes takes no block (the allocator's allocate()
  returns a null pointer without calling malloc).
- get_pool: a rounded size <= 1 MiB (kSmallSize) is served by the small pool, the rest by the large pool; each pool
  has its own expandable segment per (device, stream), a reserved address range of 9/8 of the GPU's memory
  (find_expandable_block) into which pages are mapped: 2 MiB pages for the small pool (kSmallBuffer), 20 MiB for the
  large (kLargeBuffer; the segment_size_ of ExpandableSegment). get_allocation_size (2 MiB, 20 MiB below
  kMinLargeAlloc = 10 MiB, else rounded to 2 MiB: kRoundLarge) sizes cudaMalloc segments only; alloc_block passes
  the rounded request itself (p.size()) to try_allocate_expandable_block, so an expandable miss maps the pages that
  cover the request, not an allocation size.
- get_free_block: best fit, the free mapped block of the least (size, address) >= the request
  (BlockComparatorSize), except that a block whose next block is unmapped (the free block at the top of the mapped
  part: the "tail") counts as its size plus the unmapped space after it (expandable_size): when the best fit is the
  tail, the next block in (size, address) order is taken if there is one. max_split_size is unlimited by default,
  so its two refusals (an oversize block for a small request, a block more than kLargeBuffer past a large request)
  never act; max_non_split_rounding_size likewise.
- should_split: with expandable segments a block is split whenever 512 B or more would remain, in both pools (the
  20 MiB / kSmallSize rule is for cudaMalloc segments); the request takes the block's low end, the rest stays free.
- a miss (alloc_block -> try_allocate_expandable_block): the lowest unmapped range, starting from the free block
  just below it where there is one (the tail), mapped up to the page that covers the request (map_block: one
  num_device_alloc per call; one call per miss here), merged with the tail, then split as a hit is.
- free_block: the block merges with its free mapped neighbours (try_merge_blocks; never with the unmapped range).
- reserved_bytes: the bytes mapped, both pools together (map_block adds the mapped range; nothing is unmapped
  short of emptyCache or an out-of-memory retry, neither of which a replay without a cap reaches). Its peak is
  what `reserved_bytes.all.peak` reports; requested_bytes counts the requests' own sizes.

Not modelled: other streams' uses (record_stream events), CUDA graph pools, the memory fraction and out-of-memory
paths (release_cached_blocks unmapping whole free pages), IPC, garbage collection (off by default).

The same model with other settings gives scheme expandable's variants (cupy_default_study --variants): one pool
for every size with 2 MiB pages and the tail taken as any other block (`ExpandableModel(small_pool=False,
large_page=2 MiB, tail_last=False)`) is xpool's scheme expandable itself (its peaks and maps equal the product's
over the twin: tests/lab/test_torch_expandable_model.py), so each setting changed from there isolates one of
PyTorch's rules.
"""
from __future__ import annotations

import bisect

from xlab import memory_study as ms

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: the largest request of the small pool
SMALL_PAGE = 2 << 20            # kSmallBuffer: the small pool's segment_size_
LARGE_PAGE = 20 << 20           # kLargeBuffer: the large pool's segment_size_
# the GPU's memory (cudaGetDeviceProperties' totalGlobalMem), about an H200's: only the reserved range's length (9/8
# of it) depends on it, which decides nothing unless a replay maps more than that or it ties the tail's comparison
TOTAL_MEMORY = 140 << 30


def round_size(nbytes: int) -> int:
    """round_size with the default settings: at least 512 B, a multiple of 512 B."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


class _Segment:
    """One expandable segment: free mapped blocks by (size, start) and by address, the mapped part [base, top)."""

    def __init__(self, base: int, page: int, reach: int):
        self.base, self.top, self.page, self.limit = base, base, page, base + reach
        self.by_size = []            # sorted (size, start) of the free mapped blocks
        self.end = {}                # start -> end of each free block
        self.start = {}              # end -> start of each free block

    def _add(self, start: int, end: int) -> None:
        if start < end:
            bisect.insort(self.by_size, (end - start, start))
            self.end[start], self.start[end] = end, start

    def _remove(self, start: int) -> int:
        end = self.end.pop(start)
        del self.start[end]
        del self.by_size[bisect.bisect_left(self.by_size, (end - start, start))]
        return end

    def find(self, size: int, tail_last: bool):
        """get_free_block: the start of the block chosen for `size`, or None."""
        i = bisect.bisect_left(self.by_size, (size, -1))
        if i == len(self.by_size):
            return None
        length, start = self.by_size[i]
        if tail_last:
            # expandable_size(b) = b->size + the unmapped block after it, if any: only the tail has one
            grow = lambda s, n: n + (self.limit - self.top if s + n == self.top else 0)   # noqa: E731
            while i + 1 < len(self.by_size) and grow(*self.by_size[i + 1][::-1]) < grow(start, length):
                i += 1
                length, start = self.by_size[i]
        return start

    def take(self, start: int, size: int) -> None:
        """alloc_found_block: the block at `start` cut to `size` from its low end, the rest left free."""
        end = self._remove(start)
        self._add(start + size, end)                # should_split: remaining >= 512 B (sizes are multiples)

    def grow(self, size: int) -> tuple[int, int]:
        """try_allocate_expandable_block: (start, bytes mapped) of a block of `size` at the top, from the tail."""
        start = self.start.get(self.top, self.top)
        if start != self.top:
            self._remove(start)
        need = start + size - self.top
        mapped = -(-need // self.page) * self.page
        if self.top + mapped > self.limit:
            raise MemoryError("the replay maps more than the expandable segment's reserved range")
        self.top += mapped
        self._add(start + size, self.top)
        return start, mapped

    def give(self, start: int, size: int) -> None:
        """free_block: the block merged with its free neighbours."""
        end = start + size
        if end in self.end:
            end = self._remove(end)
        if start in self.start:
            s = self.start[start]
            self._remove(s)
            start = s
        self._add(start, end)


class ExpandableModel(ms.CupyPoolModel):
    """PyTorch's expandable segments (the defaults: small_pool, 2 MiB small pages, 20 MiB large pages, tail_last),
    or a variant of them; a CupyPoolModel by its interface alone (what memory_study._drive and _counters read),
    none of its behaviour. Per device: requests, device_mallocs (maps), peak_requested, peak_reserved."""

    def __init__(self, small_pool: bool = True, small_page: int = SMALL_PAGE, large_page: int = LARGE_PAGE,
                 tail_last: bool = True, total_memory: int = TOTAL_MEMORY):
        self.small_pool, self.small_page, self.large_page = small_pool, small_page, large_page
        self.tail_last = tail_last
        # the address space each segment reserves: 9/8 of the GPU's memory in whole pages (find_expandable_block)
        self.reach = {p: -(-(total_memory + total_memory // 8) // p) * p for p in (small_page, large_page)}
        self.segments = {}
        self.requests, self.device_mallocs, self.peak_requested, self.peak_reserved = {}, {}, {}, {}
        self.requested, self.reserved = {}, {}

    def _segment(self, device: int, stream: int, small: bool) -> _Segment:
        key = (device, stream, small)
        if key not in self.segments:
            page = self.small_page if small else self.large_page
            self.segments[key] = _Segment((len(self.segments) + 1) << 48, page, self.reach[page])
        return self.segments[key]

    def allocate(self, nbytes: int, device: int = 0, stream: int = 0):
        for d in (self.requests, self.device_mallocs, self.peak_requested, self.peak_reserved, self.requested,
                  self.reserved):
            d.setdefault(device, 0)
        self.requests[device] += 1
        if nbytes == 0:                             # no block: a null pointer
            return None
        size = round_size(nbytes)
        seg = self._segment(device, stream, self.small_pool and size <= SMALL_SIZE)
        start = seg.find(size, self.tail_last)
        if start is not None:
            seg.take(start, size)
        else:
            start, mapped = seg.grow(size)
            self.device_mallocs[device] += 1
            self.reserved[device] += mapped
            self.peak_reserved[device] = max(self.peak_reserved[device], self.reserved[device])
        self.requested[device] += nbytes
        self.peak_requested[device] = max(self.peak_requested[device], self.requested[device])
        return device, seg, start, size, nbytes

    def free_chunk(self, handle) -> None:
        if handle is None:
            return
        device, seg, start, size, nbytes = handle
        self.requested[device] -= nbytes
        seg.give(start, size)


def torch_expandable() -> ExpandableModel:
    """PyTorch's expandable segments with the default settings."""
    return ExpandableModel()


# scheme expandable's variants (cupy_default_study --variants): what each changes from the product, which is
# ExpandableModel(small_pool=False, large_page=2 MiB, tail_last=False) exactly
VARIANTS = {
    "expandable_model": dict(small_pool=False, large_page=SMALL_PAGE, tail_last=False),
    "expandable_small_pool": dict(small_pool=True, large_page=SMALL_PAGE, tail_last=False),
    "expandable_tail_last": dict(small_pool=False, large_page=SMALL_PAGE, tail_last=True),
    # both: PyTorch's rules with 2 MiB pages in the large pool too
    "expandable_small_pool_tail_last": dict(small_pool=True, large_page=SMALL_PAGE, tail_last=True),
    "torch_expandable_one_pool": dict(small_pool=False, large_page=LARGE_PAGE, tail_last=True),
}
