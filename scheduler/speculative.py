"""Speculative decoding, the scheduler's side: the configuration and the n-gram proposer.

Prompt lookup (n-gram) speculation needs no draft model. For a decoding
request the scheduler looks for the last `n` tokens (`prompt_lookup_max` down
to `prompt_lookup_min`) earlier in the request's own tokens, prompt and output;
at the most recent earlier match, the tokens that followed are the draft, at
most `num_speculative_tokens` of them. The search looks at the last
`LOOKUP_WINDOW` tokens only, so that a step's proposal costs the same however
long the request: O(window x match length), vectorised, whatever the tokens. The draft rides in the request's
`SeqStep` (`draft`): the worker feeds the last token and the draft in one
forward pass, samples every position, and keeps the longest run of draft
tokens that match what it sampled, plus the one token it sampled after that run
(see `worker/speculative.py`). So each step gives 1 to K + 1 tokens.

Planning around it (`planner.py`):

- a step that carries a draft gets `1 + K` KV slots and `1 + K` tokens of the
  budget; when its result comes, the request keeps the slots of the tokens it
  accepted and gives the rest back (`BlockManager.trim`);
- the scheduler proposes only from tokens it knows, so a request speculates
  only when nothing of it is in flight: while speculation is on, such a
  request waits for its previous step's result instead of being overlapped
  (the loop is then synchronous for it), and a request whose draft is in
  flight always waits (its next position depends on what was accepted);
- speculation is off for a step when more than `disable_by_batch_size`
  requests run: there verification costs more than it saves, and the step
  loop overlaps as without it. Requests with a grammar never speculate.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass

import numpy as np

from subway.scheduler.block_manager import TOKEN_BYTES, TOKEN_TYPE

METHODS = ("ngram",)
# Tokens searched for a match, the most recent ones. An editing prompt's text to copy
# sits within a few thousand tokens of the end; a whole-context search cost ~0.35 ms a
# step at 100k tokens (35 ms with ids chosen to match across token boundaries).
LOOKUP_WINDOW = 8192
_TOKEN_DTYPE = np.dtype(f"i{TOKEN_BYTES}")


class SpeculativeConfigError(ValueError):
    """`--speculative-config` cannot be used as given."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, spelled as vLLM spells it."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Speculate only while at most this many requests run (vLLM's field; its default is
    # "always"). Measured (docs/bench/log/2026-12-speculative-decoding.md, the sweep): drafts
    # at every batch size gave 1.4x at 4 and 8 at once on a repetitive workload, and broke
    # even there at 16.
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The config in `text` (JSON), None for an empty one; SpeculativeConfigError if bad."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        method = raw.get("method", "ngram")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"--speculative-config: method {method!r} is not supported (only: ngram)"
            )
        ints = {}
        for name in known - {"method"}:
            if name in raw:
                value = raw[name]
                if type(value) is not int:
                    raise SpeculativeConfigError(f"--speculative-config: {name} must be an integer")
                ints[name] = value
        cfg = cls(method=method, **ints)
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise SpeculativeConfigError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max <= 64:
            raise SpeculativeConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if cfg.disable_by_batch_size < 1:
            raise SpeculativeConfigError("disable_by_batch_size must be at least 1")
        return cfg


def propose(prompt: array, output: array, k: int, max_n: int, min_n: int) -> list[int]:
    """At most `k` draft tokens for the sequence `prompt + output` (int32 arrays): the
    tokens that followed the most recent earlier occurrence of its last `n` tokens, for
    the largest `n` in `max_n .. min_n` that occurs; [] when none does. Only the last
    `LOOKUP_WINDOW` tokens are searched."""
    if k <= 0 or len(prompt) + len(output) < min_n + 1:
        return []
    w = _window(prompt, output, LOOKUP_WINDOW)
    size = len(w)
    # matched[e]: how many tokens ending at e match the sequence's last ones (up to max_n),
    # for every e that has a token after it; grown one token back per round, while any does.
    ends = size - 1
    matched = np.zeros(ends, dtype=np.int32)
    alive = np.ones(ends, dtype=bool)
    for j in range(min(max_n, ends)):
        alive[j:] &= w[: ends - j] == w[size - 1 - j]
        alive[:j] = False  # no token j back from these
        if not alive.any():
            break
        matched += alive
    n = int(matched.max(initial=0))
    if n < min_n:
        return []
    end = int(np.flatnonzero(matched >= n)[-1])
    return w[end + 1 : end + 1 + k].tolist()


def _window(prompt: array, output: array, size: int) -> np.ndarray:
    """The last `size` tokens of `prompt + output`, copied (no buffer of the request's
    arrays stays exported: they grow)."""
    tail = output[-size:] if output else array(TOKEN_TYPE)
    rest = size - len(tail)
    if rest > 0:
        tail = prompt[-rest:] + tail
    return np.frombuffer(tail, dtype=_TOKEN_DTYPE)
