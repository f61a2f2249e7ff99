"""One request's state inside the scheduler: a `Request`."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from subway.ipc.messages import SamplingParams, TokenRef
from subway.scheduler.block_manager import TOKEN_TYPE

NEVER = 1 << 62  # a position no request reaches: "no more blocks to key" when caching is off


class RequestStatus(enum.Enum):
    WAITING = 0  # queued, or preempted and queued again; holds no KV blocks
    RUNNING = 1  # admitted: holds KV blocks, gets a prefill chunk or a decode each step
    FINISHED = 2
    COMPILING = 3  # waits for the workers to compile its grammar (`grammars.py`); holds nothing


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler sees it. Plans name it by `seq_id`.

    Token accounting, with `length = len(prompt_ids) + len(output_ids)` (the
    tokens known to the scheduler; `num_tokens` is only ever what one step feeds):

    - `num_computed_tokens`: positions whose KV is written or planned (a sent
      plan covers them), cached prefix included. Reset to 0 by preemption.
    - `num_inflight`: tokens that sent plans sample but whose results have not
      arrived. With overlap, the next plan assumes they exist: the request's
      next input is at position `num_computed_tokens`, and
      `length + num_inflight - num_computed_tokens` tokens are still to be
      fed (1 for a decode, more for a prefill).
    """

    seq_id: int
    request_id: str
    prompt_ids: array  # int32 (TOKEN_TYPE): the garbage collector does not walk arrays
    prompt_ref: TokenRef  # passed to the workers untouched, in NewSeq
    sampling: SamplingParams
    arrival_time: float  # the frontend's time.time()
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    token_limit: int  # finish with "length" at this many tokens (prompt + output)
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"
    output_ids: array = field(default_factory=lambda: array(TOKEN_TYPE))
    status: RequestStatus = RequestStatus.WAITING
    length: int = 0
    num_computed_tokens: int = 0
    num_inflight: int = 0
    num_slots: int = 0  # token slots of its block table (a multiple of the block size)
    sent: bool = False  # NewSeq went out: the workers know this request
    reported: bool = False  # a delta went out (the first one carries num_prompt_tokens)
    scheduled_step: int = -1  # last plan that scheduled it
    admitted_step: int = -1  # last plan that admitted it (from waiting)
    preempted: bool = False  # waiting after a preemption
    num_cached_tokens: int = 0  # prefix-cache hit of the admission that gave the first token
    # Prefix caching: key its blocks when it is scheduled at this position or later (the end
    # of its next unkeyed block); NEVER when caching is off or once it decodes.
    cache_upto: int = NEVER
    first_scheduled_time: float | None = None  # the scheduler's clock at its first admission
    first_token_time: float | None = None  # the scheduler's clock when its first token came
    speculable: bool = False  # speculative decoding may propose drafts for it (no grammar)
    num_draft: int = 0  # draft tokens of its step in flight (it waits for that result)
    handoff: bool = False  # a prefill engine's: lease its blocks when it ends by length
    grammar_key: int = 0  # its grammar's key on the workers (`grammars.py`); 0: none, or inline
    wire_bytes: int = 0  # its NewSeq's encoded size, at most (the planner bounds a plan's)
    lora: int = 0  # its LoRA adapter (`lora.py`); 0: the base model

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
