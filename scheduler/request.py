"""One request's state inside the scheduler: a `Sequence`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from subway.ipc.messages import SamplingParams, TokenRef


class SeqStatus(enum.Enum):
    WAITING = 0  # queued, or preempted and queued again; holds no KV blocks
    RUNNING = 1  # admitted: holds KV blocks, gets a prefill chunk or a decode each step
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the scheduler sees it (one sequence per request).

    Token accounting, with `num_tokens = len(prompt_ids) + len(output_ids)`:

    - `num_computed_tokens`: positions whose KV is written or planned (a sent
      plan covers them). Reset to 0 by preemption.
    - `num_inflight`: tokens that sent plans sample but whose results have not
      arrived. With overlap, the next plan assumes they exist: the sequence's
      next input is at position `num_computed_tokens`, and
      `num_tokens + num_inflight - num_computed_tokens` tokens are still to be
      fed (1 for a decode, more for a prefill).
    """

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    prompt_ref: TokenRef  # passed to the workers untouched, in NewSeq
    sampling: SamplingParams
    arrival_time: float  # the frontend's time.time()
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    token_limit: int  # finish with "length" at this many tokens (prompt + output)
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_tokens: int = 0
    num_computed_tokens: int = 0
    num_inflight: int = 0
    sent: bool = False  # NewSeq went out: the workers know this sequence
    reported: bool = False  # a delta went out (the first one carries num_prompt_tokens)
    scheduled_step: int = -1  # last plan that scheduled it
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_to_feed(self) -> int:
        """Tokens still to be fed to the model before the next sample (1 when decoding)."""
        return self.num_tokens + self.num_inflight - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
