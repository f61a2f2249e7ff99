"""`subway env`: what a bug report needs about this machine, in about a second.

As vLLM's `collect-env`: versions, the CPU and which kernel path each op takes on it and
why, whether the C++ kernels are built and where, the default model's cache, free shared
memory, the threads `serve` will use. torch is not imported (it alone takes seconds):
versions come from the installed packages' metadata, the CPU's abilities from
/proc/cpuinfo, and the kernel paths follow the same rules as the kernels' own checks
(`subway_kernels/csrc/`: the build is `-march=native`, so what the CPU has is what was
compiled in).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata

import psutil

PACKAGES = ("subway", "torch", "transformers", "tokenizers", "xgrammar", "pyzmq", "msgspec",
            "triton", "numpy", "gguf", "uvloop", "psutil")  # fmt: skip
# The CPU flags the kernels are compiled for (Linux /proc/cpuinfo names).
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
         "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip
EXT_NAME = "subway_cpu_kernels"


@dataclass(frozen=True)
class Cpu:
    model: str
    cores: int  # usable by this process
    flags: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)


def read_cpu(cpuinfo: str | None = None) -> Cpu:
    """The CPU from /proc/cpuinfo (or `cpuinfo`'s text); elsewhere its name from platform."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Cpu(model=model, cores=cores or 1, flags=flags)


def kernel_paths(cpu: Cpu) -> list[tuple[str, str, str]]:
    """(op, path, why) for each CPU op with more than one path, by the kernels' own rules."""
    avx512 = cpu.has("avx512f")
    avx2 = cpu.has("avx2", "fma", "f16c")
    bf16 = cpu.has("avx512f", "avx512_bf16")
    amx = cpu.has("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16")
    vnni = cpu.has("avx512_vnni") or cpu.has("avx_vnni")
    simd = "AVX-512" if avx512 else "AVX2" if avx2 else "reference (PyTorch)"
    simd_why = (
        "the CPU has AVX-512F"
        if avx512
        else "AVX2 with FMA and F16C, no AVX-512"
        if avx2
        else "neither AVX-512 nor AVX2: the compiled op is the scalar or PyTorch path"
    )
    if bf16:
        one_row, one_why = "AVX512-BF16 dot products", "the CPU has AVX512_BF16"
    elif avx2:
        one_row, one_why = "AVX2 (its own weight layout)", "no AVX512_BF16; AVX2 with FMA"
    else:
        one_row, one_why = "oneDNN (PyTorch)", "neither AVX512_BF16 nor AVX2"
    if amx:
        few_rows, few_why = "AMX tiles from 5 rows", "the CPU has AMX-BF16 (granted per process)"
    else:
        few_rows, few_why = one_row + " up to the few-row limit, then oneDNN", "no AMX"
    if amx:
        int8, int8_why = "AMX int8 tiles", "AMX-INT8 (inputs a multiple of 64; else the next)"
    elif avx2:
        int8, int8_why = "AVX2 int8 (exact int32 sums)", "no AMX; chosen before oneDNN"
    elif vnni:
        int8, int8_why = "oneDNN with VNNI", "no AMX, no AVX2"
    else:
        int8, int8_why = "refused", "neither AVX2 nor VNNI: --quantization int8 is refused"
    return [
        ("decode attention (paged)", simd, simd_why),
        ("RMSNorm, rotary + KV write", simd, simd_why),
        ("bfloat16 linear, 1 row (decode)", one_row, one_why),
        ("bfloat16 linear, few rows", few_rows, few_why),
        ("bfloat16 linear, prefill", "oneDNN (PyTorch), packed weights", "many rows"),
        ("int8 linear (--quantization int8)", int8, int8_why),
        ("8-bit KV cache", simd, simd_why),
    ]


def built_kernels() -> dict[str, object]:
    """Where the compiled kernels are (or would be built) for this environment and
    checkout, and whether they are there. The sources are found without importing the
    kernels' package (its modules import torch)."""
    from importlib.util import find_spec

    from subway.cache_dir import kernel_build_dir

    spec = find_spec("subway.kernels")
    locations = list(spec.submodule_search_locations or []) if spec else []
    folder = kernel_build_dir(os.path.join(locations[0], "csrc")) if locations else "?"
    lib = os.path.join(folder, f"{EXT_NAME}.so")
    compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    out: dict[str, object] = {"folder": folder, "built": os.path.exists(lib), "compiler": compiler}
    if out["built"]:
        out["size_mb"] = round(os.path.getsize(lib) / 2**20, 1)
    return out


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def collect() -> dict[str, object]:
    """Everything `subway env` prints, as plain data (`--json` prints this)."""
    from subway.cache_dir import cache_root
    from subway.worker.default_model import DEFAULT_MODEL_NAME

    cpu = read_cpu()
    cache = cache_root()
    model_dir = os.path.join(cache, DEFAULT_MODEL_NAME)
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    threads = os.environ.get("OMP_NUM_THREADS")
    mem = psutil.virtual_memory()
    memory = {"total_gb": round(mem.total / 2**30, 1), "free_gb": round(mem.available / 2**30, 1)}
    # torch's default, where OMP_NUM_THREADS is unset: one thread per physical core.
    physical = min(psutil.cpu_count(logical=False) or cpu.cores, cpu.cores)
    return {
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "venv": sys.prefix != sys.base_prefix,
        },  # fmt: skip
        "platform": platform.platform(),
        "packages": versions(),
        "cpu": {
            "model": cpu.model,
            "cores": cpu.cores,
            "flags": [f for f in FLAGS if f in cpu.flags],
        },  # fmt: skip
        "kernels": [{"op": o, "path": p, "why": w} for o, p, w in kernel_paths(cpu)],
        "cpu_ext": built_kernels(),
        "default_model": {
            "folder": model_dir,
            "ready": os.path.exists(os.path.join(model_dir, "config.json")),
        },
        "dev_shm_free_gb": round(shm.free / 2**30, 1) if shm else None,
        "memory": memory,
        "transparent_huge_pages": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "serve_threads": int(threads) if threads and threads.isdigit() else physical,
        "gpu": {
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvidia_smi": shutil.which("nvidia-smi"),
        },  # fmt: skip
    }


