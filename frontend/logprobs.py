"""Logprobs, from the engine's numbers to each API's shape: the one place that renders them.

The engine sends, per sampled token, its logprob and the top alternatives as
ids and floats (`RequestDelta`, `PromptLogprobs`); `token_logprobs` and
`prompt_token_logprobs` turn them into `TokenLogprob`s as tokens are
detokenized (`choices.py`). `completion_logprobs`, `chat_logprobs` and
`native_logprobs` render those for `/v1/completions`, `/v1/chat/completions`
and the native ZMQ endpoint. NaN (not computed) is None in JSON; -inf is
clamped as vLLM does.

A token's text is decoded once per tokenizer and kept (`token_text`: at most one
entry per vocabulary id), so rendering k top logprobs costs k dictionary lookups,
not k decodes. Renderings of many entries (a prompt's logprobs with `echo`) run
on a thread (`render`), so that the event loop does no work that grows with the
prompt; `rendered_size` is what an answer's byte limit counts for them.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from subway.frontend.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from subway.ipc.messages import PromptLogprobs, RequestDelta

T = TypeVar("T")
OFFLOAD_ENTRIES = 256  # renderings of more entries (tokens x (1 + top)) run on a thread
_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def _finite(x: float) -> float | None:
    """Logprobs as JSON takes them."""
    if math.isnan(x):
        return None
    return max(x, -9999.0)


def token_logprobs(delta: RequestDelta, n: int) -> list[TokenLogprob] | None:
    if delta.logprobs is None:
        return None
    out = []
    for i in range(n):
        top_ids = delta.top_ids[i] if delta.top_ids else []
        top_lps = delta.top_logprobs[i] if delta.top_logprobs else []
        top = [(t, _finite(v)) for t, v in zip(top_ids, top_lps, strict=False)]
        out.append(TokenLogprob(delta.token_ids[i], _finite(delta.logprobs[i]), top))
    return out


def prompt_token_logprobs(
    prompt_ids: list[int], plp: PromptLogprobs | None
) -> list[TokenLogprob] | None:
    """One entry per prompt token; the first has no logprob (nothing comes before it)."""
    if plp is None:
        return None
    out = [TokenLogprob(prompt_ids[0], None, None)]
    for j, token_id in enumerate(prompt_ids[1:]):
        lp = _finite(plp.logprobs[j]) if j < len(plp.logprobs) else None
        ids = plp.top_ids[j] if j < len(plp.top_ids) else []
        vals = plp.top_logprobs[j] if j < len(plp.top_logprobs) else []
        top = [(t, _finite(v)) for t, v in zip(ids, vals, strict=False)]
        out.append(TokenLogprob(token_id, lp, top if lp is not None else None))
    return out


def token_text(tokenizer, token_id: int) -> str:
    """`tokenizer.decode([token_id])`, cached per tokenizer."""
    try:
        texts = _texts[tokenizer]
    except KeyError:
        texts = _texts[tokenizer] = {}
    except TypeError:  # not weak-referenceable: no cache
        return tokenizer.decode([token_id])
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = tokenizer.decode([token_id])
    return text


def entries(lps: list[TokenLogprob] | None) -> int:
    """How many token texts rendering `lps` takes: each token and its alternatives."""
    return sum(1 + len(lp.top or ()) for lp in lps or ())


async def render(fn: Callable[..., T], count: int, *args) -> T:
    """`fn(*args)`, a rendering of `count` entries: on a thread when they are many, so
    that the event loop never renders a prompt's worth of logprobs."""
    if count > OFFLOAD_ENTRIES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def rendered_size(lp) -> int:
    """About how many bytes a rendered `CompletionLogprobs` or `ChatLogprobs` takes as
    JSON: the UTF-8 of its token texts (a chat entry's twice: the text and its `bytes`,
    counted at 4 a byte), and 24 for each number and its punctuation."""
    if isinstance(lp, CompletionLogprobs):
        size = sum(_utf8_len(t) + 48 for t in lp.tokens)
        for top in lp.top_logprobs:
            size += sum(_utf8_len(t) + 28 for t in top or ())
        return size
    size = 0
    for c in lp.content or ():
        size += 5 * _utf8_len(c.token) + 64
        size += sum(5 * _utf8_len(t.token) + 48 for t in c.top_logprobs)
    return size


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs; `offset`: where these tokens' text starts in the choice.

    As OpenAI's (and vLLM's): `top_logprobs` holds the top alternatives and the
    chosen token; a token without a logprob (a prompt's first) has None for both.
    """
    out = CompletionLogprobs()
    for lp in lps:
        token = token_text(tokenizer, lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        if lp.logprob is None or lp.top is None:
            out.top_logprobs.append(None)
        else:
            top = {token_text(tokenizer, t): v for t, v in lp.top}
            top.setdefault(token, lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float | None) -> TopLogprob:
        token = token_text(tokenizer, token_id)
        value = -9999.0 if logprob is None else logprob
        return TopLogprob(token=token, logprob=value, bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **top(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[top(t, v) for t, v in (lp.top or [])],
            )
            for lp in lps
        ]
    )


def native_logprobs(lps: list[TokenLogprob]) -> list[float]:
    """The native endpoint's: one float per token, NaN where there is none."""
    return [lp.logprob if lp.logprob is not None else math.nan for lp in lps]
