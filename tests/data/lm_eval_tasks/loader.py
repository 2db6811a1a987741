"""Datasets of the local lm-eval test tasks, read from the jsonl files beside this file (no hub access)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def code_mc(**kwargs) -> datasets.DatasetDict:  # lm-eval passes the task metadata as keywords
    return _load("code_mc.jsonl")


def needles(**kwargs) -> datasets.DatasetDict:
    return _load("needles.jsonl")
