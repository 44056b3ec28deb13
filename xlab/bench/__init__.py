"""Benchmarks anyone can run: each prints a short table and writes a CSV (`python -m xlab.bench.alloc`)."""
