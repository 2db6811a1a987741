"""A request inside the engine: its tokens, its place in the KV pool, and its timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from quantmla.engine.sampler import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """token_ids = prompt ++ generated. After a preemption the whole of it is prefilled again (recompute).

    block_table: pool blocks holding positions [i * P, (i + 1) * P); slot: its protected BF16 rows in every
    layer's cache (-1 while waiting).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
