"""Checks of what a frontend sends, before the scheduler acts on it.

The frontend validates every HTTP body; the scheduler still trusts nothing that
arrives on a socket. A message that fails here ends its request with "error"
(or is dropped, when it names no request) and is counted as refused.
"""

from __future__ import annotations

import math

from subway.ipc.messages import (
    GRAMMAR_KINDS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    POOLINGS,
    AddRequest,
    SamplingParams,
)

MAX_REQUEST_ID_LEN = 256
MAX_LOGPROBS = 20  # top alternatives per position, as OpenAI allows
# As the frontend's (protocol.py): the sampler divides float32 logits by these, and past
# them a value overflows float32 and turns the logits to NaN (a grammar's mask then fails).
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4


def check_add(msg: AddRequest, vocab_size: int) -> str | None:
    """What is wrong with an AddRequest (before its prompt is read), or None."""
    if not msg.request_id or len(msg.request_id) > MAX_REQUEST_ID_LEN:
        return "request id empty or too long"
    ref = msg.prompt
    n = len(ref.ids) if ref.ids is not None else ref.length
    if n != msg.prompt_len or n <= 0:
        return f"prompt of {n} ids, but prompt_len {msg.prompt_len}"
    if not math.isfinite(msg.arrival_time) or (
        msg.slo_ttft_ms is not None and not math.isfinite(msg.slo_ttft_ms)
    ):
        return "a time that is not a number"
    return check_sampling(msg.sampling, vocab_size)


def check_sampling(sp: SamplingParams, vocab_size: int) -> str | None:
    floats = (sp.temperature, sp.top_p, sp.min_p, sp.presence_penalty, sp.frequency_penalty,
              sp.repetition_penalty)  # fmt: skip
    if not all(math.isfinite(x) for x in floats):
        return "a sampling parameter that is not a finite number"
    if sp.max_tokens < 0 or sp.temperature < 0 or not 0 < sp.top_p <= 1:
        return "max_tokens, temperature or top_p out of range"
    if sp.temperature > MAX_TEMPERATURE:
        return f"temperature above {MAX_TEMPERATURE:g}"
    rep_range = MIN_REPETITION_PENALTY <= sp.repetition_penalty <= MAX_REPETITION_PENALTY
    if sp.top_k < -1 or not 0 <= sp.min_p <= 1 or not rep_range:
        return "top_k, min_p or repetition_penalty out of range"
    for k in (sp.logprobs, sp.prompt_logprobs):
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"logprobs outside [0, {MAX_LOGPROBS}]"
    if sp.stop_token_ids and (min(sp.stop_token_ids) < 0 or max(sp.stop_token_ids) >= vocab_size):
        return "a stop token id outside the vocabulary"
    if not 0 <= sp.min_tokens <= max(sp.max_tokens, 0):
        return "min_tokens outside [0, max_tokens]"
    bias = sp.logit_bias
    if bias:
        if len(bias) > MAX_LOGIT_BIAS:
            return f"more than {MAX_LOGIT_BIAS} logit_bias entries"
        if min(bias) < 0 or max(bias) >= vocab_size:
            return "a logit_bias token id outside the vocabulary"
        if not all(math.isfinite(b) and -100.0 <= b <= 100.0 for b in bias.values()):
            return "a logit_bias value outside [-100, 100]"
    if sp.pooling and (sp.pooling not in POOLINGS or sp.max_tokens != 1):
        return "pooling of an unknown kind, or with max_tokens other than 1"
    g = sp.grammar
    if g is not None and (g.kind not in GRAMMAR_KINDS or len(g.spec) > MAX_GRAMMAR_CHARS):
        return "a grammar of an unknown kind or too long"
    return None


def ids_in_vocab(ids: list[int], vocab_size: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)
