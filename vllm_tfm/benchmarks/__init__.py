"""Benchmarks that run inside vLLM's engine: their logic, behind the thin tools/ commands."""
