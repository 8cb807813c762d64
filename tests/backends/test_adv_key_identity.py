"""Adversarial checks of KEY IDENTITY in the engine backends: engine instances whose KV bytes differ for
one prompt must never share a key (wrong bytes served, silently), and one configuration must find its own
blocks again. Driven through the backends' own classes: the vLLM connector in vLLM's environment (a
subprocess: kvpool's test venv has no vLLM), SGLang's real host pools, FastDeploy's patched manager
code, the Mooncake drop-in."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_fastdeploy_manager import WriteStorageTask, gpu_tensors, make_manager

from kvpool.backends import fastdeploy_patch as fp
from kvpool.backends._vllm_plan import namespace, pool_keys, request_namespace
from kvpool.backends.engines import envs
from kvpool.backends.mooncake_compat import MooncakeDistributedStore

import sglang_cpu
from bkhelp import FASTDEPLOY_SRC, HostBuffer, payload
from sglang_pools import PAGE, create, dynamic_extra, page_bytes

ROOT = Path(__file__).resolve().parents[2]

# ----- vLLM: the connector built as vLLM builds it, in vLLM's environment ----------------------------

_VLLM_DRIVER = textwrap.dedent('''
    import json, sys
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, get_kv_quant_mode
    from vllm.v1.request import Request
    import kvpool.backends.vllm as kv
    from kvpool.backends._hostio import HostIO
    from kvpool.core import PoolClient

    MODEL, NOWHERE = sys.argv[1], sys.argv[2]  # NOWHERE: no worker there; the connectors' own clients reach no pool
    LAYERS, BLOCKS, BS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], 16, 32

    def connector(cache_dtype="auto", revision=None):
        # vLLM's own config for `--kv-cache-dtype cache_dtype [--revision r]`, and the KV cache spec its
        # attention layers build from it (dtype via kv_cache_dtype_str_to_dtype, quant mode)
        cfg = VllmConfig(model_config=ModelConfig(model=MODEL, revision=revision, enforce_eager=True),
                         cache_config=CacheConfig(block_size=BS, cache_dtype=cache_dtype),
                         kv_transfer_config=KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both",
                                                             kv_connector_module_path="kvpool.backends.vllm",
                                                             kv_connector_extra_config={"worker": NOWHERE}))
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                 dtype=kv_cache_dtype_str_to_dtype(cache_dtype, cfg.model_config),
                                 kv_quant_mode=get_kv_quant_mode(cache_dtype))
        kcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        return kv.KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kcc)

    def request(tokens=tuple(range(1000, 1100)), lora=None, embeds=None, mask=None):
        return Request("r", list(tokens), SamplingParams(max_tokens=1), None, lora_request=lora,
                       prompt_embeds=embeds, prompt_is_token_ids=mask)

    def shared(c1, r1, c2, r2):
        return len(set(c1._keys(r1)) & set(c2._keys(r2)))

    out = {"module": kv.__file__}
    e4, e5 = connector("fp8_e4m3"), connector("fp8_e5m2")
    out["fp8_namespaces"] = [e4._namespace, e5._namespace]
    out["fp8_shared_keys"] = shared(e4, request(), e5, request())
    # the bytes: the e4m3 instance saves 3 blocks, the e5m2 instance matches and loads them (one pool)
    pool = HostIO(lambda: PoolClient(mode="embedded", dram_bytes=32 << 20, dram_slab_size=1 << 20,
                                     prefault=False), logger=kv.log)
    for c in (e4, e5):
        c._io = pool
        c.register_kv_caches({n: torch.zeros(BLOCKS, 2, BS, 128, dtype=torch.uint8) for n in LAYERS})
    for t in e4._kv._layers:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    e4._kv.save(pool, e4._keys(request()), [0, 1, 2])
    keys5 = e5._keys(request())
    out["e5m2_matched_blocks"] = e5._prefix_match(keys5)
    out["e5m2_loaded_blocks"] = e5._kv.load(pool, keys5, [5, 6, 7])
    out["e5m2_holds_e4m3_bytes"] = all(torch.equal(a[0:3], b[5:8]) for a, b in zip(e4._kv._layers, e5._kv._layers))

    base = connector()
    out["lora_shared_keys"] = shared(base, request(lora=LoRARequest("sql", 1, "/adapters/sql-v1")),
                                     base, request(lora=LoRARequest("sql", 1, "/adapters/sql-v2")))
    mask = [True] * 40 + [False] * 40 + [True] * 20  # a mixed prompt: ids, 40 embedded positions, ids
    g = torch.Generator().manual_seed(0)
    emb1, emb2 = torch.randn(100, 256, generator=g), torch.randn(100, 256, generator=g)
    out["embeds_shared_keys"] = shared(base, request(embeds=emb1, mask=mask), base, request(embeds=emb2, mask=mask))
    r1, r2 = connector(revision="v1.0"), connector(revision="v2.0")
    out["revision_shared_keys"] = shared(r1, request(), r2, request())

    # one config, two attention backends: kernel blocks of 32 tokens (the manager's) vs of 16 (vLLM's
    # select_common_block_size when a backend lacks 32): per-layer views [B, H, 32, C] vs [2B, H, 16, C]
    k32, k16 = connector(), connector()
    k32._io = k16._io = pool
    k32.register_kv_caches({n: torch.zeros(BLOCKS, 2, BS, 128, dtype=torch.bfloat16) for n in LAYERS})
    k16.register_kv_caches({n: torch.zeros(2 * BLOCKS, 2, BS // 2, 128, dtype=torch.bfloat16) for n in LAYERS})
    raw32 = list(k32._kv._layers)
    for t in raw32:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).to(t.dtype))
    toks = list(range(2000, 2100))
    k32._kv.save(pool, k32._keys(request(toks)), [0, 1, 2])
    out["kernel16_loaded_blocks"] = k16._kv.load(pool, k16._keys(request(toks)), [5, 6, 7])
    # the KV of each (head, token) as the 16-token kernel sees it vs as the 32-token instance wrote it
    out["kernel16_same_kv"] = all(
        torch.equal(torch.cat([b[2 * j], b[2 * j + 1]], dim=1), a[i])
        for a, b in zip(raw32, [t.view(2 * BLOCKS, 2, BS // 2, 128) for t in k16._kv._layers])
        for i, j in zip(range(out["kernel16_loaded_blocks"]), (5, 6, 7)))

    again = connector("fp8_e4m3")  # the reverse: a restarted instance finds its own blocks
    out["restart_same_keys"] = again._keys(request()) == e4._keys(request())
    out["blocks_per_request"] = len(base._keys(request()))
    for c in (e4, e5, base, r1, r2, k32, k16, again):
        c.shutdown()
    pool.close()
    print("RESULT " + json.dumps(out), flush=True)
''')


@pytest.fixture(scope="module")
def vllm_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the vLLM connector's keys are for pairs of instances/requests whose KV differs (one vLLM
    process for all the vLLM checks). kvpool is imported from this checkout (a `kvpool` link on
    PYTHONPATH), not from whatever checkout the engine environment was last pointed at."""
    py = envs.ensure("vllm")  # (built if missing: minutes, once per machine)
    d = tmp_path_factory.mktemp("vllm-keys")
    (d / "kvpool").symlink_to(ROOT)
    (d / "driver.py").write_text(_VLLM_DRIVER)
    (d / "model").mkdir()  # a 2-layer Llama with 2 KV heads of 64: vLLM's ModelConfig reads only this
    (d / "model" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "MOONCAKE_"))}
    env.update(PYTHONPATH=str(d), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               KVPOOL_TOKEN_FILE=str(d / "token"))
    proc = subprocess.run([str(py), str(d / "driver.py"), str(d / "model"), str(d / "no-worker.sock")], cwd=d, env=env,
                          capture_output=True, text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(line[len("RESULT "):])
    assert Path(out["module"]).resolve().is_relative_to(ROOT), out["module"]
    assert out["blocks_per_request"] == 3 and out["restart_same_keys"]  # the harness itself is sound
    return out


# Bug: vLLM --kv-cache-dtype fp8_e4m3 and fp8_e5m2 both give spec.dtype torch.uint8, so the namespace
# says "uint8" for both and an e5m2 instance loads e4m3 bytes (decoded as another float format).
@pytest.mark.timeout(600)  # the first on a machine builds vLLM's environment
def test_vllm_fp8_e4m3_and_e5m2_instances_never_share_blocks(vllm_keys: dict[str, Any]) -> None:
    assert vllm_keys["fp8_shared_keys"] == 0, vllm_keys["fp8_namespaces"]
    assert vllm_keys["e5m2_matched_blocks"] == 0 and vllm_keys["e5m2_loaded_blocks"] == 0
    assert not vllm_keys["e5m2_holds_e4m3_bytes"]


# Bug: the vLLM connector keys a LoRA request by lora_name only; vLLM hashes (name, path), so one name
# re-pointed at another adapter (or reused by another instance for another adapter) reads the old KV.
@pytest.mark.timeout(600)  # the first on a machine builds vLLM's environment
def test_vllm_same_lora_name_other_adapter_path_never_shares_blocks(vllm_keys: dict[str, Any]) -> None:
    assert vllm_keys["lora_shared_keys"] == 0


# Bug: a mixed prompt (token ids + prompt embeddings, sentinel ids at the embedded positions) is keyed
# by its token ids alone; vLLM adds a per-block hash of the embeddings. Other embeddings -> same keys.
@pytest.mark.timeout(600)  # the first on a machine builds vLLM's environment
def test_vllm_mixed_prompt_with_other_embeddings_never_shares_blocks(vllm_keys: dict[str, Any]) -> None:
    assert vllm_keys["embeds_shared_keys"] == 0


# Bug: the namespace names the model by `model` only; two instances of one model id at different
# `--revision`s (different weights) share every key.
@pytest.mark.timeout(600)  # the first on a machine builds vLLM's environment
def test_vllm_other_model_revision_never_shares_blocks(vllm_keys: dict[str, Any]) -> None:
    assert vllm_keys["revision_shared_keys"] == 0


# Bug: the layout in the namespace is the spec's [H, N, C] with N = block_size, not the kernel block size
# the attention backend splits blocks into (PagedKV regroups [2B, H, 16, C] views), so an instance on a
# backend with 16-token kernel blocks loads blocks a 32-token one wrote as [H, 32, C]: tokens permuted.
@pytest.mark.timeout(600)  # the first on a machine builds vLLM's environment
def test_vllm_instances_with_other_kernel_block_sizes_never_load_permuted_kv(vllm_keys: dict[str, Any]) -> None:
    assert vllm_keys["kernel16_loaded_blocks"] == 0 or vllm_keys["kernel16_same_kv"]


# Bug: request_namespace joins free-form fields with "|" and "," unescaped: a LoRA name, cache salt or
# multimodal identifier that contains "|salt=", "|mm=" or "," renders another request's namespace.
@pytest.mark.parametrize("a, b", [
    ({"lora": "sql|salt=tenant-a"}, {"lora": "sql", "cache_salt": "tenant-a"}),
    ({"cache_salt": "tenant-a|mm=img0"}, {"cache_salt": "tenant-a", "mm_hashes": ["img0"]}),
    ({"mm_hashes": ["img0,img1"]}, {"mm_hashes": ["img0", "img1"]}),
], ids=["lora-vs-lora+salt", "salt-vs-salt+image", "one-image-vs-two"])
def test_vllm_request_namespace_fields_never_render_alike(a: dict[str, Any], b: dict[str, Any]) -> None:
    base = namespace("org/model", "bfloat16", 32, 0, 1, "cpu/FullAttentionSpec/2L/2x32x256")
    tokens = list(range(1000, 1100))
    assert set(pool_keys(tokens, 32, request_namespace(base, **a))).isdisjoint(
        pool_keys(tokens, 32, request_namespace(base, **b)))


# ----- SGLang: real host pools, one shared worker ----------------------------------------------------

def _fp8_host(dtype: torch.dtype, seed: int) -> Any:
    return sglang_cpu.host_pool("page_first", pages=32, page=PAGE, dtype=dtype, seed=seed)


# Bug: SGLang's host pool stores fp8 KV as uint8 (store_dtype), so page_format() names fp8_e4m3 and
# fp8_e5m2 pools alike ("page_first/uint8/"); SGLang's own unified key scheme keys the logical dtype.
# The host pool cannot tell (both uint8): the adapter asks the server's arguments, as each server has them.
def test_sglang_fp8_e4m3_and_e5m2_instances_never_share_pages(spawn: Callable[..., Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.srt.runtime_context as rc

    worker = spawn()
    opts = dynamic_extra(mode="local", worker=worker.unix_path, interface_v1=1)
    h4, h5 = _fp8_host(torch.float8_e4m3fn, 0), _fp8_host(torch.float8_e5m2, 1)
    monkeypatch.setattr(rc, "get_server_args", lambda: types.SimpleNamespace(kv_cache_dtype="auto"))
    e4 = create(h4, opts)  # auto: a checkpoint quantized to fp8 (e4m3)
    monkeypatch.setattr(rc, "get_server_args", lambda: types.SimpleNamespace(kv_cache_dtype="fp8_e5m2"))
    e5 = create(h5, opts)
    try:
        keys, src = [f"{i:064x}" for i in range(1, 4)], h4.alloc(3 * PAGE)
        assert e4.batch_set_v1(keys, src) == [True] * 3
        assert e4.batch_exists(keys) == 3  # the writer finds its own pages
        dst = h5.alloc(3 * PAGE)
        loaded = e5.batch_get_v1(keys, dst)
        wrong = [i for i in range(3)
                 if loaded[i] and page_bytes(h5, int(dst[i * PAGE])) == page_bytes(h4, int(src[i * PAGE]))]
        assert e5.batch_exists(keys) == 0 and not wrong, f"the e5m2 instance loaded e4m3 pages {wrong}"
    finally:
        e4.close()
        e5.close()


# ----- FastDeploy: its own manager code, patched by `kvpool fastdeploy enable` -----------------------

@pytest.fixture
def fd_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawn: Callable[..., Any]) -> Path:
    """The patched FastDeploy files, with the pool a shared worker (KVPOOL_WORKER, as deployments set it)."""
    pkg = tmp_path / "fastdeploy"
    shutil.copytree(FASTDEPLOY_SRC, pkg)
    fp.enable(pkg)
    monkeypatch.setenv("KVPOOL_WORKER", spawn().unix_path)
    return pkg


# Bug: the patch namespaces FastDeploy's keys by `model_id`, the model folder's basename: two models at
# /models/run1/ERNIE-4.5-0.3B-Paddle and /models/run2/ERNIE-4.5-0.3B-Paddle (two fine-tunes, two
# checkpoint-N folders) share every key, and the second reads the first's blocks.
def test_fastdeploy_models_in_folders_of_one_name_never_share_blocks(fd_pkg: Path, tmp_path: Path) -> None:
    m1, m2 = make_manager(fd_pkg, tmp_path / "run1", False), make_manager(fd_pkg, tmp_path / "run2", False)
    try:
        for group in gpu_tensors(m1):
            for layer, t in enumerate(group):
                t[:] = payload(f"{id(group)}/{layer}", t.nbytes).reshape(t.shape)
        hashes = ["a1", "b2"]
        m1.write_back_storage_task(WriteStorageTask(task_id="w", keys=hashes, token_ids=list(range(32)),
                                                    gpu_block_ids=[1, 2], timeout=1.0))
        assert m1.storage_backend.query([f"prefix_{h}_0_key" for h in hashes],
                                        [f"prefix_{h}_0_value" for h in hashes]) == 2
        assert m2.storage_backend.query([f"prefix_{h}_0_key" for h in hashes],
                                        [f"prefix_{h}_0_value" for h in hashes]) == 0
    finally:
        m1.storage_backend.close()
        m2.storage_backend.close()


# ----- the Mooncake drop-in: tenants -----------------------------------------------------------------

@pytest.fixture
def stores() -> Iterator[Callable[[], MooncakeDistributedStore]]:
    made: list[MooncakeDistributedStore] = []

    def _make() -> MooncakeDistributedStore:
        made.append(MooncakeDistributedStore())
        return made[-1]

    yield _make
    for s in made:
        s.close()


def _tenants(stores: Callable[[], MooncakeDistributedStore], worker: Any,
             *names: str) -> list[MooncakeDistributedStore]:
    out = []
    for name in names:
        s = stores()
        assert s.setup("h", "P2PHANDSHAKE", 0, 0, "tcp", "", worker.unix_path, tenant_id=name) == 0
        out.append(s)
    return out


# Bug: a tenant's namespace is "tenant/<id>/" with the id unescaped: tenant "team" key "x/k" and tenant
# "team/x" key "k" are one object, so tenants read (and overwrite) each other's blocks.
def test_mooncake_tenants_whose_ids_nest_never_see_each_others_objects(
        stores: Callable[[], MooncakeDistributedStore], spawn: Callable[..., Any]) -> None:
    team, team_x = _tenants(stores, spawn(), "team", "team/x")
    assert team_x.put("k", b"of tenant team/x") == 0
    assert team.get("x/k") == b"" and team.is_exist("x/k") == 0


# Bug: same cause: tenant "team"'s remove_all clears the prefix "tenant/team/", which also holds every
# object of tenant "team/x" ("a tenant's remove_all removes only its own").
def test_mooncake_remove_all_of_a_tenant_keeps_a_nested_tenants_objects(
        stores: Callable[[], MooncakeDistributedStore], spawn: Callable[..., Any]) -> None:
    team, team_x = _tenants(stores, spawn(), "team", "team/x")
    buf = HostBuffer(4096)
    buf.array[:] = payload("nested", 4096)
    assert team_x.register_buffer(buf.ptr, buf.nbytes) == 0
    assert team_x.batch_put_from(["blk"], [buf.ptr], [4096]) == [0]
    assert team.put("mine", b"of tenant team") == 0
    team.remove_all()
    assert team_x.is_exist("blk") == 1, "tenant team's remove_all removed tenant team/x's object"
    assert np.array_equal(np.frombuffer(team_x.get("blk"), np.uint8), buf.array)


# Bug: a key over the pool's limit is meant to be stored under its SHA-256 (`_digest` even encodes with
# surrogatepass), but `_keys` first measures it with `n.encode()`, which raises UnicodeEncodeError into the
# engine for a long key holding a lone surrogate (a short one gets INVALID_PARAMS, as documented).
def test_mooncake_long_key_with_a_surrogate_is_a_status_not_an_exception(
        stores: Callable[[], MooncakeDistributedStore], spawn: Callable[..., Any]) -> None:
    (s,) = _tenants(stores, spawn(), "default")
    key = "model-\udcff/" + "k" * 600  # e.g. a model path decoded with surrogateescape, then a long suffix
    rc = s.put(key, b"xyz")
    assert isinstance(rc, int) and s.batch_is_exist([key]) == [1 if rc == 0 else 0]


# Bug: SGLang's keys carry the model path unhashed ("sglang/<model>/..."); a model path of ~450 bytes
# makes every key exceed the pool's 511 bytes, so every page write and read fails (logged once) while
# the Mooncake drop-in stores such keys under their SHA-256.
def test_sglang_long_model_path_still_stores_and_finds_its_pages(spawn: Callable[..., Any]) -> None:
    worker = spawn()
    host = sglang_cpu.host_pool("page_first", pages=32, page=PAGE)
    b = create(host, dynamic_extra(mode="local", worker=worker.unix_path, interface_v1=1),
               model_name="/mnt/models/" + "/".join(["snapshot-0123456789abcdef"] * 18))
    try:
        keys, src = [f"{i:064x}" for i in range(1, 3)], host.alloc(2 * PAGE)
        assert b.batch_set_v1(keys, src) == [True, True]
        assert b.batch_exists(keys) == 2
    finally:
        b.close()
