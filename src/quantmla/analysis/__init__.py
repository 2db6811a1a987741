"""Analyses of how cache error propagates: the RoPE-vs-content amplification experiment."""
