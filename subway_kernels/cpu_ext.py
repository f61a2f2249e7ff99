"""The CPU kernels in `subway_kernels/csrc/`, compiled on first use with torch's C++ extension builder.

The build is cached (under ~/.cache/subway/ext/<key>, or $SUBWAY_CACHE/ext/<key>: one folder
per Python environment and checkout, `cache_dir.kernel_build_dir`) and compiled for the
machine it runs on. torch guards a build with a lock file that a
killed build leaves behind, and every later load would wait for it forever;
so a load first takes an `flock` of its own (the kernel drops it when its
holder dies), and under it any torch lock file left in the folder is stale. Where there is no compiler `load()` returns None and
callers keep the plain PyTorch reference. Whether a model uses them at all is
`ModelConfig.cpu_ext` (`--no-cpu-ext`), read once by `dispatch.choose_kernels`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading

from subway.progress import Ticker

log = logging.getLogger("subway.kernels")

SOURCES = (
    "paged_decode_cpu.cpp", "ops_cpu.cpp", "mask_cpu.cpp", "gemv_cpu.cpp", "argmax_cpu.cpp",
    "paged_decode_int8_cpu.cpp",
    "quant_cpu.cpp", "amx_linear_cpu.cpp", "amx_int8_cpu.cpp", "decode_layers_cpu.cpp",
    "avx2_int8_cpu.cpp", "lora_cpu.cpp", "avx512_int8_cpu.cpp",
)  # fmt: skip
_lock = threading.Lock()
_state: dict[str, object] = {}


CSRC = os.path.join(os.path.dirname(__file__), "csrc")


def _build_dir() -> str:
    from subway.cache_dir import kernel_build_dir

    path = kernel_build_dir(CSRC)
    os.makedirs(path, exist_ok=True)
    return path


def load():
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            from torch.utils import cpp_extension

            build = _build_dir()
            with open(os.path.join(build, "subway.flock"), "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)  # another process's build: wait for it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(build, "lock"))  # torch's, from a killed build
                # Cached, this takes well under a second; a build (once per environment,
                # checkout and source change) about 100 s on 2 cores, said every 10 s.
                what = f"building the C++ CPU kernels into {build} (about 100 s on 2 cores)"
                with Ticker(what):
                    module = cpp_extension.load(
                        name="subway_cpu_kernels",
                        sources=[os.path.join(CSRC, f) for f in SOURCES],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                        extra_ldflags=["-fopenmp"],
                        build_directory=build,
                        verbose=False,
                    )
        except Exception as e:  # no compiler, no headers: the reference still works
            log.warning("CPU kernels unavailable, using the PyTorch reference: %s", e)
        _state["module"] = module
        return module
