"""Token ids as the scheduler keeps them: int32 arrays (the garbage collector does not walk
arrays), and their raw bytes for the prefix cache's keys."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TOKEN_TYPE = "i"
TOKEN_BYTES = array(TOKEN_TYPE).itemsize


def token_bytes(prompt: Sequence[int], output: Sequence[int], a: int, b: int) -> bytes:
    """The raw int32 bytes of tokens `a:b` of `prompt + output` (arrays; lists are converted)."""
    if type(prompt) is not array:
        prompt = array(TOKEN_TYPE, prompt)
    if type(output) is not array:
        output = array(TOKEN_TYPE, output)
    n = len(prompt)
    if b <= n:
        return prompt[a:b].tobytes()
    if a >= n:
        return output[a - n : b - n].tobytes()
    return prompt[a:].tobytes() + output[: b - n].tobytes()
