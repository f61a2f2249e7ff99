"""LoRA adapters on a worker: loaded from PEFT folders, held in a bounded cache, and laid
into the step's slots, so that one pass computes a batch that mixes adapters.

Each linear layer (`PackedLinear`: the fused q/k/v, o_proj, the fused gate/up, down_proj)
keeps, when LoRA is on, a `LoraLinear`: stacks of `--max-loras` slots, A `[S, P*R, in]`
and B `[S, out, R]` (P: the parts a fused layer joins; R: `--max-lora-rank`; a smaller
rank is zero-padded; B carries the adapter's scale). A step's rows are grouped into
segments of consecutive sequences with the same adapter (`LoraStep`), and one call per
layer (`subway.kernels.lora.lora_apply`, Punica's SGMV: x A_i^T B_i^T for each segment's
slot i) adds every row's delta to the base layer's output. The base weights are untouched,
so `--quantization int8` keeps working under the adapters.

Tensor parallelism: a column-parallel layer's B is split like its weight's rows (this
rank's heads, its share of gate/up); a row-parallel layer's A is split like its weight's
columns, and its partial delta joins the partial output before the all-reduce (the sum of
the ranks' x_r A_r^T B^T is x A^T B^T).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from subway.ipc.config import EngineConfig, LoraConfig
from subway.ipc.lora_messages import startup_adapters
from subway.ipc.messages import LoraAdapter, Plan, SeqStep
from subway.kernels.lora import lora_apply, lora_apply_ref
from subway.worker.batch import Batch, PlanError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each target's layer on the model, and its part there.
_GROUP = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
          "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
          "down_proj": ("down", 0)}  # fmt: skip
_PREFIX = "base_model.model.model.layers."


class LoraLoadError(ValueError):
    """An adapter this worker cannot load (files, rank, names, shapes): its requests fail."""


class LoraStep:
    """The step's segments, shared by every `LoraLinear` of the model (set by `LoraManager`
    before each forward): rows `seg_start[g]:seg_start[g+1]` use slot `seg_slot[g]`; of
    the step's rows as they are, or, where `rows` is set, of the rows it lists (those with
    an adapter, grouped by slot; the kernel reads and writes them in place).

    Grouping matters: a decode step of 64 sequences over 8 adapters, in the plan's order,
    is 64 one-row segments, each reading its adapter's weights again; grouped, it is 8
    (the kernel 1.8x faster at 64 rows: `tools/bench/bench_lora_kernel.py`, DESIGN)."""

    def __init__(self) -> None:
        self.active = False
        self.seg_start = torch.zeros(1, dtype=torch.int64)
        self.seg_slot = torch.zeros(0, dtype=torch.int64)
        self.rows: torch.Tensor | None = None


class LoraLinear:
    """One linear layer's adapter slots (see the module's docstring)."""

    def __init__(
        self,
        step: LoraStep,
        bounds: list[int],
        in_features: int,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        apply: Callable,
    ) -> None:
        self.step = step
        self.bounds = tuple(bounds)  # output columns of each part
        self.rank = rank
        parts = len(bounds) - 1
        self.a = torch.zeros(slots, parts * rank, in_features, dtype=dtype, device=device)
        # B as the kernel reads it fastest: `[S, out, R]`, a view of a contiguous
        # `[S, R, out]` (1.4-1.9x faster at decode than contiguous, the same bits).
        bt = torch.zeros(slots, rank, bounds[-1], dtype=dtype, device=device)
        self.b = bt.transpose(1, 2)
        self.nbytes = (self.a.numel() + bt.numel()) * self.a.element_size()
        self._apply = apply

    def __call__(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add the step's deltas to `y` (the base layer's output for `x`), in place."""
        s = self.step
        self._apply(y, x, self.a, self.b, self.bounds, s.seg_start, s.seg_slot, s.rows)

    def put(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Lay an adapter's (A, scaled B) of each part (None: not a target) into `slot`."""
        r = self.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, ab in enumerate(parts):
            if ab is None:
                continue
            a, b = ab
            k = a.shape[0]
            self.a[slot, p * r : p * r + k].copy_(a)
            self.b[slot, self.bounds[p] : self.bounds[p + 1], :k].copy_(b)


@dataclass
class AdapterWeights:
    """One adapter's tensors for this rank: per layer, per group, per part (A, scaled B)."""

    rank: int
    layers: list[dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]]
    nbytes: int


