"""Logprobs, from the engine's numbers to each API's shape: the one place that renders them.

The engine sends, per sampled token, its logprob and the top alternatives as
ids and floats (`RequestDelta`, `PromptLogprobs`); `token_logprobs` and
`prompt_token_logprobs` turn them into `TokenLogprob`s as tokens are
detokenized (`choices.py`). `completion_logprobs`, `chat_logprobs` and
`native_logprobs` render those for `/v1/completions`, `/v1/chat/completions`
and the native ZMQ endpoint. NaN (not computed) is None in JSON; -inf is
clamped as vLLM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from subway.frontend.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from subway.ipc.messages import PromptLogprobs, RequestDelta


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


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs; `offset`: where these tokens' text starts in the choice.

    As OpenAI's (and vLLM's): `top_logprobs` holds the top alternatives and the
    chosen token; a token without a logprob (a prompt's first) has None for both.
    """
    out = CompletionLogprobs()
    for lp in lps:
        token = _token_text(tokenizer, lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        if lp.logprob is None or lp.top is None:
            out.top_logprobs.append(None)
        else:
            top = {_token_text(tokenizer, t): v for t, v in lp.top}
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
        token = _token_text(tokenizer, token_id)
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
