"""The configuration: frozen parts, flat names, JSON between processes, flags made from fields."""

from __future__ import annotations

import dataclasses

import pytest

from subway.ipc.config import EngineConfig, ParallelConfig, field_owners, parts
from subway.tools.cli import add_engine_args, config_from_args


def _parse(*argv: str) -> EngineConfig:
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from_args(p.parse_args(list(argv)))


def _flat(c: EngineConfig) -> dict:
    return {f.name: getattr(getattr(c, part), f.name) for part, cls in parts()
            for f in dataclasses.fields(cls)}  # fmt: skip


def test_flags_default_to_the_fields():
    """No flag: every value is the field's default (one place for each default)."""
    got, want = _flat(_parse("--run-id", "x")), _flat(EngineConfig.build(run_id="x"))
    assert got == want


def test_flags_reach_their_parts():
    c = _parse("--model", "/m/tiny", "-tp", "2", "--no-overlap", "--enforce-eager",
               "--block-size", "4", "--policy", "edf", "--kv-cache-memory", "123",
               "--no-shm", "--kernels", "torch", "--port", "9")  # fmt: skip
    assert c.model.path == "/m/tiny" and c.model.served_model_name == "tiny"
    assert c.parallel.tensor_parallel_size == 2 and c.scheduler.overlap is False
    assert c.model.enforce_eager is True and c.cache.block_size == 4
    assert c.scheduler.policy == "edf" and c.cache.kv_cache_memory == 123
    assert c.ipc.use_shm is False and c.model.kernels == "torch" and c.server.port == 9
    with pytest.raises(SystemExit):
        _parse("--policy", "lifo")


def test_parts_are_frozen_and_names_unique():
    c = EngineConfig.build(block_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cache.block_size = 8  # type: ignore[misc]
    names = [f.name for _, cls in parts() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(field_owners())
    with pytest.raises(TypeError, match="no field"):
        EngineConfig.build(blocksize=4)


def test_json_round_trip_and_derived_defaults():
    c = EngineConfig.build(run_dir="/tmp/subway-x", run_id="abc", path="/a/b", overlap=False)
    assert c.ipc.plan_addr == "ipc:///tmp/subway-x/plan.sock"
    assert c.ipc.prompt_shm_name == "subway_abc_prompts"
    back = EngineConfig.from_json(c.to_json())
    assert back == c and back.model.served_model_name == "b"
    r = c.replace(port=1, block_size=2)
    assert (r.server.port, r.cache.block_size, r.scheduler.overlap) == (1, 2, False)
    assert c.server.port == 8000  # the original is untouched


def test_serve_gives_each_engine_its_own_rendezvous_port():
    from subway.tools.launch import own_rendezvous

    default = ParallelConfig().dist_init_addr
    one = EngineConfig.build(tensor_parallel_size=1)
    assert own_rendezvous(one) is one  # no ranks to meet
    a = own_rendezvous(EngineConfig.build(tensor_parallel_size=2))
    b = own_rendezvous(EngineConfig.build(tensor_parallel_size=2))
    assert default not in (a.parallel.dist_init_addr, b.parallel.dist_init_addr)
    assert a.parallel.dist_init_addr.startswith("127.0.0.1:")
    mine = EngineConfig.build(tensor_parallel_size=2, dist_init_addr="127.0.0.1:4000")
    assert own_rendezvous(mine).parallel.dist_init_addr == "127.0.0.1:4000"


def test_curve_key_file_flag_reaches_the_ipc_part():
    c = _parse("--curve-key-file", "/k/engine.key", "--plan-addr", "tcp://10.0.0.1:5000")
    assert c.ipc.curve_key_file == "/k/engine.key" and c.ipc.plan_addr == "tcp://10.0.0.1:5000"
    assert EngineConfig.from_json(c.to_json()).ipc.curve_key_file == "/k/engine.key"


def test_keygen_writes_a_0600_key_file_once(tmp_path, capsys):
    import os
    import stat

    from subway.ipc.curve import load_key_file
    from subway.tools.cli import main

    path = str(tmp_path / "engine.key")
    assert main(["keygen", path]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys = load_key_file(path)
    assert keys.public.decode() in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exists"):
        main(["keygen", path])
    assert load_key_file(path) == keys  # not overwritten


def test_a_process_on_tcp_needs_a_usable_key_file(tmp_path, monkeypatch):
    """Refused with a message naming the flag, before anything starts."""
    import os

    from subway.ipc.curve import write_key_file
    from subway.tools.cli import main

    monkeypatch.delenv("SUBWAY_PARENT_PID", raising=False)
    tcp = ["--scheduler-addr", "tcp://127.0.0.1:1", "--run-id", "t1", "--run-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="--curve-key-file"):
        main(["scheduler", *tcp])
    key = str(tmp_path / "engine.key")
    write_key_file(key)
    os.chmod(key, 0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        main(["worker", *tcp, "--curve-key-file", key])


def test_lora_flags_and_their_refusals():
    c = _parse("--lora-modules", "sql=/a/sql", "fr=/a/fr", "--max-loras", "2")
    assert c.lora.enable_lora and c.lora.modules() == [("sql", "/a/sql"), ("fr", "/a/fr")]
    assert c.lora.cpu_loras == 2 and EngineConfig.from_json(c.to_json()) == c
    for argv, why in (
        (("--lora-modules", "sql"), "NAME=PATH"),
        (("--max-loras", "0"), "--max-loras"),
        (("--max-lora-rank", "65"), "--max-lora-rank"),
        (("--max-loras", "4", "--max-cpu-loras", "2"), "--max-cpu-loras"),
    ):
        with pytest.raises(SystemExit, match=why):  # a one-line message, not a traceback
            _parse(*argv)
