"""Which protected-row slot each running vLLM request uses.

vLLM's attention metadata names no request, but each request owns its first KV block for as long as it
runs (prefix caching is off for this backend, so no two running requests share a block). A request is
known by that block: it gets a slot the first time it is seen starting at position 0 (a new request, or a
preempted one recomputing from scratch; its prefill rewrites every protected row it will read, so nothing
stale is ever read), and keeps it while it runs.

Finished requests are never announced to the attention backend, so their slots are reclaimed lazily:
when a slot is needed and none is free, the one whose request was seen longest ago is taken. vLLM's
scheduler runs every running request each step (decodes first) and at most max_num_seqs run at once, so
with max_num_seqs slots the oldest one belongs to a finished request.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    """first KV block of a request -> slot in [0, num_slots), least recently seen first."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._by_block: OrderedDict[int, int] = OrderedDict()

    def assign(self, first_blocks: list[int], starts: list[int]) -> list[int]:
        """Slots for one step's requests: first_blocks[i] is request i's block_table[i, 0], starts[i] the
        number of its tokens already cached (0: it starts now and gets a fresh slot).
        Raises RuntimeError for a request that is mid-sequence but has no slot (it started before this
        table existed), or for more requests in one step than slots."""
        if len(set(first_blocks)) != len(first_blocks):
            raise RuntimeError("two requests of one step share their first KV block: quantmla's vLLM backend needs "
                               "prefix caching off")
        if len(first_blocks) > self.num_slots:
            raise RuntimeError(f"{len(first_blocks)} requests in one step, but only {self.num_slots} slots")
        step = set(first_blocks)
        out = []
        for block, start in zip(first_blocks, starts):
            if start == 0:
                self._by_block.pop(block, None)
                out.append(self._take(step))
                self._by_block[block] = out[-1]
            elif block in self._by_block:
                self._by_block.move_to_end(block)
                out.append(self._by_block[block])
            else:
                raise RuntimeError(f"request with first KV block {block} resumes at position {start} but has no "
                                   f"protected slot")
        return out

    def _take(self, step: set[int]) -> int:
        used = set(self._by_block.values())
        free = next((s for s in range(self.num_slots) if s not in used), None)
        if free is not None:
            return free
        for block in self._by_block:  # least recently seen first; never one of this step's requests
            if block not in step:
                return self._by_block.pop(block)
        raise RuntimeError("no protected slot left")  # unreachable: len(step) <= num_slots was checked
