"""Multi-LoRA serving, the frontend's side: adapters checked without torch (`frontend/lora.py`),
the registry of names and ids, the HTTP routes (`frontend/lora_api.py`), the metrics, the
start-up check, and the adapter id reaching the scheduler's `AddRequest.lora`.

No model runs: adapters are PEFT folders written here (adapter_config.json and a
safetensors file of zeros), next to a hand-written config.json. The routes run in-process
(Starlette's TestClient, no engine behind: what reaches the engines is recorded by patching
their `send_lora` or their links' `send`); the path of a request to the scheduler runs on a
live frontend against `test_frontend.py`'s fake scheduler, which records what it receives.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save_file
from starlette.testclient import TestClient

from subway.frontend.engine_group import EngineGroup
from subway.frontend.errors import APIError
from subway.frontend.lora import (
    MAX_NAME_CHARS,
    TARGETS,
    LoraError,
    LoraRegistry,
    inspect_adapter,
)
from subway.frontend.metrics import Metrics
from subway.frontend.server import build_app
from subway.ipc.config import EngineConfig
from subway.ipc.messages import AddLora, EngineStats, LoraAdapter, RemoveLora

# The tiny model of these tests: hidden 64, 4 heads of 16 (q and o: 64), 2 KV heads (k and v:
# 32), MLP 128, 2 layers. (in, out) features of each module:
MODEL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, num_hidden_layers=2)  # fmt: skip
DIMS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # fmt: skip
BASE = "tiny-base"


def write_model(folder, **fields) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", **MODEL, **fields}, f)
    return str(folder)


def tensor_name(layer: int, module: str, ab: str) -> str:
    block = "self_attn" if TARGETS[module] == "self_attn" else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{ab}.weight"


def write_adapter(
    folder,
    r: int = 8,
    modules=("q_proj", "v_proj"),
    layers=(0, 1),
    dims=DIMS,
    tensors: dict | None = None,
    drop: tuple[str, ...] = (),
    **config,
) -> str:
    """A PEFT folder: adapter_config.json (`config` over PEFT's defaults) and the A and B
    weights of each module of each layer (`tensors` added or replacing, `drop` left out)."""
    os.makedirs(folder, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(modules),
           "bias": "none", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
           "modules_to_save": None, "layers_to_transform": None,
           "base_model_name_or_path": "tiny/base", **config}  # fmt: skip
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    weights = {}
    for layer in layers:
        for module in modules:
            fan_in, fan_out = dims[module]
            weights[tensor_name(layer, module, "A")] = np.zeros((r, fan_in), np.float32)
            weights[tensor_name(layer, module, "B")] = np.zeros((fan_out, r), np.float32)
    weights.update(tensors or {})
    for name in drop:
        weights.pop(name)
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture
def model(tmp_path) -> str:
    return write_model(tmp_path / "model")


# ---------------------------------------------------------------- inspect_adapter


def test_an_adapter_of_every_module_is_accepted_with_its_figures(tmp_path, model):
    path = write_adapter(tmp_path / "a", r=4, modules=tuple(DIMS), layers=(1,), lora_alpha=8)
    info = inspect_adapter(path, model, 16)
    assert (info.rank, info.alpha, info.scaling, info.use_rslora) == (4, 8.0, 2.0, False)
    assert info.targets == tuple(DIMS) and info.layers == (1,)
    assert info.nbytes == sum(4 * 4 * (i + o) for i, o in DIMS.values())
    assert info.base_model == "tiny/base"
    rs = inspect_adapter(write_adapter(tmp_path / "rs", r=4, use_rslora=True), model, 16)
    assert rs.use_rslora and rs.scaling == 8 / 2  # alpha / sqrt(r)
    # `target_modules` may name modules it has no weights for, by suffix; null is taken too.
    wide = write_adapter(tmp_path / "w", target_modules=["model.layers.0.self_attn.q_proj",
                                                         "v_proj", "o_proj"])  # fmt: skip
    assert inspect_adapter(wide, model, 16).targets == ("q_proj", "v_proj")
    assert inspect_adapter(write_adapter(tmp_path / "n", target_modules=None), model, 16)


def test_the_models_defaults_head_dim_and_kv_heads(tmp_path):
    """num_key_value_heads defaults to the heads, head_dim to hidden / heads."""
    model = write_model(tmp_path / "m", num_key_value_heads=None)
    dims = DIMS | {"k_proj": (64, 64), "v_proj": (64, 64)}
    assert inspect_adapter(write_adapter(tmp_path / "a", dims=dims), model, 16).rank == 8
    wide = write_model(tmp_path / "q3", head_dim=32)  # Qwen3: heads x head_dim != hidden
    dims = DIMS | {"q_proj": (64, 128), "k_proj": (64, 64), "o_proj": (128, 64)}
    path = write_adapter(tmp_path / "b", modules=("q_proj", "k_proj", "o_proj"), dims=dims)
    assert inspect_adapter(path, wide, 16).targets == ("q_proj", "k_proj", "o_proj")


BAD_A = tensor_name(1, "q_proj", "B")
REFUSED = [
    (dict(r=32), "the adapter's rank 32 is more than --max-lora-rank 16"),
    (dict(target_modules=["q_proj", "lm_head"]), "target module lm_head: the model has no such layer"),
    (dict(target_modules=".*proj"), "regular expression"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias 'lora_only'"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(r=0), "positive integer"),
    (dict(tensors={BAD_A: np.zeros((96, 8), np.float32)}),
     "base model mismatch: layer 1 q_proj lora_B is [96, 8], the model needs [64, 8]"),
    (dict(tensors={BAD_A: np.zeros((64, 4), np.float32)}),
     "its rank is not r=8: layer 1 q_proj lora_B is [64, 4], the model needs [64, 8]"),
    (dict(tensors={tensor_name(2, "q_proj", "A"): np.zeros((8, 64), np.float32)}),
     "base model mismatch: layer 2 q_proj: the model has 2 layers"),
    (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 9))}),
     "is not a LoRA weight of a decoder layer's projection"),
    (dict(tensors={"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight":
                   np.zeros((8, 64), np.float32)}),
     "target module mlp.q_proj: the model has no such layer"),
    (dict(tensors={BAD_A: np.zeros((64, 8), np.int8)}), "is I8: F32, F16 or BF16 only"),
    (dict(drop=(BAD_A,)), "layer 1 q_proj has no lora_B weight"),
    (dict(modules=(), layers=()), "holds no LoRA weights"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "reason"), REFUSED, ids=[r[:40] for _, r in REFUSED])
def test_each_refusal_says_why(tmp_path, model, change, reason):
    path = write_adapter(tmp_path / "a", **change)
    with pytest.raises(LoraError) as e:
        inspect_adapter(path, model, 16)
    assert reason in str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_missing_and_broken_files_are_refused(tmp_path, model):
    def reason(path: str, model_path: str = model) -> str:
        with pytest.raises(LoraError) as e:
            inspect_adapter(path, model_path, 16)
        return str(e.value)

    assert "is not a folder" in reason(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    assert "adapter_config.json not found" in reason(str(tmp_path / "empty"))
    path = write_adapter(tmp_path / "a")
    weights = os.path.join(path, "adapter_model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[:-10])
    assert "truncated" in reason(path)
    with open(weights, "wb") as f:
        f.write(b"\xff" * 64)
    assert "not a safetensors file" in reason(path)
    os.rename(weights, os.path.join(path, "adapter_model.bin"))
    assert "no adapter_model.safetensors" in reason(path) and "adapter_model.bin" in reason(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    assert "adapter_config.json is not valid JSON" in reason(path)
    good = write_adapter(tmp_path / "b")
    assert "the base model's config.json not found" in reason(good, str(tmp_path / "no-model"))


# ---------------------------------------------------------------- the registry


def lora_config(model: str, *modules: str, **flat) -> EngineConfig:
    return EngineConfig.build(path=model, served_model_name=BASE, lora_modules=modules,
                              enable_lora=True, **flat)  # fmt: skip


def test_the_registry_numbers_adapters_and_never_reuses_an_id(tmp_path, model):
    a, b = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b", r=4)
    reg = LoraRegistry(lora_config(model, f"sql={a}", f"chat={b}"))
    assert [(x.lora_id, x.name) for x, _ in reg.adapters()] == [(1, "sql"), (2, "chat")]
    assert reg.resolve(None) == 0 and reg.resolve(BASE) == 0
    assert reg.resolve("sql") == 1 and reg.resolve("chat") == 2
    with pytest.raises(APIError) as e:
        reg.resolve("gpt-17")
    err = e.value.body().model_dump()["error"]
    assert e.value.status == 404 and err["type"] == "not_found_error" and err["param"] == "model"
    added = reg.add("new", b)
    assert added == LoraAdapter(3, "new", os.path.abspath(b))
    assert reg.remove("sql") == 1 and reg.remove("new") == 3
    assert not reg.serves(1) and reg.serves(2) and reg.serves(0)
    assert reg.add("sql", a).lora_id == 4  # a name served again gets a new id
    assert reg.names() == {2: "chat", 4: "sql"}
    for name, status in (("sql", 400), (BASE, 400), ("", 400), ("x" * (MAX_NAME_CHARS + 1), 400)):
        with pytest.raises(APIError) as e:
            reg.add(name, a)
        assert e.value.status == status, name
    with pytest.raises(APIError) as e:
        reg.add("bad", str(tmp_path / "nowhere"))
    assert e.value.status == 400 and "is not a folder" in e.value.message
    with pytest.raises(APIError) as e:
        reg.remove("gone")
    assert e.value.status == 404


def test_without_lora_only_the_served_name_resolves(tmp_path, model):
    reg = LoraRegistry(EngineConfig.build(path=model, served_model_name=BASE))
    assert not reg.enabled and reg.resolve(BASE) == 0 and reg.adapters() == []
    with pytest.raises(APIError) as e:
        reg.resolve("sql")
    assert e.value.status == 404


def test_a_bad_lora_module_is_refused_at_start_in_one_line(tmp_path, model):
    from subway.tools.cli import check_lora, main

    good = write_adapter(tmp_path / "a")
    bad = write_adapter(tmp_path / "b", r=32)
    with pytest.raises(LoraError, match="--lora-modules big: the adapter's rank 32"):
        LoraRegistry(lora_config(model, f"ok={good}", f"big={bad}"))
    with pytest.raises(LoraError, match="--lora-modules twice: an adapter named twice"):
        LoraRegistry(lora_config(model, f"twice={good}", f"twice={good}"))
    check_lora(lora_config(model, f"ok={good}"))
    with pytest.raises(SystemExit) as e:
        check_lora(lora_config(model, f"big={bad}"))
    assert str(e.value) == "subway: --lora-modules big: the adapter's rank 32 is more than " \
                           "--max-lora-rank 16"  # fmt: skip
    with pytest.raises(SystemExit, match="--max-lora-rank 16"):  # before any process starts
        main(["serve", "--model", model, "--lora-modules", f"big={bad}"])
    with pytest.raises(SystemExit) as e:
        check_lora(lora_config(model, prefill_engines=1, decode_engines=1, data_parallel_size=2))
    assert "LoRA with disaggregation is not supported yet" in str(e.value)
    check_lora(EngineConfig.build(prefill_engines=1, decode_engines=1, data_parallel_size=2))


# ---------------------------------------------------------------- metrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            keep = {k: v for k, v in s.labels.items() if k in ("adapter", "engine")}
            out[s.name + json.dumps(keep, sort_keys=True)] = s.value
    return out


def test_lora_metrics_follow_the_registry_and_the_engines_stats():
    names = {1: "sql", 3: "chat"}
    m = Metrics("m", roles=["both", "both"], lora_names=lambda: dict(names))
    for name in names.values():
        m.adapter_added(name)
    m.observe_lora_requests("sql", 2)
    m.observe_stats(EngineStats(lora_requests={1: 3, 3: 1, 7: 5}, lora_loads_total=4,
                                lora_evictions_total=2), engine=0)  # fmt: skip
    m.observe_stats(EngineStats(lora_requests={3: 2}), engine=1)
    got = samples(m.render().decode())
    assert got['subway:lora_requests_total{"adapter": "sql"}'] == 2
    assert got['subway:lora_requests_total{"adapter": "chat"}'] == 0
    assert got["subway:lora_adapters{}"] == 2
    assert got['subway:lora_loads_total{"engine": "0"}'] == 4
    assert got['subway:lora_evictions_total{"engine": "0"}'] == 2
    assert got['subway:lora_running_requests{"adapter": "sql", "engine": "0"}'] == 3
    assert got['subway:lora_running_requests{"adapter": "chat", "engine": "1"}'] == 2
    assert not any("running" in k and '"7"' in k for k in got)  # an id not served: left out
    names.pop(1)
    m.adapter_removed("sql")
    got = samples(m.render().decode())
    assert got["subway:lora_adapters{}"] == 1
    assert not any("sql" in k for k in got)


# ---------------------------------------------------------------- the HTTP routes, in-process


class App:
    """`build_app` over an EngineGroup that never starts (no lifespan): what the routes send
    to the engines is recorded in `sent`."""

    def __init__(self, config: EngineConfig) -> None:
        self.group = EngineGroup(config)
        self.sent: list = []
        self.group.send_lora = self.sent.append
        self.app = build_app(config, self.group, tokenizer=object())
        key = config.server.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = TestClient(self.app, headers=headers)

    def post(self, path: str, body) -> tuple[int, dict]:
        r = self.client.post(path, json=body) if not isinstance(body, bytes) else (
            self.client.post(path, content=body))  # fmt: skip
        return r.status_code, r.json()

    def models(self) -> list[dict]:
        return self.client.get("/v1/models").json()["data"]


def openai_error(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_models_lists_the_base_and_each_adapter(tmp_path, model):
    a = write_adapter(tmp_path / "a")
    app = App(lora_config(model, f"sql={a}"))
    base, sql = app.models()
    assert base["id"] == BASE and base["parent"] is None and base["object"] == "model"
    assert sql == sql | {"id": "sql", "object": "model", "owned_by": "subway", "root": a,
                         "parent": BASE}  # fmt: skip
    plain = App(EngineConfig.build(path=model, served_model_name=BASE))
    assert [m["id"] for m in plain.models()] == [BASE]


def test_runtime_loading_needs_lora_and_the_flag(tmp_path, model):
    a = write_adapter(tmp_path / "a")
    body = {"lora_name": "x", "lora_path": a}
    off = App(EngineConfig.build(path=model, served_model_name=BASE))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, out = off.post(path, body)
        assert status == 400 and "--enable-lora" in openai_error(out)["message"]
    no_flag = App(lora_config(model))
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, out = no_flag.post(path, body)
        assert status == 403 and "--allow-runtime-lora-updating" in openai_error(out)["message"]
    assert off.sent == no_flag.sent == []


def test_load_and_unload_at_runtime(tmp_path, model):
    a, big = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "big", r=32)
    app = App(lora_config(model, f"sql={a}", allow_runtime_lora_updating=True, api_key="k"))
    status, out = app.post("/v1/load_lora_adapter", {"lora_name": "fr", "lora_path": a})
    assert status == 200 and out["id"] == 2 and "fr" in out["message"]
    assert [m["id"] for m in app.models()] == [BASE, "sql", "fr"]
    assert app.sent == [AddLora(LoraAdapter(2, "fr", os.path.abspath(a)))]
    refusals = [
        ({"lora_name": "fr", "lora_path": a}, "an adapter named fr is already loaded", "lora_name"),
        ({"lora_name": BASE, "lora_path": a}, "is the base model's name", "lora_name"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "no")}, "is not a folder", "lora_path"),
        ({"lora_name": "x", "lora_path": big}, "rank 32 is more than --max-lora-rank 16",
         "lora_path"),
        ({"lora_name": "x"}, "lora_path", "lora_path"),
        ({"lora_name": 5, "lora_path": a}, "lora_name", "lora_name"),
        ({"lora_name": "", "lora_path": a}, "lora_name", "lora_name"),
        (b"{not json", "malformed JSON body", None),
    ]  # fmt: skip
    for body, reason, param in refusals:
        status, out = app.post("/v1/load_lora_adapter", body)
        err = openai_error(out)
        assert status == 400 and reason in err["message"] and err["param"] == param, (body, out)
    status, out = app.post("/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 404 and openai_error(out)["type"] == "not_found_error"
    status, out = app.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200 and out["id"] == 1 and "in flight finish first" in out["message"]
    assert app.sent[1:] == [RemoveLora(1)]
    assert [m["id"] for m in app.models()] == [BASE, "fr"]
    # A name gone is a 404 at once, as any unknown model.
    status, out = app.post("/v1/completions", {"model": "sql", "prompt": "hi"})
    assert status == 404 and openai_error(out)["param"] == "model"
    status, out = app.post("/v1/chat/completions",
                           {"model": "zzz", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert status == 404 and "`zzz` does not exist" in openai_error(out)["message"]
    # Behind the API key, as every route but /health.
    anonymous = TestClient(app.app)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = anonymous.post(path, json={"lora_name": "y", "lora_path": a})
        assert r.status_code == 401
    text = app.client.get("/metrics").text
    assert 'adapter="fr"' in text and 'adapter="sql"' not in text


def test_every_engine_is_told_and_a_new_scheduler_is_told_again(tmp_path, model):
    a = write_adapter(tmp_path / "a")
    config = lora_config(model, f"sql={a}", allow_runtime_lora_updating=True,
                         data_parallel_size=2, run_dir=str(tmp_path / "run"))  # fmt: skip
    group = EngineGroup(config)
    sent: list[list] = [[], []]
    for client, got in zip(group.clients, sent, strict=True):
        client.link.send = got.append
    app = TestClient(build_app(config, group, tokenizer=object()))
    r = app.post("/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": a})
    assert r.status_code == 200
    r = app.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200
    added = AddLora(LoraAdapter(2, "fr", os.path.abspath(a)))
    assert sent == [[added, RemoveLora(1)]] * 2
    # Engine 1's scheduler starts again: it knows the config's adapters only.
    group.clients[1].link.on_new_scheduler()
    assert sent[1][2:] == [RemoveLora(1), added] and len(sent[0]) == 2
    group.close()


# ---------------------------------------------------------------- a live frontend


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def default_dims(default_model) -> dict[str, tuple[int, int]]:
    with open(os.path.join(default_model, "config.json")) as f:
        c = json.load(f)
    hidden, heads, inter = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, c.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}  # fmt: skip


@pytest.fixture(scope="module")
def frontend(default_model, tokenizer, default_dims, tmp_path_factory):
    from test_frontend import _live_frontend

    root = tmp_path_factory.mktemp("lora")
    sql = write_adapter(root / "sql", dims=default_dims, layers=(0, 3))
    fr = write_adapter(root / "fr", dims=default_dims, modules=("gate_proj",), layers=(5,))
    run = tmp_path_factory.mktemp("run")
    flags = dict(lora_modules=(f"sql={sql}",), allow_runtime_lora_updating=True)
    with _live_frontend(default_model, tokenizer, run, **flags) as fe:
        fe.adapters = {"sql": sql, "fr": fr}
        yield fe


def test_a_request_naming_an_adapter_carries_its_id(frontend):
    from test_frontend import MODEL as BASE_NAME

    fake = frontend.fake
    with frontend.client() as c:
        before = len(fake.adds)
        r = c.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "sql"
        chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "max_tokens": 3}  # fmt: skip
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["model"] == "sql"
        r = c.post("/v1/completions", json={"model": BASE_NAME, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == BASE_NAME
        assert [a.lora for a in fake.adds[before:]] == [1, 1, 1, 0]
        r = c.post("/tokenize", json={"model": "sql", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["count"] > 0
        assert c.post("/tokenize", json={"model": "zz", "prompt": "hi"}).status_code == 404
        assert samples(c.get("/metrics").text)['subway:lora_requests_total{"adapter": "sql"}'] == 3
    # The adapters of --lora-modules are the scheduler's own from the config: nothing sent.
    assert fake.loras == []


def test_a_loaded_adapter_is_served_and_an_unloaded_one_is_not(frontend):
    fake = frontend.fake
    with frontend.client() as c:
        load = {"lora_name": "fr", "lora_path": frontend.adapters["fr"]}
        r = c.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        assert fake.wait_for(lambda: len(fake.loras) == 1)
        assert fake.loras == [AddLora(LoraAdapter(2, "fr", frontend.adapters["fr"]))]
        before = len(fake.adds)
        r = c.post("/v1/completions", json={"model": "fr", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "fr"
        assert fake.adds[before].lora == 2
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "fr"}).status_code == 200
        assert fake.wait_for(lambda: fake.loras[1:] == [RemoveLora(2)])
        r = c.post("/v1/completions", json={"model": "fr", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["sql"]


def test_the_native_endpoint_honours_model(frontend):
    from subway.client import Client
    from subway.client.protocol import RequestError

    fake = frontend.fake
    address = frontend.config.client_address
    with Client(address) as client:
        before = len(fake.adds)
        out = client.generate("hi", model="sql", max_tokens=2)
        assert out.finish_reason is not None
        assert fake.adds[before].lora == 1
        client.generate("hi", max_tokens=2)
        assert fake.adds[before + 1].lora == 0
        with pytest.raises(RequestError) as e:
            client.generate("hi", model="nope", max_tokens=2)
        assert e.value.status == 404 and "nope" in str(e.value)
