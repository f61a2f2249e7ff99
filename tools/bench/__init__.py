"""Benchmark, profiling and baseline scripts; the launcher stays in subway.tools."""