def read_adapter(path: str, max_rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter folder's config and tensors (safetensors only: nothing is unpickled)."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt", "cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"adapter {path}: {e}") from e
    r = cfg.get("r")
    if not isinstance(r, int) or not 1 <= r <= max_rank:
        raise LoraLoadError(f"adapter {path}: rank {r!r} (--max-lora-rank {max_rank})")
    if cfg.get("use_dora") or cfg.get("bias", "none") != "none":
        raise LoraLoadError(f"adapter {path}: DoRA and LoRA biases are not supported")
    return cfg, tensors


def adapter_scale(cfg: dict) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


class LoraManager:
    """A worker's adapters: those it knows (id -> folder), those loaded (at most
    `--max-cpu-loras`, least recently used evicted), and which sits in each slot."""

    def __init__(self, config: LoraConfig, model: torch.nn.Module, apply: Callable) -> None:
        self.max_rank = config.max_lora_rank
        self.cpu_loras = config.cpu_loras
        self.known: dict[int, LoraAdapter] = {a.lora_id: a for a in startup_adapters(config)}
        self.loaded: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.slots = [0] * config.max_loras  # the adapter in each slot (0: none)
        self.slot_used = [0] * config.max_loras  # the last step that used each slot
        self.step = LoraStep()
        self.model = model
        self.linears = attach(model, self.step, config.max_loras, self.max_rank, apply)
        self.loads_total = 0
        self.evictions_total = 0
        self.slot_bytes = sum(lin.nbytes for linears in self.linears for lin in linears.values())
        self._steps = 0
        # The `--lora-modules` adapters read now, not in their first step (all of whose
        # sequences would wait for the read), as many as stay loaded.
        for lora_id in list(self.known)[: self.cpu_loras]:
            self._weights(lora_id)

    @property
    def memory_bytes(self) -> int:
        """What adapters hold: the slots (on the model's device) and the adapters loaded
        (in host memory)."""
        return self.slot_bytes + sum(w.nbytes for w in self.loaded.values())

    def register(self, adapters: list[LoraAdapter], removed: list[int]) -> None:
        for a in adapters:
            self.known[a.lora_id] = a
        for lora_id in removed:
            self.known.pop(lora_id, None)
            if self.loaded.pop(lora_id, None) is not None:
                self.evictions_total += 1
            if lora_id in self.slots:
                self.slots[self.slots.index(lora_id)] = 0

    def prepare(self, steps: list[SeqStep], loras: list[int]) -> None:
        """Segments of this step (`loras`: each step's adapter), its adapters in slots."""
        self._steps += 1
        st = self.step
        if not any(loras):
            st.active = False
            return
        slot_of = self._place(set(loras) - {0})
        counts = np.fromiter((s.num_tokens for s in steps), np.int64, len(steps))
        row_slot = np.repeat(np.array([slot_of.get(lo, -1) for lo in loras]), counts)
        grouped = np.all(row_slot[1:] >= row_slot[:-1]) and row_slot[0] >= 0
        if grouped:  # already: every row has an adapter, the slots in order
            st.rows = None
            slot_seq = row_slot
        else:  # gather the rows with an adapter, grouped by slot (a stable sort)
            order = np.argsort(row_slot, kind="stable")
            order = order[row_slot[order] >= 0]
            st.rows = torch.from_numpy(order)
            slot_seq = row_slot[order]
        edges = np.flatnonzero(np.diff(slot_seq)) + 1
        st.seg_start = torch.from_numpy(np.concatenate(([0], edges, [len(slot_seq)])))
        st.seg_slot = torch.from_numpy(slot_seq[np.concatenate(([0], edges))].astype(np.int64))
        st.active = True

    def _place(self, wanted: set[int]) -> dict[int, int]:
        """Each wanted adapter's slot, loading those not in one into the least recently
        used slots that this step does not need."""
        if len(wanted) > len(self.slots):
            raise LoraLoadError(
                f"{len(wanted)} adapters in one step; --max-loras is {len(self.slots)}"
            )
        slot_of = {a: i for i, a in enumerate(self.slots) if a in wanted}
        for lora_id in sorted(wanted - slot_of.keys()):
            free = [i for i, a in enumerate(self.slots) if a not in wanted]
            i = min(free, key=lambda j: self.slot_used[j])
            weights = self._weights(lora_id)
            for layer, linears in zip(weights.layers, self.linears, strict=True):
                for group, lin in linears.items():
                    lin.put(i, layer.get(group, [None] * (len(lin.bounds) - 1)))
            self.slots[i] = lora_id
            slot_of[lora_id] = i
        for i in slot_of.values():
            self.slot_used[i] = self._steps
        return slot_of

    def _weights(self, lora_id: int) -> AdapterWeights:
        w = self.loaded.get(lora_id)
        if w is not None:
            self.loaded.move_to_end(lora_id)
            return w
        adapter = self.known.get(lora_id)
        if adapter is None:
            raise LoraLoadError(f"adapter {lora_id} is not known to this worker")
        w = self.load(adapter.path)
        self.loads_total += 1
        while len(self.loaded) >= self.cpu_loras:
            self.loaded.popitem(last=False)
            self.evictions_total += 1
        self.loaded[lora_id] = w
        return w

    def load(self, path: str) -> AdapterWeights:
        """An adapter's tensors, checked, split for this rank and scaled."""
        cfg, tensors = read_adapter(path, self.max_rank)
        scale = adapter_scale(cfg)
        layers: list[dict[str, list]] = [{} for _ in self.linears]
        nbytes = 0
        pairs = _pairs(tensors, path)
        for (i, target), (a, b) in pairs.items():
            if i >= len(self.linears):
                raise LoraLoadError(f"adapter {path}: layer {i}; the model has {len(self.linears)}")
            group, part = _GROUP[target]
            owner = self.linears[i][group]
            want = full_shape(self.model.arch, target)
            if (b.shape[0], a.shape[1]) != want or a.shape[0] != b.shape[1]:
                raise LoraLoadError(
                    f"adapter {path}: layer {i} {target}: A {list(a.shape)}, B {list(b.shape)} "
                    f"do not fit the model's {list(want)} layer (another base model?)"
                )
            a, b = shard(self.model, i, target, a, b)
            a, b = a.to(owner.a.dtype), (b.float() * scale).to(owner.b.dtype)
            parts = layers[i].setdefault(group, [None] * (len(owner.bounds) - 1))
            parts[part] = (a, b)  # in host memory: `put` copies them into a slot
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        return AdapterWeights(cfg["r"], layers, nbytes)


def _pairs(tensors: dict[str, torch.Tensor], path: str) -> dict[tuple[int, str], tuple]:
    """(layer, target) -> (A [r, in], B [out, r]) from PEFT's tensor names."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        rest = name[len(_PREFIX) :] if name.startswith(_PREFIX) else ""
        bits = rest.split(".")
        # {i}.self_attn.q_proj.lora_A.weight
        if len(bits) != 5 or not bits[0].isdigit() or bits[2] not in TARGETS or bits[4] != "weight":
            raise LoraLoadError(f"adapter {path}: unexpected tensor {name!r}")
        if bits[3] not in ("lora_A", "lora_B") or t.dim() != 2:
            raise LoraLoadError(f"adapter {path}: unexpected tensor {name!r}")
        found.setdefault((int(bits[0]), bits[2]), {})[bits[3]] = t
    out = {}
    for key, ab in found.items():
        if len(ab) != 2:
            raise LoraLoadError(f"adapter {path}: layer {key[0]} {key[1]} lacks A or B")
        out[key] = (ab["lora_A"], ab["lora_B"])
    return out


def full_shape(arch, target: str) -> tuple[int, int]:
    """(out, in) of a target's whole weight in the model (`ModelArch`)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[target]  # fmt: skip


def shard(
    model: torch.nn.Module, i: int, target: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one target's (A, B): B's rows where the layer splits its
    outputs, A's columns where it splits its inputs."""
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    if target in ("q_proj", "k_proj", "v_proj"):
        qkv = attn.qkv
        d = qkv.head_dim
        if target == "q_proj":
            return a, b[qkv.q_start * d : (qkv.q_start + qkv.num_heads) * d]
        return a, b[qkv.kv_start * d : (qkv.kv_start + qkv.num_kv_heads) * d]
    if target in ("gate_proj", "up_proj"):
        gu = mlp.gate_up
        n = gu.local[0 if target == "gate_proj" else 1]
        return a, b[gu.tp.rank * n : (gu.tp.rank + 1) * n]
    row = attn.o_proj if target == "o_proj" else mlp.down_proj
    first, n = row.in_shard
    return a[:, first : first + n], b


def attach(
    model: torch.nn.Module, step: LoraStep, slots: int, rank: int, apply: Callable
) -> list[dict[str, LoraLinear]]:
    """A `LoraLinear` on each linear layer of each decoder layer; per layer, by group."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv
        q, kv = qkv.q_size, qkv.kv_size
        gu = mlp.gate_up.local
        groups = {
            "qkv": (qkv, [0, q, q + kv, q + 2 * kv]),
            "o": (attn.o_proj, [0, attn.o_proj.out_features]),
            "gate_up": (mlp.gate_up, [0, gu[0], gu[0] + gu[1]]),
            "down": (mlp.down_proj, [0, mlp.down_proj.out_features]),
        }
        linears = {}
        for name, (lin, bounds) in groups.items():
            dtype, device = model.embed_tokens.dtype, model.embed_tokens.device
            ll = LoraLinear(step, bounds, lin.in_features, slots, rank, dtype, device, apply)
            lin.lora = ll
            linears[name] = ll
        out.append(linears)
    return out


def lora_manager(config: EngineConfig, model: torch.nn.Module) -> LoraManager | None:
    """With `--enable-lora`: a manager whose slots sit on every linear of `model` (the C++
    kernel unless `--no-cpu-ext`); None without."""
    if not config.lora.enable_lora:
        return None
    apply = lora_apply if config.model.cpu_ext else lora_apply_ref
    manager = LoraManager(config.lora, model, apply)
    model.lora_step = manager.step
    return manager


def check_loras(manager: LoraManager | None, plan: Plan) -> None:
    """A plan's adapter changes, registered; a new sequence's adapter must be known."""
    if plan.loras or plan.loras_removed:
        if manager is None:
            raise PlanError("a plan names LoRA adapters; LoRA is off on this worker")
        manager.register(plan.loras, plan.loras_removed)
    for ns in plan.new_seqs:
        if ns.lora and (manager is None or ns.lora not in manager.known):
            raise PlanError(f"seq {ns.seq_id}: LoRA adapter {ns.lora} is not served")


def prepare_loras(manager: LoraManager, batch: Batch) -> None:
    """The batch's segments and adapters in slots; an adapter that will not load fails the
    step (a PlanError: alike on every rank, before any collective)."""
    try:
        manager.prepare(batch.steps, [st.lora for st in batch.states])
    except LoraLoadError as e:
        raise PlanError(str(e)) from e
