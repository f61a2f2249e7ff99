"""One prepared GPU check of the kernels and the engine; `tools/gpu_check.sh` runs it.

Sections, each guarded (a failure is a FAIL row, and the rest still runs):

1. kernels: every Triton kernel against its PyTorch reference on random inputs
   at several shapes (bfloat16 and float32 on CUDA), error relative to the
   largest reference value, against a float32 reference from the same inputs;
   outputs and unused cache slots are poisoned with NaN first.
2. timing: each Triton kernel against the PyTorch reference at a real size
   (CUDA events, median of 20 runs).
3. equality: greedy output of the engine (`subway.llm.LLM`: the real Scheduler and
   ModelRunner) on tiny random Llama and Qwen3 models equals `transformers`'
   greedy `generate`, with CUDA graphs and with `enforce_eager`.
4. throughput: a random-weight model of Llama-3-8B's shapes in bfloat16 on a
   synthetic workload: Triton with CUDA graphs, Triton eager, and the PyTorch
   reference kernels; plus the memory profile's KV cache size.

`--dry-run` runs all of it on the CPU at tiny sizes, Triton under its
interpreter (float32 and float16 only), CUDA graphs emulated with the same
static buffers and padding but no capture; only what needs CUDA is left out.
The full log goes to `--log`; one short table is printed last. Exit status 1
if any check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


# ------------------------------------------------------------------ report


@dataclass
class Report:
    path: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    failed: bool = False

    def __post_init__(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._f = open(self.path, "w")  # noqa: SIM115 - closed in close()

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self._f.write(msg + "\n")
        self._f.flush()

    def row(self, check: str, result: str, detail: str) -> None:
        self.rows.append((check, result, detail))
        self.failed |= result == "FAIL"
        self.log(f"[{result}] {check}: {detail}")

    def table(self) -> str:
        w0 = max(len(r[0]) for r in self.rows) if self.rows else 5
        lines = [f"{'check':<{w0}}  result  detail", "-" * (w0 + 40)]
        lines += [f"{c:<{w0}}  {r:<6}  {d}" for c, r, d in self.rows]
        return "\n".join(lines)

    def close(self) -> None:
        self._f.close()


def section(report: Report, name: str, fn: Callable[[], None]) -> None:
    report.log(f"\n=== {name}")
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported as a FAIL row; the next section runs
        report.log(traceback.format_exc())
        report.row(name, "FAIL", f"{type(e).__name__}: {e}"[:100])
    report.log(f"=== {name}: {time.perf_counter() - t0:.1f}s")


@dataclass
class Ctx:
    device: torch.device
    dry: bool
    report: Report
    t_start: float
    budget_s: float
    tok_s: dict[str, float] = field(default_factory=dict)  # output tok/s of each throughput run
    kv_blocks: dict[str, int] = field(default_factory=dict)  # its KV pool, in blocks

    @property
    def dtypes(self) -> list[torch.dtype]:
        # The interpreter's bfloat16 is unreliable; float16 stands in for it there.
        return [torch.float32, torch.float16] if self.dry else [torch.bfloat16, torch.float32]

    @property
    def low(self) -> torch.dtype:
        return torch.float16 if self.dry else torch.bfloat16

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t_start)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|; inf if `actual` has any NaN or inf."""
    a, e = actual.float(), expected.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-6))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn: Callable[[], object], device: torch.device, iters: int = 20) -> float:
    """Milliseconds per call: CUDA events' median on CUDA, one timed call elsewhere."""
    fn()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


# ------------------------------------------------------------------ kernel cases


@dataclass
class AttnCase:
    name: str
    seqs: list[tuple[int, int]]  # (query_len, context_len)
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16


def attention_cases(dry: bool) -> list[AttnCase]:
    rng = random.Random(0)
    if dry:
        return [
            AttnCase("mixed gqa3 d16 bs4", [(1, 7), (5, 5), (3, 10), (1, 13), (9, 9)], 6, 2, 16, 4),
            AttnCase("decode x5 gqa4 d32", [(1, c) for c in (5, 37, 2, 70, 16)], 8, 2, 32, 16),
            AttnCase("decode x1 long (split)", [(1, 600)], 4, 2, 16, 16),
            AttnCase("prefill d24 bs3", [(7, 7), (40, 45)], 4, 1, 24, 3),
        ]
    mixed = [(1, rng.randint(500, 3000)) for _ in range(24)] + [
        (256, 1024),
        (512, 512),
        (200, 3000),
    ]
    return [
        AttnCase("decode x64 ctx~2k (8B)", [(1, rng.randint(1000, 3000)) for _ in range(64)], 32, 8, 128),
        AttnCase("decode x2 ctx 8k (split)", [(1, 8000), (1, 6000)], 32, 8, 128),
        AttnCase("mixed 24 dec + 3 chunks (8B)", mixed, 32, 8, 128),
        AttnCase("prefill 2x1024 (8B)", [(1024, 1024), (1024, 1024)], 32, 8, 128),
        AttnCase("mixed gqa7 d128 (Qwen)", mixed[20:], 28, 4, 128),
        AttnCase("mixed gqa3 d64 (SmolLM2)", mixed[20:], 9, 3, 64),
    ]  # fmt: skip


