"""Shared memory is reserved up front: a /dev/shm without room is an error at start.

A POSIX shared-memory file is sparse until written, so the base commit's token
buffers took no room when made and faulted (SIGBUS, the process gone) on the
first write to a page /dev/shm had no room for: in the middle of serving. Now
`TokenBuffer.create` commits every page (`ipc.shm.reserve`) and a lack of room
is a `ShmSpaceError` naming the size and /dev/shm, when the buffer is made.

Real ENOSPC comes from a small tmpfs mounted over /dev/shm in a private mount
namespace (`unshare --map-root-user --mount`: no privilege needed where user
namespaces are allowed); the rest fakes it with a monkeypatched posix_fallocate.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import httpx
import pytest

from subway.ipc.config import IpcConfig

from serving import free_port, until

SMALL_SHM = "128k"  # the tmpfs over /dev/shm: room for the sampled-id buffer, not for a ring


def _shm_name() -> str:
    return f"subway_test_{uuid.uuid4().hex[:8]}"


def _no_room(*_args) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True).returncode == 0


needs_unshare = pytest.mark.skipif(
    not _can_unshare(), reason="needs a private mount namespace (unshare -r -m) for a tiny tmpfs"
)


def _small_shm(*cmd: str) -> list[str]:
    """`cmd` with a tmpfs of SMALL_SHM over /dev/shm, seen by it alone."""
    mount = f'mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-r", "-m", "sh", "-c", mount, "sh", *cmd]


def test_no_room_is_a_typed_error_naming_the_size_and_dev_shm(monkeypatch):
    from subway.ipc.shm import ShmSpaceError, TokenBuffer

    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    name = _shm_name()
    with pytest.raises(ShmSpaceError) as e:
        TokenBuffer.create(name, 1000, hint="or lower --the-flag")
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    for part in ("4000 bytes", "/dev/shm", name, "--the-flag", "No space left"):
        assert part in str(e.value)
    assert not os.path.exists(f"/dev/shm/{name}")  # nothing left behind


def test_the_prompt_ring_says_which_flags_help(monkeypatch):
    from subway.frontend.prompt_ring import PromptRing
    from subway.ipc.shm import ShmSpaceError

    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    ipc = IpcConfig(run_id=f"t{uuid.uuid4().hex[:8]}", prompt_shm_tokens=1 << 10)
    with pytest.raises(ShmSpaceError, match="--prompt-shm-tokens.*--no-shm"):
        PromptRing.create(ipc)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(ipc.prompt_shm_name)]


@pytest.mark.parametrize("fallocate", ["posix_fallocate", "writes"])
def test_every_page_is_committed_when_made(monkeypatch, fallocate):
    """The file's blocks are all allocated (the base commit's were 0: sparse); without
    fallocate in the file system, by writing zeros through the fd."""
    from subway.ipc.shm import TokenBuffer, reserve

    if fallocate == "writes":
        unsupported = OSError(errno.EOPNOTSUPP, "unsupported")
        monkeypatch.setattr(os, "posix_fallocate", lambda *_: (_ for _ in ()).throw(unsupported))
    capacity = 300_000  # 1.2 MB: not a whole number of pages
    buf = TokenBuffer.create(_shm_name(), capacity)
    try:
        st = os.stat(f"/dev/shm/{buf.name}")
        assert st.st_blocks * 512 >= capacity * 4
        reserve(buf._shm, capacity * 4)  # again: a no-op, and the fd form is the same
        reserve(buf._shm._fd, capacity * 4)
        assert (buf.array == 0).all()
    finally:
        buf.close()


_FILL = textwrap.dedent(
    """
    import sys
    from subway.ipc.shm import TokenBuffer
    try:
        buf = TokenBuffer.create("subway_test_fill", 1 << 20)  # 4 MiB, in a 128 KiB /dev/shm
    except OSError as e:
        print(type(e).__name__, e)
        sys.exit(3)
    buf.array[:] = 7  # every page written, as a ring is over time
    print("wrote every page")
    """
)


@needs_unshare
def test_a_full_dev_shm_fails_at_creation_not_with_sigbus_on_a_write():
    """Real ENOSPC from the kernel. The base commit made the buffer and died of SIGBUS
    (exit -7) writing it; now the creation raises ShmSpaceError and nothing faults."""
    run = subprocess.run(_small_shm(sys.executable, "-c", _FILL), capture_output=True, text=True)
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)
    assert "ShmSpaceError" in run.stdout and "4194304 bytes" in run.stdout
    assert "/dev/shm" in run.stdout


async def _concurrent_prompts(url: str, n: int) -> list[int | str]:
    """`n` prompts of 490 ids (2 KB each in the ring) at once, so that the ring's head
    runs past the room /dev/shm has (runs are freed only at their first token)."""
    body = {"prompt": list(range(10, 500)), "max_tokens": 1}

    async def one(client: httpx.AsyncClient) -> int | str:
        try:
            return (await client.post(url + "/v1/completions", json=body)).status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client) for _ in range(n)))


@pytest.mark.slow
@needs_unshare
def test_serve_with_a_small_dev_shm_stops_at_start_with_the_reason(tiny_models, tmp_path):
    """A live `subway serve` whose /dev/shm cannot hold its prompt ring (16 MiB by
    default) stops at start, saying why. On the base commit it started, and its
    frontend died of SIGBUS on the prompt that first wrote past the room."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "subway.tools.cli", "serve", "--model", tiny_models["qwen2"]]
    cmd += ["--port", str(port), "--run-id", f"t{uuid.uuid4().hex[:8]}"]
    cmd += ["--dist-init-addr", f"127.0.0.1:{free_port()}", "--max-model-len", "512"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(_small_shm(*cmd), stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(lambda: proc.poll() is not None or up(), 120)
        if proc.poll() is None:  # the base commit: it serves until a write faults
            statuses = asyncio.run(_concurrent_prompts(url, 150))
            log.seek(0)
            assert statuses == [200] * 150, (statuses, log.read()[-2000:])
            pytest.fail("serve started with a prompt ring its /dev/shm cannot hold")
        log.seek(0)
        out = log.read()
        assert proc.returncode != 0, out[-2000:]
        assert "ShmSpaceError" in out and "16777216 bytes" in out and "in /dev/shm" in out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
