"""Configuration shared by every process: a few frozen parts, passed down.

The launcher builds one `EngineConfig` from the command line (the flags are
generated from the fields below, help text included, so no default is written
twice) and hands it to each process it starts as JSON (`--config-json`), so all
processes agree on addresses, sizes and names without any global state.

Every field name is unique across the parts, so `EngineConfig.build(**flat)` and
`config.replace(**flat)` take the flat names that the command line uses
(`block_size=4`, `overlap=False`) and put each into its part.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from subway.ipc.options import opt
from subway.ipc.server_config import ServerConfig


def _new_run_id() -> str:
    return uuid.uuid4().hex[:10]


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # derived defaults of frozen parts, in __post_init__


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: weights, precision, device, the kernels."""

    path: str = opt("", "Hugging Face folder (default: SmolLM2-135M-Instruct)", flag="--model")
    served_model_name: str = opt("", "name in the API (default: the folder's name)")
    tokenizer: str = opt("", "tokenizer folder (default: the model's)")
    dtype: str = opt("auto", "auto: float32 on the CPU, the model's dtype on CUDA",
                     choices=("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    device: str = opt("auto", "", choices=("auto", "cpu", "cuda"))
    max_model_len: int = opt(0, "tokens per sequence; 0: the model's own limit")
    seed: int = opt(0, "sampling seed")
    enforce_eager: bool = opt(False, "no CUDA graphs")
    kernels: str = opt("auto", "auto: Triton on CUDA, the PyTorch references elsewhere",
                       choices=("auto", "triton", "torch"))  # fmt: skip
    cpu_ext: bool = opt(True, "compile and use the C++ CPU kernels", flag="--no-cpu-ext")
    pack_weights: bool = opt(True, "pack CPU linear weights in oneDNN's layout once, at load",
                             flag="--no-pack-weights")  # fmt: skip
    bf16_matmul: str = opt("auto", "CPU bfloat16 linears: float32 runs them on float32 copies "
                           "of the weights (exact products, float32 sums, as native); auto: "
                           "float32 where oneDNN has no native bfloat16 (no AVX512-BF16/AMX)",
                           choices=("auto", "native", "float32"))  # fmt: skip
    huge_pages: bool = opt(True, "CPU: weights and KV cache in transparent huge pages where "
                           "the kernel allows them", flag="--no-huge-pages")  # fmt: skip
    quantization: str = opt("none", "int8: linear weights quantized at load (per output "
                            "channel), activations per token; CPU only",
                            choices=("none", "int8"))  # fmt: skip

    def __post_init__(self) -> None:
        if not self.served_model_name and self.path:
            _set(self, "served_model_name", os.path.basename(os.path.normpath(self.path)))


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, how much memory, the prefix cache."""

    block_size: int = opt(16, "tokens per KV block")
    kv_cache_memory: int = opt(1 << 30, "bytes of KV cache (CPU)")
    gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory for weights, activations, KV")
    num_kv_blocks: int = opt(0, "override the KV memory, in blocks of every layer (0: from the "
                             "memory budget; hybrid KV groups cut it into smaller pages)")
    enable_prefix_caching: bool = opt(True, "", flag="--no-prefix-caching")
    hybrid_kv_cache: bool = opt(
        True, "where layers slide (Gemma, Mistral), their KV blocks behind the window go back "
        "to the pool (pages per layer group; CPU, not with disaggregation)",
        flag="--disable-hybrid-kv-cache",
    )  # fmt: skip
    kv_cache_dtype: str = opt("auto", "auto: the model's dtype; int8: 8-bit keys and values "
                              "with a scale per slot and head (CPU only)",
                              choices=("auto", "int8"))  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    """Whom to serve each step and how much."""

    max_num_seqs: int = opt(64, "sequences in one step at most")
    max_num_batched_tokens: int = opt(512, "tokens in one step at most (the token budget)")
    pooling_share: float = opt(
        0.5, "the share of a step that decodes (in time, by the step cost model) that pooled "
        "prompts (embeddings, scores) may take, one KV block at least, so that generation "
        "keeps its pace beside an embeddings load; 0: no limit (they share the token budget)"
    )  # fmt: skip
    policy: str = opt("fcfs", "", choices=("fcfs", "priority", "sjf", "edf", "static"))
    static_batch_window_ms: float = opt(0.0, "--policy static: wait this long for a batch to fill")
    slo_ttft_ms: float = opt(1000.0, "--policy edf: a chat's TTFT SLO when its request names none")
    slo_tpot_ms: float = opt(
        0.0, "--policy edf: while chats are live, keep steps under this time per output "
        "token by shrinking batch prefill chunks (0: no cap)"
    )  # fmt: skip
    late_planning: bool = opt(
        True, "with overlap, plan step N+1 just before step N should end (not as it starts), "
        "so that requests arriving during N join N+1", flag="--no-late-planning"
    )  # fmt: skip
    overlap: bool = opt(True, "plan step N+1 while N runs", flag="--no-overlap")
    speculative_config: str = opt(
        "", 'speculative decoding, JSON as vLLM spells it: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, '
        '"disable_by_batch_size": 8}; empty: off'
    )  # fmt: skip
    step_timeout: float = opt(
        0.0, "seconds one step may take before the workers count as hung and the engine "
        "stops; 0: adaptive, max(10, 20 x the step cost model's prediction for the step), "
        "about 20 s for the first steps (300 while the workers visibly compute), 10 s for "
        "CPU workers on this host that use no CPU time (scheduler/worker_link.py)"
    )  # fmt: skip


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism and threads."""

    tensor_parallel_size: int = opt(1, "", alias="-tp")
    dist_init_addr: str = opt("127.0.0.1:29533", "torch.distributed rendezvous host:port")
    threads: int = opt(0, "torch threads per worker; 0: torch's default")
    collective_timeout: float = opt(
        300.0, "seconds a tensor-parallel collective may wait for the other ranks"
    )
    data_parallel_size: int = opt(1, "complete engines (a scheduler and its tensor-parallel "
                                  "workers each) behind one frontend", alias="-dp")  # fmt: skip
    data_parallel_rank: int = opt(0, "which engine this process belongs to (processes started "
                                  "one by one)", alias="--engine-id")  # fmt: skip
    prefill_engines: int = opt(0, "disaggregation: engines that only prefill (the first "
                               "engines), with --decode-engines")  # fmt: skip
    decode_engines: int = opt(0, "disaggregation: engines that only decode (after the prefill "
                              "ones), with --prefill-engines")  # fmt: skip
    role: str = opt("both", "what this engine does (derived from --prefill-engines and "
                    "--decode-engines when they are given)",
                    choices=("both", "prefill", "decode"))  # fmt: skip
    engine_addrs: str = opt(
        "",
        "frontend: each engine's scheduler address, comma-separated, as the engines bind "
        "them (engines on other hosts); default: derived as for one host (engine_config)",
    )

    def __post_init__(self) -> None:
        if self.prefill_engines or self.decode_engines:
            _set(self, "data_parallel_size", self.prefill_engines + self.decode_engines)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served beside the base model (vLLM's flags)."""

    enable_lora: bool = opt(False, "serve LoRA adapters: a request names one by its `model`")
    lora_modules: tuple[str, ...] = opt(
        (), "adapters to serve from the start, NAME=PATH each (a PEFT folder: "
        "adapter_config.json and adapter_model.safetensors)", nargs="+"
    )  # fmt: skip
    max_loras: int = opt(4, "distinct adapters in one step at most")
    max_lora_rank: int = opt(16, "the highest adapter rank accepted (at most 64)")
    max_cpu_loras: int = opt(0, "adapters the workers keep loaded; 0: --max-loras")
    allow_runtime_lora_updating: bool = opt(
        False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter"
    )

    def __post_init__(self) -> None:
        _set(self, "lora_modules", tuple(self.lora_modules))
        if self.lora_modules and not self.enable_lora:
            _set(self, "enable_lora", True)
        if not 1 <= self.max_loras <= 64:
            raise ValueError(f"--max-loras must be in [1, 64], not {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 64:
            raise ValueError(f"--max-lora-rank must be in [1, 64], not {self.max_lora_rank}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        for spec in self.lora_modules:
            name, eq, path = spec.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH, not {spec[:80]!r}")

    @property
    def cpu_loras(self) -> int:
        """Adapters a worker keeps loaded at most."""
        return max(self.max_cpu_loras, self.max_loras)

    def modules(self) -> list[tuple[str, str]]:
        """(name, path) of each `--lora-modules` entry."""
        return [tuple(s.split("=", 1)) for s in self.lora_modules]  # type: ignore[misc]


KV_ADDR_RE = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]{1,255}:[0-9]{1,5}")


@dataclass(frozen=True)
class IpcConfig:
    """Where the processes meet: ipc:// sockets live in `run_dir` on one host."""

    run_id: str = opt("", "names this engine's sockets and shm buffers")
    run_dir: str = opt("", "folder of the ipc:// sockets (default: a temp folder per run id)")
    scheduler_addr: str = opt("", "frontend -> scheduler (scheduler binds PULL)")
    frontend_addr: str = opt("", "scheduler -> frontend (frontend binds PULL)")
    plan_addr: str = opt("", "scheduler -> workers (scheduler binds XPUB)")
    result_addr: str = opt("", "workers -> scheduler (scheduler binds PULL)")
    use_shm: bool = opt(True, "token ids through shared memory (one host)", flag="--no-shm")
    prompt_shm_tokens: int = opt(1 << 22, "capacity of the prompt buffer, in tokens")
    curve_key_file: str = opt(
        "", "CurveZMQ key file (mode 0600) for tcp:// sockets; serve makes one per run"
    )
    max_message_bytes: int = opt(64 << 20, "largest ZeroMQ message any socket accepts")
    kv_addr: str = opt(
        "",
        "a prefill engine serves its KV blocks at tcp://HOST:PORT (rank r: PORT + r x "
        "engines), for decode engines on other hosts; empty: shared memory, one host",
    )

    def __post_init__(self) -> None:
        if not self.run_id:
            _set(self, "run_id", _new_run_id())
        if not self.run_dir:
            _set(self, "run_dir", os.path.join(tempfile.gettempdir(), f"subway-{self.run_id}"))
        if self.kv_addr and not KV_ADDR_RE.fullmatch(self.kv_addr):
            raise ValueError(f"--kv-addr must be tcp://HOST:PORT, not {self.kv_addr[:80]!r}")
        d = self.run_dir
        for name in ("scheduler", "frontend", "plan", "result"):
            if not getattr(self, f"{name}_addr"):
                _set(self, f"{name}_addr", f"ipc://{d}/{name}.sock")

    @property
    def prompt_shm_name(self) -> str:
        return f"subway_{self.run_id}_prompts"

    @property
    def sampled_shm_name(self) -> str:
        return f"subway_{self.run_id}_sampled"

    @property
    def kv_source(self) -> str:
        """A prefill engine's shared KV caches are `{kv_source}_kv{rank}` (worker/kv_share.py)."""
        return f"subway_{self.run_id}"

    def kv_rank_addr(self, rank: int, stride: int) -> str:
        """Rank `rank`'s KV address: `kv_addr`'s port plus rank x `stride` (the engines
        on this config's host, so that no two of their ranks meet)."""
        host, _, port = self.kv_addr[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:{int(port) + rank * stride}"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ipc: IpcConfig = field(default_factory=IpcConfig)

    @classmethod
    def build(cls, **flat: Any) -> EngineConfig:
        """A config from flat field names (`block_size=4`), each put into its part; derived
        defaults (run dir, addresses, served name) follow the values given."""
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            grouped.setdefault(_owner(name), {})[name] = value
        return cls(**{part: c(**grouped.get(part, {})) for part, c in parts()})

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with flat-named fields changed. Derived values (addresses, the served
        name) are not derived again: pass them too if they should follow."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            changes.setdefault(_owner(name), {})[name] = value
        return dataclasses.replace(
            self, **{p: dataclasses.replace(getattr(self, p), **c) for p, c in changes.items()}
        )

    def engine(self, i: int) -> EngineConfig:
        """Engine `i`'s config (`engine_config`)."""
        return engine_config(self, i)

    @property
    def kv_source(self) -> str:
        """What this engine's leases name as their source (`KvLease.source`): its ranks'
        KV addresses, comma-separated, when it has `--kv-addr`; else its shm prefix."""
        ipc = self.ipc
        if not ipc.kv_addr:
            return ipc.kv_source
        stride = max(1, self.parallel.data_parallel_size)
        world = self.parallel.tensor_parallel_size
        return ",".join(ipc.kv_rank_addr(r, stride) for r in range(world))

    @property
    def quantized(self) -> bool:
        """Whether `--quantization` or `--kv-cache-dtype` asks for anything."""
        return self.model.quantization != "none" or self.cache.kv_cache_dtype != "auto"

    @property
    def client_address(self) -> str | None:
        """The frontend's native ZMQ endpoint, None when it is "off"."""
        addr = self.server.client_addr
        if addr == "off":
            return None
        return addr or f"ipc://{self.ipc.run_dir}/client.sock"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json_arg(cls, arg: str) -> EngineConfig:
        """`--config-json`'s value: the JSON itself, or "-" to read it from standard input
        (how the launcher hands it over, so that no secret shows on a command line)."""
        return cls.from_json(sys.stdin.read() if arg == "-" else arg)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return msgspec.json.decode(text, type=cls)


def parts() -> list[tuple[str, type]]:
    """(attribute, class) of each part, in order."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(EngineConfig)]  # type: ignore[misc]


def field_owners() -> dict[str, str]:
    """Flat field name -> the part that holds it."""
    return {f.name: part for part, cls in parts() for f in dataclasses.fields(cls)}


def _owner(name: str) -> str:
    owner = field_owners().get(name)
    if owner is None:
        raise TypeError(f"EngineConfig has no field {name!r}")
    return owner


ADDRESS_NAMES = ("scheduler", "frontend", "plan", "result")


def engine_config(config: EngineConfig, i: int) -> EngineConfig:
    """The config of engine `i` of `config.parallel.data_parallel_size`, as each of its
    processes and the frontend derive it alike: engine 0's is `config` itself (so one
    engine is configured exactly as before); engine i > 0 gets the run id `RUN-i` (its
    shared memory), socket files `NAME-i.sock` in the same run folder, and, for addresses
    given as tcp://HOST:PORT (and the rendezvous HOST:PORT), the port plus i. On the
    frontend, `engine_addrs` names engine i's scheduler address as given, unchanged.
    """
    n = config.parallel.data_parallel_size
    if not 0 <= i < max(n, 1):
        raise ValueError(f"engine {i} of {n}: out of range")
    listed = [a.strip() for a in config.parallel.engine_addrs.split(",") if a.strip()]
    if listed and len(listed) != n:
        raise ValueError(f"--engine-addrs names {len(listed)} engines; --data-parallel-size is {n}")
    p = config.parallel
    role = p.role
    if p.prefill_engines or p.decode_engines:
        role = "prefill" if i < p.prefill_engines else "decode"
    if i == 0 and not listed:
        return config.replace(data_parallel_rank=0, role=role)
    ipc = config.ipc
    addrs = {f"{name}_addr": _shifted(getattr(ipc, f"{name}_addr"), ipc.run_dir, name, i)
             for name in ADDRESS_NAMES}  # fmt: skip
    if listed:
        addrs["scheduler_addr"] = listed[i]
    run_id = ipc.run_id if i == 0 else f"{ipc.run_id}-{i}"
    if ipc.kv_addr:
        addrs["kv_addr"] = _shifted(ipc.kv_addr, ipc.run_dir, "kv", i)
    host, _, port = config.parallel.dist_init_addr.rpartition(":")
    return config.replace(
        run_id=run_id,
        data_parallel_rank=i,
        role=role,
        dist_init_addr=f"{host}:{int(port) + i}",
        **addrs,
    )


def _shifted(addr: str, run_dir: str, name: str, i: int) -> str:
    if i == 0:
        return addr
    if addr == f"ipc://{run_dir}/{name}.sock":
        return f"ipc://{run_dir}/{name}-{i}.sock"
    if addr.startswith("tcp://"):
        host, _, port = addr[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:{int(port) + i}"
    if addr.startswith("ipc://") and addr.endswith(".sock"):
        return f"{addr[: -len('.sock')]}-{i}.sock"
    return f"{addr}-{i}"