def render(info: dict) -> str:
    """`collect()`'s data as the text `subway env` prints."""
    lines = ["Subway environment (paste this into a bug report)", ""]
    py = info["python"]
    lines.append(
        f"Python        {py['version']}  {py['executable']}" + ("  (venv)" if py["venv"] else "")
    )
    lines.append(f"Platform      {info['platform']}")
    lines.append("Packages      " + ", ".join(f"{k} {v}" for k, v in info["packages"].items()))
    cpu = info["cpu"]
    lines.append(f"CPU           {cpu['model']}, {cpu['cores']} cores usable")
    lines.append(f"CPU flags     {' '.join(cpu['flags']) or 'none of ' + ' '.join(FLAGS)}")
    mem = info["memory"]
    lines.append(f"Memory        {mem['total_gb']} GiB, {mem['free_gb']} GiB available")
    lines.append(f"/dev/shm      {info['dev_shm_free_gb']} GiB free")
    lines.append(f"Huge pages    {info['transparent_huge_pages']}")
    lines.append(f"serve threads {info['serve_threads']} per worker (--threads, OMP_NUM_THREADS)")
    ext = info["cpu_ext"]
    state = f"built ({ext['size_mb']} MB)" if ext["built"] else "not built yet (built at first use)"
    lines.append(f"C++ kernels   {state} in {ext['folder']}; compiler: {ext['compiler'] or 'none'}")
    dm = info["default_model"]
    lines.append(
        f"Default model {'ready' if dm['ready'] else 'not converted yet'} in {dm['folder']}"
    )
    gpu = info["gpu"]
    lines.append(f"GPU           nvidia-smi: {gpu['nvidia_smi'] or 'not found'}")
    lines += ["", "Kernel path of each CPU op (with the C++ kernels built):"]
    width = max(len(k["op"]) for k in info["kernels"])
    for k in info["kernels"]:
        lines.append(f"  {k['op']:<{width}}  {k['path']}  ({k['why']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="subway env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the data as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0
