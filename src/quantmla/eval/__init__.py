"""Evaluation helpers for quantmla (synthetic retrieval tasks, quality metrics)."""
