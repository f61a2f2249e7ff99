"""The message contract between Subway's processes.

Every message that crosses a socket is one of the structs below, encoded with
msgspec as MessagePack. Each socket direction has its own tagged union, so a
receiver decodes exactly the messages it may get and nothing else.

    frontend  -> scheduler : ToScheduler   (AddRequest, AbortRequest, FrontendHello, FrontendAlive,
                                            ReleaseKv, AddLora, RemoveLora)
    workers   -> scheduler : FromWorker    (WorkerReady, StepResult, WorkerError, KvImported, GrammarReady)
    scheduler -> workers   : ToWorker      (Plan, Shutdown, KvImport, GrammarPrepare, GrammarRelease)
    decode worker <-> prefill worker, across hosts: KvFetch, KvBlocks and raw frames
    scheduler -> frontend  : ToFrontend    (EngineReady, Deltas, EngineError)

Token ids travel as a `TokenRef`: an offset and a length into a shared-memory
token buffer on one host, or the ids inline when the processes are on
different hosts (or the buffer is full).
"""

from __future__ import annotations

import msgspec

from subway.ipc.grammar_messages import (  # noqa: F401 - part of the contract, re-exported
    GRAMMAR_KINDS,
    JSON_OBJECT_SCHEMA,
    MAX_GRAMMAR_CHARS,
    Grammar,
    GrammarPrepare,
    GrammarReady,
    GrammarRelease,
    grammar_key,
)
from subway.ipc.kv_messages import (  # noqa: F401 - part of the contract, re-exported
    LEASE_S,
    KvBlocks,
    KvFetch,
    KvImport,
    KvImported,
    KvLayout,
    KvLease,
    ReleaseKv,
)
from subway.ipc.lora_messages import AddLora, LoraAdapter, RemoveLora


