"""Offline inference in one process: `LLM(...).generate(prompts, sampling)`.

The same `Scheduler` and `ModelRunner` that `subway serve` runs in separate
processes, driven by the same `EngineCore` loop through an in-process executor,
without sockets. `config.scheduler.overlap` picks the depth (plan N+1 before
result N is settled, as the scheduler process does); `run` and `generate` may
override it per call. Prompts are token ids or text (then tokenized with the
model's tokenizer, and each output carries its decoded `text`).

    from subway import LLM
    from subway.ipc.messages import SamplingParams

    llm = LLM(dtype="bfloat16")  # flat config fields; no path: the default model
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    print(out.text, out.token_ids, out.finish_reason)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from subway.ipc.config import EngineConfig
from subway.ipc.messages import AddRequest, Plan, RequestDelta, SamplingParams, StepResult, TokenRef
from subway.scheduler.engine_core import EngineCore, LazyExecutor
from subway.scheduler.scheduler import Scheduler


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # decoded, for text prompts
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    # When SamplingParams.prompt_logprobs asked: entry j is about prompt token j + 1.
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None

    def add(self, d: RequestDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs.logprobs
            self.prompt_top_ids = d.prompt_logprobs.top_ids
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.top_ids += d.top_ids or []
        if d.finish_reason:
            self.finish_reason = d.finish_reason


class InProcessExecutor(LazyExecutor):
    """Runs plans on a `ModelRunner` in this process, one per `collect` (see `EngineCore`)."""

    def __init__(self, runner: Any) -> None:
        super().__init__()
        self.runner = runner

    def run(self, plan: Plan) -> tuple[StepResult, list[int]]:
        out = self.runner.execute(plan)
        return out.to_result(plan.step), out.tokens


class LLM:
    def __init__(self, config: EngineConfig | None = None, **flat: Any) -> None:
        """`config`, or flat config fields (`path=`, `dtype=`, ...); with no model path,
        the default model (resolved as the launcher resolves it)."""
        from subway.tools.cli import resolve_model
        from subway.worker.runner import ModelRunner  # torch: only when a model runs here

        if config is None:
            config = EngineConfig.build(**flat)
        elif flat:
            config = config.replace(**flat)
        self.config = config = resolve_model(config)
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(
            config, self.runner.num_blocks, self.runner.max_model_len, self.runner.eos_token_ids,
            kv_windows=tuple(self.runner.pages.reported_windows) or (0,),
        )  # fmt: skip
        self.core = EngineCore(
            self.scheduler, InProcessExecutor(self.runner), 2 if config.scheduler.overlap else 1
        )
        self._next_id = 0
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            model = self.config.model
            self._tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.path)
        return self._tokenizer

    def add(self, prompt: list[int] | str, sampling: SamplingParams, **extra: Any) -> str:
        """Queue one prompt (token ids or text); `extra` are AddRequest fields (priority, ...)."""
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt)["input_ids"]
        rid = f"r{self._next_id}"
        self._next_id += 1
        msg = AddRequest(
            request_id=rid,
            prompt=TokenRef(ids=list(prompt)),
            prompt_len=len(prompt),
            sampling=sampling,
            arrival_time=time.time(),
            **extra,
        )
        self.scheduler.add(msg, list(prompt))
        return rid

    def run(
        self,
        outputs: dict[str, Output],
        overlap: bool | None = None,
        abort_after: dict[str, int] | None = None,
    ) -> None:
        """Step until no work is left, collecting deltas into `outputs` (request id ->
        Output); `abort_after` aborts a request once it has that many tokens."""
        if overlap is not None:
            self.core.depth = 2 if overlap else 1

        def on_deltas(deltas: list[RequestDelta]) -> None:
            for d in deltas:
                outputs.setdefault(d.request_id, Output()).add(d)
            for rid, n in list((abort_after or {}).items()):
                if len(outputs.get(rid, Output()).token_ids) >= n:
                    self.scheduler.abort(rid)
                    del abort_after[rid]  # type: ignore[union-attr]

        self.core.run(on_deltas)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | None = None,
        overlap: bool | None = None,
    ) -> list[Output]:
        """Generate for every prompt (greedy, 16 tokens, unless `sampling` says otherwise)."""
        sampling = sampling if sampling is not None else SamplingParams(temperature=0.0)
        ids = [self.add(p, sampling) for p in prompts]
        outputs: dict[str, Output] = {}
        self.run(outputs, overlap=overlap)
        result = [outputs.get(i, Output()) for i in ids]
        if any(isinstance(p, str) for p in prompts):
            for out in result:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return result