def make_attention(case: AttnCase, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(q, k_cache, v_cache, metadata): every context cached, unused slots NaN."""
    from subway.kernels.attention import build_metadata, positions_and_slots, write_kv

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    bs = case.block_size
    need = [-(-ctx // bs) for _, ctx in case.seqs]
    num_blocks = sum(need) + 8
    shape = (num_blocks, bs, case.kv_heads, case.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(case.seqs), max(need) + 1), dtype=np.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    qlens = np.array([q for q, _ in case.seqs], dtype=np.int64)
    ctxs = np.array([c for _, c in case.seqs], dtype=np.int64)
    _, slots = positions_and_slots(ctxs, ctxs, tables, bs)
    total = int(ctxs.sum())
    k = torch.randn(total, case.kv_heads, case.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(total, case.kv_heads, case.head_dim, generator=gen).to(device, dtype)
    write_kv(k, v, k_cache, v_cache, torch.from_numpy(slots).to(device))
    _, step_slots = positions_and_slots(qlens, ctxs, tables, bs)
    md = build_metadata(qlens, ctxs, tables, step_slots, bs, device)
    q = torch.randn(int(qlens.sum()), case.heads, case.head_dim, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, md


def check_kernels(ctx: Ctx) -> None:
    from subway.kernels import attention as ref_attn
    from subway.kernels import ops as ref_ops
    from subway.kernels import triton_attention as tri_attn
    from subway.kernels import triton_ops as tri_ops

    dev, rep = ctx.device, ctx.report
    worst: dict[str, tuple[float, str]] = {}

    def record(kernel: str, what: str, dtype: torch.dtype, err: float, ref_err: float | None):
        tol = TOL[dtype]
        extra = f", torch in {_dt(dtype)}: {ref_err:.1e}" if ref_err is not None else ""
        ok = err <= tol
        rep.log(f"  {kernel} {what} {_dt(dtype)}: rel err {err:.2e} (tol {tol:.0e}{extra})")
        score = err / tol
        if kernel not in worst or score > worst[kernel][0]:
            worst[kernel] = (score, f"{what} {_dt(dtype)}: {err:.1e} (tol {tol:.0e})")
        if not ok:
            rep.row(
                f"kernel {kernel}", "FAIL", f"{what} {_dt(dtype)}: rel err {err:.2e} > {tol:.0e}"
            )

    for dtype in ctx.dtypes:
        for case in attention_cases(ctx.dry):
            q, kc, vc, md = make_attention(case, dtype, dev)
            scale = case.head_dim**-0.5
            kc0 = torch.nan_to_num(kc, nan=0.0)
            vc0 = torch.nan_to_num(vc, nan=0.0)
            truth = ref_attn.paged_attention(q.float(), kc0.float(), vc0.float(), md, scale)
            out = torch.full_like(q, float("nan"))
            tri_attn.paged_attention(q, kc, vc, md, scale, out=out)
            ref_low = ref_attn.paged_attention(q, kc0, vc0, md, scale)
            record(
                "paged_attention", case.name, dtype, rel_err(out, truth), rel_err(ref_low, truth)
            )
            if md.all_decode:
                out.fill_(float("nan"))
                tri_attn.paged_attention(q, kc, vc, md, scale, num_splits=1, out=out)
                record("paged_attention", case.name + " nosplit", dtype, rel_err(out, truth), None)
            del q, kc, vc, kc0, vc0, truth, out, ref_low

        t = 37 if ctx.dry else 2048
        kvh, d = (2, 16) if ctx.dry else (8, 128)
        blocks, bs = (16, 4) if ctx.dry else (4096, 16)
        g = torch.Generator().manual_seed(1)
        # q, k and v as the model has them: strided views into one qkv projection
        qkv = torch.randn(t, (4 + 2) * kvh * d, generator=g).to(dev, dtype)
        k = qkv[:, 4 * kvh * d : 5 * kvh * d].view(t, kvh, d)
        v = qkv[:, 5 * kvh * d :].view(t, kvh, d)
        slots = torch.randperm(blocks * bs, generator=g)[:t].to(dev)
        slots[::7] = -1
        kc = torch.full((blocks, bs, kvh, d), float("nan"), dtype=dtype, device=dev)
        vc = torch.full_like(kc, float("nan"))
        tri_attn.write_kv(k, v, kc, vc, slots)
        keep = slots >= 0
        fk, fv = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
        exact = torch.equal(fk[slots[keep]], k[keep]) and torch.equal(fv[slots[keep]], v[keep])
        untouched = torch.ones(blocks * bs, dtype=torch.bool, device=dev)
        untouched[slots[keep]] = False
        clean = bool(fk[untouched].isnan().all() and fv[untouched].isnan().all())
        record("write_kv", f"{t} tokens", dtype, 0.0 if exact and clean else float("inf"), None)

        hidden = 64 if ctx.dry else 4096
        for shape in ((t, hidden), (3, hidden + 36)):
            x = torch.randn(shape, generator=g).to(dev, dtype)
            res = torch.randn(shape, generator=g).to(dev, dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dev, dtype)
            truth_out, truth_res = ref_ops.rms_norm(x.float(), w.float(), 1e-5, res.float())
            out = torch.full_like(x, float("nan"))
            r = res.clone()
            tri_ops.rms_norm(x, w, 1e-5, residual=r, out=out)
            ref_out, _ = ref_ops.rms_norm(x, w, 1e-5, res)
            record(
                "rms_norm",
                f"{shape} +residual",
                dtype,
                rel_err(out, truth_out),
                rel_err(ref_out, truth_out),
            )
            record("rms_norm", f"{shape} residual out", dtype, rel_err(r, truth_res), None)
            out = torch.full_like(x, float("nan"))
            tri_ops.rms_norm(x, w, 1e-5, out=out)
            record(
                "rms_norm",
                f"{shape}",
                dtype,
                rel_err(out, ref_ops.rms_norm(x.float(), w.float(), 1e-5)),
                None,
            )
        x = qkv[:, : 4 * kvh * d].view(t, 4 * kvh, d)  # the q part of the qkv output
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, dtype)
        record(
            "rms_norm",
            "per head (qk-norm)",
            dtype,
            rel_err(tri_ops.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x.float(), w.float(), 1e-6)),
            None,
        )

        nq = 4 * kvh
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        inv = ref_ops.rope_inv_freq(d, 500000.0, scaling)
        max_pos = 256 if ctx.dry else 8192
        cache = ref_ops.rope_cos_sin_cache(inv, max_pos, dtype, dev)
        pos = torch.randint(0, max_pos, (t,), generator=g).to(dev)
        qkv2 = torch.randn(t, (nq + 2 * kvh) * d, generator=g).to(dev, dtype)
        qr = qkv2[:, : nq * d].view(t, nq, d)
        kr = qkv2[:, nq * d : (nq + kvh) * d].view(t, kvh, d)
        tq, tk = ref_ops.apply_rope(qr.float(), kr.float(), pos, cache.float())
        lq, lk = ref_ops.apply_rope(qr, kr, pos, cache)
        tri_ops.apply_rope(qr, kr, pos, cache)
        record("rope", f"q {nq}x{d}", dtype, rel_err(qr, tq), rel_err(lq, tq))
        record("rope", f"k {kvh}x{d}", dtype, rel_err(kr, tk), rel_err(lk, tk))

        inter = 100 if ctx.dry else 14336
        for rows in (t, 1):
            x = (2 * torch.randn(rows, 2 * inter, generator=g)).to(dev, dtype)
            out = torch.full((rows, inter), float("nan"), dtype=dtype, device=dev)
            tri_ops.silu_and_mul(x, out=out)
            truth = ref_ops.silu_and_mul(x.float())
            record("silu_and_mul", f"{rows}x{inter}", dtype, rel_err(out, truth),
                   rel_err(ref_ops.silu_and_mul(x), truth))  # fmt: skip
        del qkv, qkv2, kc, vc
        gc.collect()

    for kernel, (score, detail) in worst.items():
        if score <= 1.0:
            rep.row(f"kernel {kernel}", "PASS", f"worst {detail}")


def time_kernels(ctx: Ctx) -> None:
    from subway.kernels import attention as ref_attn
    from subway.kernels import ops as ref_ops
    from subway.kernels import triton_attention as tri_attn
    from subway.kernels import triton_ops as tri_ops

    dev, rep, dtype = ctx.device, ctx.report, ctx.low
    note = " (interpreter: not a speed)" if ctx.dry else ""

    def pair(name: str, tri: Callable[[], object], ref: Callable[[], object], row: bool = True):
        t_tri, t_ref = bench(tri, dev), bench(ref, dev)
        detail = f"triton {t_tri:.3f} ms, torch {t_ref:.3f} ms ({t_ref / t_tri:.1f}x){note}"
        rep.log(f"  {name} {_dt(dtype)}: {detail}")
        if row:
            rep.row(f"time {name}", "-", detail)

    for i, case in enumerate(attention_cases(ctx.dry)):
        q, kc, vc, md = make_attention(case, dtype, dev)
        kc.nan_to_num_(0.0)
        vc.nan_to_num_(0.0)
        scale = case.head_dim**-0.5
        pair(
            f"attention {case.name}",
            lambda q=q, kc=kc, vc=vc, md=md, s=scale: tri_attn.paged_attention(q, kc, vc, md, s),
            lambda q=q, kc=kc, vc=vc, md=md, s=scale: ref_attn.paged_attention(q, kc, vc, md, s),
            row=i == 0 or "8B" in case.name or "split" in case.name,
        )
        del q, kc, vc
    t = 37 if ctx.dry else 2048
    hidden, inter, kvh, d = (64, 100, 2, 16) if ctx.dry else (4096, 14336, 8, 128)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, hidden, generator=g).to(dev, dtype)
    res = torch.randn(t, hidden, generator=g).to(dev, dtype)
    w = torch.ones(hidden, dtype=dtype, device=dev)
    pair(f"rms_norm+res {t}x{hidden}", lambda: tri_ops.rms_norm(x, w, 1e-5, res),
         lambda: ref_ops.rms_norm(x, w, 1e-5, res))  # fmt: skip
    gu = torch.randn(t, 2 * inter, generator=g).to(dev, dtype)
    pair(f"silu_and_mul {t}x{inter}", lambda: tri_ops.silu_and_mul(gu),
         lambda: ref_ops.silu_and_mul(gu))  # fmt: skip
    nq = 4 * kvh
    qkv = torch.randn(t, (nq + 2 * kvh) * d, generator=g).to(dev, dtype)
    qr = qkv[:, : nq * d].view(t, nq, d)
    kr = qkv[:, nq * d : (nq + kvh) * d].view(t, kvh, d)
    cache = torch.randn(4096, d, generator=g).to(dev, dtype)
    pos = torch.randint(0, 4096, (t,), generator=g).to(dev)
    pair(f"rope {t} tok q{nq} k{kvh}", lambda: tri_ops.apply_rope(qr, kr, pos, cache),
         lambda: ref_ops.apply_rope(qr, kr, pos, cache))  # fmt: skip
    kc = torch.zeros(4096, 16, kvh, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(4096 * 16, generator=g)[:t].to(dev)
    kk, vv = kr, qkv[:, (nq + kvh) * d :].view(t, kvh, d)
    pair(f"write_kv {t} tok", lambda: tri_attn.write_kv(kk, vv, kc, vc, slots),
         lambda: ref_attn.write_kv(kk, vv, kc, vc, slots))  # fmt: skip


# ------------------------------------------------------------------ compile


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](...)` records the launch instead."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _kernel_launches(dtype: torch.dtype, full: bool) -> list[tuple]:
    """The launches the wrappers make for the model paths, recorded on CPU tensors.

    `full`: every model shape and batch kind; else one representative of each kernel.
    """
    import numpy as np

    from subway.kernels import triton_attention as ta
    from subway.kernels import triton_ops as to
    from subway.kernels.attention import build_metadata, positions_and_slots

    launches: list = []
    kernels = {
        ta: ("_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel"),
        to: ("_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel"),
    }
    saved = {(m, n): getattr(m, n) for m, names in kernels.items() for n in names}
    shapes = ((32, 8, 128), (28, 4, 128), (9, 3, 64)) if full else ((32, 8, 128),)
    batches = [[(1, 40), (1, 2000)], [(7, 7), (1, 30), (20, 50)]]
    if full:
        batches += [[(1, 5)], [(9, 9)]]  # one sequence: Triton specialises num_seqs == 1
    try:
        for (m, n), fn in saved.items():
            setattr(m, n, _Recorder(fn, launches))
        for heads, kvh, d in shapes:
            kc = torch.zeros(64, 16, kvh, d, dtype=dtype)
            for seqs in batches:
                ql = np.array([q for q, _ in seqs])
                cl = np.array([c for _, c in seqs])
                tables = np.zeros((len(seqs), 128), dtype=np.int32)
                _, slots = positions_and_slots(ql, cl, tables, 16)
                md = build_metadata(ql, cl, tables, slots, 16, "cpu")
                q = torch.zeros(int(ql.sum()), heads, d, dtype=dtype)
                for splits in (1, 4) if md.all_decode else (None,):
                    ta.paged_attention(q, kc, kc, md, 0.1, num_splits=splits)
                if md.all_decode:
                    md_decode, q_decode = md, q
                else:
                    md_mixed, q_mixed = md, q
                if md.all_decode and full:
                    md.context_lens = md.context_lens.long()  # as the CUDA graphs hold them
                    ta.paged_attention(q, kc, kc, md, 0.1, num_splits=1)
            qkv = torch.zeros(5, (heads + 2 * kvh) * d, dtype=dtype)
            k = qkv[:, heads * d : (heads + kvh) * d].view(5, kvh, d)
            ta.write_kv(k, k, kc, kc, torch.zeros(5, dtype=torch.int64))
            # `--kv-cache-dtype int8`: the caches' int8 variants of both kernels.
            k8 = torch.zeros(64, 16, kvh, d + 4, dtype=torch.int8)
            ta.write_kv(k, k, k8, k8, torch.zeros(5, dtype=torch.int64))
            for splits in (1, 4):
                ta.paged_attention(q_decode, k8, k8, md_decode, 0.1, num_splits=splits)
            ta.paged_attention(q_mixed, k8, k8, md_mixed, 0.1)
            qv = qkv[:, : heads * d].view(5, heads, d)
            to.apply_rope(qv, k, torch.zeros(5, dtype=torch.int64), torch.zeros(64, d, dtype=dtype))
            if full:
                to.rms_norm(qv, torch.ones(d, dtype=dtype), 1e-6)  # Qwen3's per-head norm
        for hidden in (4096, 576) if full else (4096,):
            x = torch.zeros(5, hidden, dtype=dtype)
            to.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-6)
            to.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-6, residual=x.clone())
            to.silu_and_mul(torch.zeros(5, 2 * hidden, dtype=dtype))
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
    return launches


def aot_compile(report: Report, capability: tuple[int, int], full: bool = True) -> None:
    """Compile every kernel variant the model launches, for a GPU, with Triton's own compiler.

    Needs no GPU (ptxas ships with Triton): it catches what the interpreter
    forgives (types of loop-carried values, constexpr rules, register and
    shared-memory limits at compile time).
    """
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    if triton.knobs.runtime.interpret:
        raise RuntimeError("the compile check needs Triton imported without TRITON_INTERPRET")
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    seen: set[str] = set()
    count, t0 = 0, time.perf_counter()
    per_kernel: dict[str, int] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fn, args, kwargs in _kernel_launches(dtype, full=full and dtype == torch.bfloat16):
            names = fn.arg_names
            bound = dict(zip(names, args, strict=False))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            options = {k: v for k, v in kwargs.items() if k not in names}
            signature, constexprs = {}, {}
            for param in fn.params:
                value = bound[param.name]
                if param.is_constexpr:
                    signature[param.name] = "constexpr"
                    constexprs[param.name] = value
                    continue
                ty, _ = native_specialize_impl(BaseBackend, value, False, True, True)
                signature[param.name] = ty
                if ty == "constexpr":  # an int equal to 1, as Triton specialises it
                    constexprs[param.name] = value
            key = f"{fn.__name__}{sorted(signature.items())}{sorted(constexprs.items(), key=str)}"
            key += str(sorted(options.items()))
            if key in seen:
                continue
            seen.add(key)
            src = ASTSource(fn, signature, constexprs=constexprs)
            try:
                compiled = triton.compile(src, target=target, options=options)
            except Exception as e:
                report.log(f"  {fn.__name__} {signature} {constexprs}: {e}")
                raise
            count += 1
            per_kernel[fn.__name__] = per_kernel.get(fn.__name__, 0) + 1
            report.log(
                f"  {fn.__name__} {_dt(dtype)} {_short(constexprs)}: "
                f"{compiled.metadata.shared} B shared memory"
            )
    report.row(
        f"compile for sm_{target.arch}",
        "PASS",
        f"{count} variants of {len(per_kernel)} kernels in {time.perf_counter() - t0:.0f}s (no GPU needed)",
    )


def _short(constexprs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in constexprs.items() if k.isupper())


def compile_in_child(report: Report, capability: tuple[int, int]) -> None:
    """The compile check in a process where Triton is not interpreted."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import sys; from subway.tools.gpu_check import Report, aot_compile; "
        f"r = Report({report.path + '.compile'!r}); aot_compile(r, {capability!r}); "
        "print('ROWS', r.rows)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    with open(report.path + ".compile") as f:
        report.log("\n".join(ln for ln in f.read().splitlines() if not ln.startswith("[")))
    os.remove(report.path + ".compile")
    if proc.returncode != 0:
        report.log(proc.stderr[-4000:])
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS "):
            for row in eval(line[5:]):  # noqa: S307 - our own child's repr of tuples of str
                report.row(*row)


# ------------------------------------------------------------------ engine


def build_tiny_model(arch: str, out_dir: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    if arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    else:
        config = Qwen3Config(**common, head_dim=64, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wide weights: decisive greedy choices, not near-ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def hf_greedy(path: str, prompts: list[list[int]], max_new: int, device: torch.device):
    """(tokens, top-5 ids per step) of transformers' greedy generate, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        results.append((tokens, [s[0].topk(5).indices.tolist() for s in out.scores]))
    del model
    return results


def compare(ours: list[int], our_top: list[list[int]], ref: tuple[list[int], list]) -> str:
    """'equal', 'near-tie' (diverged where each side's token is in the other's top-5), or 'DIFF'."""
    tokens, top5 = ref
    for i, (a, b) in enumerate(zip(ours, tokens, strict=False)):
        if a != b:
            return "near-tie" if a in top5[i] and b in our_top[i] else f"DIFF at {i}"
    return "equal" if len(ours) == len(tokens) else "DIFF length"


def check_equality(ctx: Ctx, root: str) -> None:
    from subway.ipc.config import EngineConfig
    from subway.ipc.messages import SamplingParams
    from subway.llm import LLM

    dev, rep = ctx.device, ctx.report
    rng = random.Random(0)
    lengths = [1, 5, 17, 3] if ctx.dry else [1, 5, 17, 40, 100, 3, 64, 9]
    max_new = 8 if ctx.dry else 24
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    for arch in ("llama", "qwen3"):
        path = build_tiny_model(arch, os.path.join(root, f"tiny-{arch}"))
        expected = hf_greedy(path, prompts, max_new, dev)
        for graphs in (True, False):
            config = EngineConfig.build(
                path=path, device=dev.type, dtype="float32", block_size=16 if not ctx.dry else 4,
                num_kv_blocks=256, max_num_batched_tokens=32 if not ctx.dry else 8, max_num_seqs=8,
                kernels="triton",
                enforce_eager=not graphs,
            )  # fmt: skip
            engine = LLM(config)
            runner = engine.runner
            if graphs and ctx.dry:
                from subway.worker.cuda_graph import DecodeGraphs

                runner.graphs = DecodeGraphs(runner, [1, 2, 4, 8], capture=False)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            verdicts = [
                compare(o.token_ids, o.top_ids, e) for o, e in zip(outs, expected, strict=True)
            ]
            equal = verdicts.count("equal")
            ties = verdicts.count("near-tie")
            replays = runner.graphs.replays if runner.graphs is not None else 0
            mode = "graphs" if graphs else "eager"
            if ctx.dry and graphs:
                mode += " (emulated)"
            ok = equal + ties == len(prompts) and ties <= 1 and (replays > 0) == graphs
            steps = engine.scheduler.stats.num_steps_total
            rep.log(f"  {arch} {mode}: {verdicts}; {steps} steps, {replays} replays")
            rep.row(
                f"greedy = HF, tiny {arch}, {mode}",
                "PASS" if ok else "FAIL",
                f"{equal}/{len(prompts)} equal, {ties} near-tie, {replays} graph replays, "
                f"{elapsed:.1f}s",
            )
            del engine, runner
            free(dev)


def tiny_tokenizer(out_dir: str) -> None:
    """A character-level tokenizer for the tiny models (ids 3.. are printable ASCII; no
    hub here): what the worker's grammar compiler is built from."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(c): 3 + i for i, c in enumerate(range(32, 127))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)


def check_grammar(ctx: Ctx, root: str) -> None:
    """Structured outputs on the device: rank 0's bitmask copied to it and applied there
    (xgrammar's CUDA kernel), with CUDA graphs and without. Regex-constrained requests,
    greedy and sampled, beside free ones: the constrained text matches, the free tokens
    equal transformers."""
    import re

    from transformers import AutoTokenizer

    from subway.ipc.config import EngineConfig
    from subway.ipc.messages import Grammar, SamplingParams
    from subway.llm import LLM

    dev, rep = ctx.device, ctx.report
    path = build_tiny_model("llama", os.path.join(root, "tiny-grammar"))
    tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    pattern = "(ab|cd)[a-e]{2,6}"
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 98) for _ in range(n)] for n in (4, 9, 2, 15)]
    max_new = 8 if ctx.dry else 16
    free_params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    grammar = Grammar("regex", pattern)
    constrained = [SamplingParams(temperature=0.0, max_tokens=12, grammar=grammar)] + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=12, grammar=grammar) for s in (1, 2, 3)
    ]
    expected = hf_greedy(path, prompts, max_new, dev)
    for graphs in (True, False):
        config = EngineConfig.build(
            path=path, device=dev.type, dtype="float32", block_size=16 if not ctx.dry else 4,
            num_kv_blocks=256, max_num_batched_tokens=32 if not ctx.dry else 8, max_num_seqs=8,
            kernels="triton", enforce_eager=not graphs,
        )  # fmt: skip
        engine = LLM(config)
        free_ids = [engine.add(p, free_params) for p in prompts]
        held_ids = [engine.add(p, sp) for p, sp in zip(prompts, constrained, strict=True)]
        outputs: dict = {}
        t0 = time.perf_counter()
        engine.run(outputs)
        elapsed = time.perf_counter() - t0
        free_ok = sum(
            compare(outputs[i].token_ids, outputs[i].top_ids, e) in ("equal", "near-tie")
            for i, e in zip(free_ids, expected, strict=True)
        )
        texts = [tok.decode([t for t in outputs[i].token_ids if t != 2]) for i in held_ids]
        held_ok = sum(bool(re.fullmatch(pattern, t)) for t in texts)
        mode = "graphs" if graphs else "eager"
        rep.log(f"  grammar, {mode}: constrained {texts}; free {free_ok}/{len(prompts)} equal")
        ok = free_ok == len(prompts) and held_ok == len(held_ids)
        rep.row(
            f"grammar-constrained beside free, tiny llama, {mode}",
            "PASS" if ok else "FAIL",
            f"{held_ok}/{len(held_ids)} match {pattern!r}, {free_ok}/{len(prompts)} free = HF, "
            f"{elapsed:.1f}s",
        )
        engine.runner.close()  # joins the grammar compile threads
        del engine
        free(dev)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}  # fmt: skip
