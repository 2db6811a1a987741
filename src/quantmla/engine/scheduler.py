"""Continuous batching, first come first served, with preemption by recompute.

Each step is either a prefill step (new or preempted sequences, as many as fit) or a decode step (one token
for every running sequence). A decode step that needs a page when none is free preempts the newest running
sequence: its pages and slot go back to the pool and it returns to the front of the queue, where it is
prefilled again, generated tokens included, when pages are free.
"""

from __future__ import annotations

import logging
from collections import deque

from quantmla.engine.block_manager import BlockManager
from quantmla.engine.sequence import Sequence, Status

log = logging.getLogger("quantmla.engine")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill step."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (batch and tokens + len(seq) > self.max_prefill_tokens) or not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(seq)
            tokens += len(seq)
        if batch:
            return batch, True
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.blocks.append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        seq.preemptions += 1
        log.info("preempted %s (%d tokens) to free %d pages", seq.request_id, len(seq), len(seq.block_table))
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues and give its pages back."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