class TokenRef(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a run of token ids lives: `ids` inline, or `length` ids at `offset` in a shm buffer."""

    offset: int = -1
    length: int = 0
    ids: list[int] | None = None


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias, at most (OpenAI: 300)
POOLINGS = ("last", "mean")  # SamplingParams.pooling: of the prompt's final hidden states
MAX_EMBEDDING_BYTES = 4 << 16  # an embedding: float32, 65,536 dimensions at most
MAX_EXPERTS = 1 << 12  # a mixture of experts' experts a layer, as a worker reports them


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling and stopping rules that the scheduler and the workers need.

    Stop *strings* are the frontend's business (they need text); everything
    decided on token ids is here.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per sampled token; None: off
    # Number of top logprobs per prompt position (prefill); None: off. The worker
    # then also returns the logprob of every prompt token but the first.
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, each in
    # [-100, 100]); logprobs stay those of the raw logits.
    logit_bias: dict[int, float] = {}
    # EOS and stop_token_ids cannot be sampled before this many tokens are generated
    # (and the frontend matches no stop string before then), as vLLM's min_tokens.
    min_tokens: int = 0
    grammar: Grammar | None = None  # constrain the output (rank 0 masks the logits)
    # "last" or "mean": an embedding request (`worker/pooling.py`, max_tokens 1): its
    # prompt's final hidden states, pooled, come back with its one token.
    pooling: str = ""


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprobs of prompt tokens 1..n-1, each given the tokens before it (prefill positions).

    `logprobs[j]` is the logprob of prompt token j+1; `top_ids[j]`/`top_logprobs[j]` the
    top alternatives at that position. An entry is NaN where the worker did not compute
    the position (a prefix it found in the cache).
    """

    logprobs: list[float]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


# ---------------------------------------------------------------- frontend -> scheduler


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    request_id: str
    prompt: TokenRef
    prompt_len: int
    sampling: SamplingParams
    arrival_time: float  # time.time() at the frontend
    priority: int = 0  # lower is served first
    slo_ttft_ms: float | None = None
    slo_class: str = "interactive"  # or "batch"
    # Disaggregation. `handoff` (to a prefill engine): lease the prompt's blocks when the
    # request ends by its length (its `max_tokens` is 1 there); the last delta names the
    # lease. `kv_source` (to a decode engine): copy those blocks into this engine's prefix
    # cache before the request is queued; on any failure it recomputes them.
    handoff: bool = False
    kv_source: KvLease | None = None
    lora: int = 0  # the LoRA adapter's id (`LoraAdapter`); 0: the base model


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class FrontendHello(msgspec.Struct, tag="hello"):
    """Sent by a frontend when it starts; the scheduler answers with EngineReady once it is.

    `pid` and `host` name the frontend: its death is judged by them (and by its
    heartbeat), never by a socket disconnect, which anyone can cause on a tcp port.
    `prompt_shm` names this frontend's prompt buffer (each frontend makes its own).
    """

    pid: int
    host: str = ""
    prompt_shm: str = ""


class FrontendAlive(msgspec.Struct, tag="alive"):
    """A frontend's heartbeat, every `FRONTEND_HEARTBEAT_S`."""

    pid: int
    host: str = ""


FRONTEND_HEARTBEAT_S = 1.0

ToScheduler = (
    AddRequest | AbortRequest | FrontendHello | FrontendAlive | ReleaseKv | AddLora | RemoveLora
)


# ---------------------------------------------------------------- workers -> scheduler


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    pid: int
    num_blocks: int  # KV blocks this rank can hold (the scheduler takes the minimum)
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    sampled_shm: str | None = None  # rank 0: name of the shm buffer it writes sampled ids to
    host: str = ""  # with `pid`: how the scheduler judges this worker's death
    device: str = ""  # where it runs the model: "cpu" or "cuda" (empty: not said)
    # Its KV groups' windows (ipc/kv_groups.py; empty: one global group): a page per group
    # for each block, `num_blocks` pages in all.
    kv_windows: list[int] = []


class StepResult(msgspec.Struct, tag="result", omit_defaults=True):
    """Rank 0's answer to plan `step`: one sampled token per sequence that sampled, in plan order."""

    step: int
    seq_ids: list[int]
    tokens: TokenRef
    # For each sampled token, when logprobs were asked: its logprob, top ids and top logprobs.
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    forward_time: float = 0.0  # seconds the worker spent on the step
    idle_time: float = 0.0  # seconds the worker waited for this plan after the previous step
    # Per sampled sequence, on its first sampled token when SamplingParams.prompt_logprobs asked.
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # Per sampled sequence, on its first sampled token when SamplingParams.pooling asked: the
    # pooled hidden state, float32 little-endian (None: the prompt was not all computed).
    embeddings: list[bytes | None] | None = None
    # The step failed for these sequences (the worker dropped them and serves on): each of
    # their requests ends with finish_reason "error"; `error` says why (for the log).
    failed: list[int] = []
    error: str = ""
    # Messages this worker refused since it started (malformed or unexpected).
    rejected_total: int = 0
    # Speculative decoding: tokens per sequence in `seq_ids` order (1 to 1 + its draft's
    # length), `tokens` and the per-token logprobs then hold each one's run in turn; empty
    # when every sequence has one token.
    num_tokens: list[int] = []
    # LoRA: adapters this worker has read from disk and dropped from memory since it started.
    lora_loads_total: int = 0
    lora_evictions_total: int = 0
    lora_memory_bytes: int = 0  # its adapter slots and the adapters it keeps loaded
    # A mixture of experts: tokens routed to each expert since start, summed over layers.
    moe_expert_tokens: list[int] = []


class WorkerError(msgspec.Struct, tag="worker_error"):
    rank: int
    message: str


FromWorker = WorkerReady | StepResult | WorkerError | KvImported | GrammarReady


# ---------------------------------------------------------------- scheduler -> workers


class NewSeq(msgspec.Struct, array_like=True, omit_defaults=True):
    """A sequence's full state, sent once, on first sight."""

    seq_id: int
    prompt: TokenRef
    sampling: SamplingParams
    lora: int = 0  # its LoRA adapter (`Plan.loras`); 0: none


class SeqStep(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's part of a step.

    The sequence brings `num_tokens` new tokens at positions
    `start_pos .. start_pos + num_tokens - 1`; the worker takes them from its own
    copy of the sequence's tokens (prompt, then every token it sampled). The
    KV cache already holds positions `0 .. start_pos - 1`. `new_blocks` are
    appended to the worker's block table for the sequence. When `sample` is
    set (a decode, or the last chunk of a prefill), the worker samples the
    next token from the last position.

    Speculative decoding: a decode may carry a `draft` of proposed tokens; the
    step then feeds `num_tokens = 1 + len(draft)` tokens (its own last token,
    then the draft), samples every position and keeps the longest run of the
    draft that it sampled too, plus the next token it sampled (`StepResult.num_tokens`).
    """

    seq_id: int
    start_pos: int
    num_tokens: int
    new_blocks: list[int] = []
    sample: bool = True
    draft: list[int] = []


class Plan(msgspec.Struct, tag="plan", omit_defaults=True):
    step: int
    seqs: list[SeqStep]
    new_seqs: list[NewSeq] = []
    # Sequences to forget (finished or aborted): the worker drops their state.
    finished: list[int] = []
    # Sequences preempted by recompute: the worker clears their block tables
    # but keeps their tokens; they return later with start_pos 0 (or a cached prefix).
    preempted: list[int] = []
    # Set when the frontend's prompt buffer changed (a new frontend): the worker reads
    # prompts in shared memory from this buffer from this plan on.
    prompt_shm: str = ""
    # LoRA adapters served from this plan on, and those no longer served (no sequence of
    # theirs is left): the workers load the first when a sequence needs them.
    loras: list[LoraAdapter] = []
    loras_removed: list[int] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToWorker = Plan | Shutdown | KvImport | GrammarPrepare | GrammarRelease


# ---------------------------------------------------------------- scheduler -> frontend


class EngineReady(msgspec.Struct, tag="engine_ready"):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    pid: int = 0  # the scheduler's, with `host`: how the frontend judges its death
    host: str = ""
    engine_id: int = 0  # its data-parallel rank: a frontend refuses an engine it did not expect


KV_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)  # seconds; +Inf implied


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since the last delta; `finish_reason` set on its last delta."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # On a request's first delta: its prompt's logprobs, when SamplingParams.prompt_logprobs asked.
    prompt_logprobs: PromptLogprobs | None = None
    # On a request's first delta: seconds from arrival to its first scheduled step, if known.
    queue_time: float | None = None
    # A prefill engine's last delta of a `handoff` request: the blocks it holds for a decode
    # engine to copy.
    kv_lease: KvLease | None = None
    # With finish_reason "error", when the request itself is the cause (its grammar did not
    # compile on the worker, or not in time): why, for the client (a 400, not a 500).
    error: str = ""
    # On a request's first delta, when SamplingParams.pooling asked: its embedding (as
    # StepResult.embeddings).
    embedding: bytes | None = None


class EngineStats(msgspec.Struct, omit_defaults=True):
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    # Of those, the ones a plan has passed over (no seat, no blocks, preempted): the queue
    # that admission control counts. A request added since the last plan is not in it yet:
    # with a plan in flight it may only be waiting for the next one, a free seat its own.
    num_queued: int = 0
    num_preempted_total: int = 0
    batch_size: int = 0
    num_batched_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # cached blocks no live request holds: evictable, so also free
    kv_blocks_free: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    scheduler_time: float = 0.0  # seconds spent planning the last step
    worker_idle_time: float = 0.0  # seconds the workers waited for the last plan
    step_time: float = 0.0
    predicted_step_time: float = 0.0  # the step cost model's figure for that step, beforehand
    # Running totals since start, for rates and fractions over any interval:
    num_steps_total: int = 0
    worker_busy_time_total: float = 0.0  # seconds rank 0 spent running steps
    worker_idle_time_total: float = 0.0  # seconds rank 0 waited for a plan between steps
    scheduler_time_total: float = 0.0  # seconds spent in schedule()
    ipc_rejected_total: int = 0  # messages the scheduler and the workers refused
    # SLO-aware scheduling (`--policy edf`): running requests preempted for a waiting one,
    # steps a waiting chat waited (its slack allowed) instead, steps the TPOT cap shrank.
    num_displaced_total: int = 0
    slo_waits_total: int = 0
    chunk_capped_steps_total: int = 0
    pooling_limited_steps_total: int = 0  # steps --pooling-share held pooled prompts back
    # Speculative decoding: steps that carried a draft, draft tokens proposed, and accepted.
    spec_num_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # Disaggregation: blocks copied in from prefill engines, copies that failed (recomputed),
    # and the copies' durations as cumulative counts over KV_TRANSFER_BUCKETS.
    kv_transfer_blocks_total: int = 0
    kv_transfer_failures_total: int = 0
    kv_transfer_count: int = 0
    kv_transfer_seconds_sum: float = 0.0
    kv_transfer_buckets: list[int] = []
    kv_leases: int = 0  # prefill engines: leases held now
    kv_leases_expired_total: int = 0
    # LoRA: adapters served, the number of requests (running or waiting) of each by id, and
    # rank 0's loads from disk and evictions from memory.
    lora_adapters: int = 0
    lora_requests: dict[int, int] = {}
    lora_loads_total: int = 0
    lora_evictions_total: int = 0
    lora_memory_bytes: int = 0  # rank 0's adapter slots and loaded adapters
    moe_expert_tokens_total: list[int] = []  # per expert, summed over layers (rank 0's)


class Deltas(msgspec.Struct, tag="deltas", omit_defaults=True):
    """A turn's deltas, the engine's stats, and (with several engines) the content digests
    (`ipc/prefix.py`) its prefix cache gained and lost since the last; `cache_reset`: the
    digests are the whole cache (sent to a frontend that says hello)."""

    deltas: list[RequestDelta]
    stats: EngineStats | None = None
    cache_stored: list[int] = []
    cache_removed: list[int] = []
    cache_reset: bool = False


class EngineError(msgspec.Struct, tag="engine_error"):
    """The engine can no longer serve (a worker died, say); in-flight requests should fail."""

    message: str


ToFrontend = EngineReady | Deltas | EngineError


class OversizedFrame(msgspec.DecodeError):
    """A frame over the receiver's size limit: refused (and counted) like a malformed one."""


class Codec:
    """A MessagePack encoder plus a decoder for one socket direction's union.

    `max_bytes` bounds what `decode` accepts: the sockets themselves carry no size limit
    (ZMQ_MAXMSGSIZE would drop the sender's whole link for one large frame), so the
    check is here, where a refusal costs only that frame."""

    def __init__(self, union: object, max_bytes: int = 0) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(union)
        self.max_bytes = max_bytes  # 0: no limit

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, data: bytes):
        if self.max_bytes and len(data) > self.max_bytes:
            raise OversizedFrame(f"a frame of {len(data)} bytes (limit {self.max_bytes})")
        return self.decoder.decode(data)
