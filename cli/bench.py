"""Benchmark commands (filled in with the grouped-batching benchmark)."""

COMMANDS: list = []
