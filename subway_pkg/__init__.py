"""Subway: an LLM serving engine with asynchronous continuous batching.

`from subway import LLM` is the offline entry point (`subway.llm`); it is
imported on first use, so that the frontend's and the scheduler's processes,
which never run a model, do not import torch.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "Output"):
        from subway import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'subway' has no attribute {name!r}")