TINY_SHAPES = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def random_weights(model, path: str) -> None:
    """Stands in for the checkpoint loader: N(0, 0.02) weights, unit norms."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def drive(engine, deadline: float) -> dict:
    """The engine's loop (no overlap), each step timed, stopped at `deadline`."""
    stats = {"steps": 0, "out_tokens": 0, "finished": 0, "decode": [], "timed_out": False}
    runner = engine.runner
    execute = runner.execute

    def timed(plan):  # noqa: ANN001, ANN202
        ts = time.perf_counter()
        out = execute(plan)
        stats["steps"] += 1
        if all(s.num_tokens == 1 for s in plan.seqs):
            stats["decode"].append((len(plan.seqs), time.perf_counter() - ts))
        return out

    def on_deltas(deltas) -> None:  # noqa: ANN001
        for d in deltas:
            stats["out_tokens"] += len(d.token_ids)
            stats["finished"] += d.finish_reason is not None

    runner.execute = timed
    engine.core.depth = 1
    t0 = time.perf_counter()
    try:
        done = engine.core.run(on_deltas, stop=lambda: time.perf_counter() > deadline)
    finally:
        runner.execute = execute
    stats["timed_out"] = not done
    stats["elapsed"] = time.perf_counter() - t0
    return stats


def check_throughput(ctx: Ctx, root: str, runs: list[tuple] | None = None) -> None:
    """Engine tokens/s on Llama-3-8B shapes, random weights. `runs`: (name, kernels, eager,
    quantization, kv_cache_dtype) each; by default bfloat16 with CUDA graphs, eager, and
    torch's reference."""
    import subway.worker.runner as runner_mod
    from subway.ipc.config import EngineConfig
    from subway.ipc.messages import SamplingParams
    from subway.llm import LLM
    from subway.worker.kv_cache import block_bytes

    dev, rep = ctx.device, ctx.report
    cfg = {**LLAMA3_8B, **(TINY_SHAPES if ctx.dry else {})}
    path = os.path.join(root, "llama3-8b-shapes")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if ctx.dry and any(r[3] != "none" for r in runs or []):
        tiny_tokenizer(path)  # the CPU's int8 smooths the lm_head over tokenized text
    if ctx.dry:
        n_req, plo, phi, out_len = 6, 4, 20, 6
    else:
        n_req, plo, phi, out_len = 256, 256, 768, 128
    rng = random.Random(1)
    prompts = [
        [rng.randrange(3, cfg["vocab_size"]) for _ in range(rng.randint(plo, phi))]
        for _ in range(n_req)
    ]
    prompt_tokens = sum(map(len, prompts))
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    rep.log(
        f"  workload: {n_req} requests, prompts {plo}..{phi} tokens ({prompt_tokens} in all), "
        f"{out_len} output tokens each, greedy; model {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, {'float32' if ctx.dry else 'bfloat16'}"
    )
    tri = "auto" if not ctx.dry else "triton"
    runs = runs or [("triton + CUDA graphs", tri, False, "none", "auto"),
                    ("triton eager", tri, True, "none", "auto"),
                    ("torch reference eager", "torch", True, "none", "auto")]  # fmt: skip
    saved_loader = runner_mod.load_weights
    runner_mod.load_weights = random_weights
    try:
        for name, kernels, eager, quantization, kv_dtype in runs:
            if ctx.left() < 60:
                rep.row(f"throughput {name}", "SKIP", f"{ctx.left():.0f}s of the budget left")
                continue
            config = EngineConfig.build(
                path=path, device=dev.type, dtype="float32" if ctx.dry else "bfloat16",
                max_model_len=2048, max_num_seqs=256 if not ctx.dry else 4,
                max_num_batched_tokens=2048 if not ctx.dry else 16,
                gpu_memory_utilization=0.85, enable_prefix_caching=False,
                kernels=kernels, quantization=quantization, kv_cache_dtype=kv_dtype,
                kv_cache_memory=64 << 20, enforce_eager=eager,
            )  # fmt: skip
            t0 = time.perf_counter()
            engine = LLM(config)
            runner = engine.runner
            if ctx.dry and not eager:
                from subway.worker.cuda_graph import DecodeGraphs

                runner.graphs = DecodeGraphs(runner, [1, 2, 4], capture=False)
            init_s = time.perf_counter() - t0
            layers, kv_heads, head_dim = runner.kv_shape
            per_block = block_bytes(
                layers, runner.block_size, kv_heads, head_dim, runner.dtype, kv_dtype == "int8"
            )
            kv_bytes = runner.num_blocks * per_block
            ctx.kv_blocks[name] = runner.num_blocks
            rep.log(
                f"  {name}: init {init_s:.1f}s, KV cache {kv_bytes / 2**30:.2f} GiB "
                f"({runner.num_blocks} blocks), graphs "
                f"{sorted(runner.graphs.sizes) if runner.graphs is not None else None}"
            )
            if name == "triton + CUDA graphs":
                memory_row(ctx, runner, kv_bytes)
            engine.generate([p[:8] for p in prompts[:4]], SamplingParams(temperature=0.0,
                            max_tokens=4, ignore_eos=True))  # fmt: skip
            for p in prompts:
                engine.add(p, params)
            limit = min(ctx.left() - 30, 30 if ctx.dry else 100)
            stats = drive(engine, time.perf_counter() + limit)
            el = stats["elapsed"]
            dec = stats["decode"]
            big = [dt for n, dt in dec if n >= max(1, max((n for n, _ in dec), default=1) // 2)]
            step_ms = f", decode step {np.median(big) * 1e3:.1f} ms" if big else ""
            total = (
                f", {(prompt_tokens + stats['out_tokens']) / el:.0f} tok/s in+out"
                if not stats["timed_out"]
                else ""
            )
            detail = (
                f"{stats['out_tokens'] / el:.0f} out tok/s{total}{step_ms}; "
                f"{stats['finished']}/{n_req} done in {el:.1f}s, {stats['steps']} steps"
            )
            if stats["timed_out"]:
                detail += " (stopped at its time limit)"
            if ctx.dry:
                detail += " (CPU dry run)"
            rep.row(f"throughput {name}", "-" if stats["finished"] else "FAIL", detail)
            ctx.tok_s[name] = stats["out_tokens"] / el
            del engine, runner
            free(dev)
    finally:
        runner_mod.load_weights = saved_loader


def check_quant(ctx: Ctx, root: str) -> None:
    """`--quantization int8` on the GPU (worker/quant_gpu.py): each 8-bit path the device
    runs against bfloat16's linear at Llama-3-8B shapes (error, time), then the engine in
    bfloat16 and in 8 bits, side by side, and the ratio of their output tokens/s."""
    import torch.nn.functional as F

    from subway.worker.quant_gpu import ERROR_BOUND, ScaledLinear, gpu_path

    dev, rep = ctx.device, ctx.report
    note = " (CPU dry run: not a speed)" if ctx.dry else ""
    paths = ["int8"] if gpu_path(dev) == "int8" else ["fp8", "int8"]
    shapes = [(64, 128)] if ctx.dry else [(4096, 6144), (4096, 28672), (14336, 4096)]
    rows = (1, 37) if ctx.dry else (1, 16, 256, 2048)
    g = torch.Generator().manual_seed(3)
    for k, n in shapes:
        w = (torch.randn(n, k, generator=g) * 0.02).to(dev, torch.bfloat16)
        lins = {p: ScaledLinear(w, p) for p in paths}
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            t_bf16 = bench(lambda x=x, w=w: F.linear(x, w), dev)
            parts = [f"bf16 {t_bf16:.3f} ms"]
            for p, lin in lins.items():
                err = rel_err(lin(x).float(), ref)
                t = bench(lambda x=x, lin=lin: lin(x), dev)
                parts.append(f"{p} {t:.3f} ms ({t_bf16 / t:.2f}x), err {err:.3f}")
                if err >= ERROR_BOUND[p]:
                    rep.row(f"quant {p} {m}x{k}->{n}", "FAIL", f"error {err:.3f}")
            rep.row(f"quant linear {m}x{k}->{n}", "-", ", ".join(parts) + note)
        del w, lins
        free(dev)
    check_kv8_kernels(ctx)
    tri = "auto" if not ctx.dry else "triton"
    eager = ctx.dry  # the dry run's graphs are emulated; the runs here need none
    runs = [("bf16 (quant)", tri, eager, "none", "auto"),
            ("int8 (quant)", tri, eager, "int8", "auto"),
            ("int8 + kv8 (quant)", tri, eager, "int8", "int8")]  # fmt: skip
    check_throughput(ctx, root, runs)
    base = "bf16 (quant)"
    for name in ("int8 (quant)", "int8 + kv8 (quant)"):
        if {base, name} <= ctx.tok_s.keys():
            ratio = ctx.tok_s[name] / ctx.tok_s[base]
            blocks = ctx.kv_blocks[name] / ctx.kv_blocks[base]
            rep.row(f"quant: {name[:-8]} over bf16", "-",
                    f"{ratio:.2f}x out tok/s ({paths[0]}), {blocks:.2f}x KV blocks{note}")  # fmt: skip


def check_kv8_kernels(ctx: Ctx) -> None:
    """The Triton kernels on an 8-bit cache: write_kv's bytes against quantize_kv's, and
    attention over the int8 blocks against the reference over their dequantized values."""
    from subway.kernels import attention as ref_attn
    from subway.kernels import triton_attention as tri_attn

    dev, rep = ctx.device, ctx.report
    for i, case in enumerate(attention_cases(ctx.dry)[:3]):
        dtype = ctx.low
        q, kc, vc, md = make_attention(case, dtype, dev, seed=7)
        caches = []
        for c in (kc, vc):
            q8 = ref_attn.quantize_kv(torch.nan_to_num(c.float(), nan=0.0))
            caches += [q8, ref_attn.dequantize_kv(q8, torch.float32)]
        k8, k_ref, v8, v_ref = caches
        scale = case.head_dim**-0.5
        want = ref_attn.paged_attention(q.float(), k_ref, v_ref, md, scale)
        got = tri_attn.paged_attention(q, k8, v8, md, scale)
        err = rel_err(got.float(), want)
        ok = err < TOL[dtype]
        rep.row(f"kv8 attention {case.name}", "PASS" if ok else "FAIL", f"rel err {err:.2e}")
        if i == 0:  # the write: the same bytes as the reference's
            t = min(64, q.shape[0])
            k = torch.randn(t, case.kv_heads, case.head_dim, device=dev).to(dtype)
            slots = torch.randperm(k8.shape[0] * k8.shape[1], device=dev)[:t]
            mine, ref = k8.clone(), k8.clone()
            tri_attn.write_kv(k, k, mine, mine.clone(), slots)
            ref_attn.write_kv(k, k, ref, ref.clone(), slots)
            same = torch.equal(mine, ref)
            diff = (mine != ref).sum().item()
            rep.row("kv8 write_kv = quantize_kv", "PASS" if same else "FAIL",
                    f"{t} tokens, {diff} bytes differ")  # fmt: skip
        del q, kc, vc, caches, k8, v8
        free(dev)


def memory_row(ctx: Ctx, runner, kv_bytes: int) -> None:
    """The KV cache took `--gpu-memory-utilization` of the device, less the profiled step."""
    if ctx.device.type != "cuda":
        want = runner.config.cache.kv_cache_memory
        per_block = kv_bytes // runner.num_blocks
        ok = runner.num_blocks == want // per_block
        ctx.report.row(
            "memory: KV from --kv-cache-memory",
            "PASS" if ok else "FAIL",
            f"{runner.num_blocks} blocks, {kv_bytes / 2**20:.1f} MiB of {want / 2**20:.0f} MiB",
        )
        return
    free_b, total = torch.cuda.mem_get_info(ctx.device)
    used = total - free_b
    util = runner.config.cache.gpu_memory_utilization
    ok = used <= total * (util + 0.02) and used >= total * (util - 0.10)
    ctx.report.row(
        "memory: KV from --gpu-memory-utilization",
        "PASS" if ok else "FAIL",
        f"KV {kv_bytes / 2**30:.1f} GiB; device used {used / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB ({used / total:.2f}, asked {util})",
    )


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreted")
    p.add_argument("--log", default="", help="full log (default: $OUT/gpu_check.log or ./)")
    p.add_argument(
        "--sections",
        default="",
        help="comma-separated subset of compile,kernels,timing,equality,grammar,throughput,quant "
        "(default: all; compile only with --dry-run, where it checks sm_90)",
    )
    p.add_argument("--arch", default="9.0", help="compile check target (major.minor)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check")
    a = p.parse_args(argv)
    if a.dry_run:
        # Triton reads this when it is first imported, which nothing here has done yet.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on the CPU", file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT")
    log = a.log or os.path.join(out_dir or ".", "gpu_check.log")
    report = Report(log)
    device = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    ctx = Ctx(device, a.dry_run, report, time.perf_counter(), a.budget)
    import triton

    report.log(
        f"gpu_check{' --dry-run' if a.dry_run else ''}: python {platform.python_version()}, "
        f"torch {torch.__version__}, triton {triton.__version__}, device "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}"
    )
    if a.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(0)
    default = "kernels,timing,equality,grammar,throughput,quant"
    sections = set((a.sections or (("compile," + default) if a.dry_run else default)).split(","))
    arch = tuple(int(x) for x in a.arch.split("."))
    with tempfile.TemporaryDirectory(prefix="subway-gpu-check-") as root:
        if "compile" in sections:
            section(report, "compile", lambda: compile_in_child(report, arch))
        if "kernels" in sections:
            section(report, "kernels", lambda: check_kernels(ctx))
        if "timing" in sections:
            section(report, "timing", lambda: time_kernels(ctx))
        if "equality" in sections:
            section(report, "equality", lambda: check_equality(ctx, root))
        if "grammar" in sections:
            section(report, "grammar", lambda: check_grammar(ctx, root))
        if "throughput" in sections:
            section(report, "throughput", lambda: check_throughput(ctx, root))
        if "quant" in sections:
            section(report, "quant", lambda: check_quant(ctx, root))
    elapsed = time.perf_counter() - ctx.t_start
    report.log(f"\nfull log: {os.path.abspath(log)}; {elapsed:.0f}s in all\n")
    report.log(report.table())
    report.close()
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
