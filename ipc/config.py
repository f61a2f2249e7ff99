"""Configuration shared by every process: one plain dataclass, passed down.

The launcher builds one `EngineConfig` from the command line and hands it to
each process it starts as JSON (`--config-json`), so all processes agree on
addresses, sizes and names without any global state.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field

import msgspec


def _new_run_id() -> str:
    return uuid.uuid4().hex[:10]


@dataclass
class EngineConfig:
    model: str = ""  # a Hugging Face folder; "" means the default model
    served_model_name: str = ""
    tokenizer: str = ""  # defaults to `model`
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int = 0  # 0: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes of KV cache on the CPU
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int = 0  # >0 overrides the memory-derived count (tests, benchmarks)
    seed: int = 0
    tensor_parallel_size: int = 1
    policy: str = "fcfs"
    static_batch_window_ms: float = 0.0  # `static`: wait this long for a batch to fill
    enable_prefix_caching: bool = True
    overlap: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    max_waiting: int = 0  # 0: unbounded
    request_timeout: float = 0.0  # seconds a generation request may run; 0: no limit
    # The frontend's native ZMQ endpoint: "" means ipc://{run_dir}/client.sock, "off" none.
    client_addr: str = ""
    threads: int = 0  # torch threads per worker; 0: torch's default
    shutdown_timeout: float = 5.0
    # Where the processes meet: ipc:// sockets live in run_dir on one host.
    run_id: str = field(default_factory=_new_run_id)
    run_dir: str = ""
    scheduler_addr: str = ""  # frontend -> scheduler (scheduler binds PULL)
    frontend_addr: str = ""  # scheduler -> frontend (frontend binds PULL)
    plan_addr: str = ""  # scheduler -> workers (scheduler binds XPUB)
    result_addr: str = ""  # workers -> scheduler (scheduler binds PULL)
    dist_init_addr: str = ""  # torch.distributed rendezvous host:port
    use_shm: bool = True  # token ids through shared memory (one host)
    prompt_shm_tokens: int = 1 << 22  # capacity of the frontend's prompt buffer, in tokens

    def __post_init__(self) -> None:
        if not self.run_dir:
            self.run_dir = os.path.join(tempfile.gettempdir(), f"subway-{self.run_id}")
        d = self.run_dir
        self.scheduler_addr = self.scheduler_addr or f"ipc://{d}/scheduler.sock"
        self.frontend_addr = self.frontend_addr or f"ipc://{d}/frontend.sock"
        self.plan_addr = self.plan_addr or f"ipc://{d}/plan.sock"
        self.result_addr = self.result_addr or f"ipc://{d}/result.sock"
        self.served_model_name = self.served_model_name or (
            os.path.basename(os.path.normpath(self.model)) if self.model else ""
        )

    @property
    def prompt_shm_name(self) -> str:
        return f"subway_{self.run_id}_prompts"

    @property
    def sampled_shm_name(self) -> str:
        return f"subway_{self.run_id}_sampled"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return msgspec.json.decode(text, type=cls)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
