"""Subway: an LLM serving engine with asynchronous continuous batching."""

__version__ = "0.1.0"
