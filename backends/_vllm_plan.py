"""Scheduler-side bookkeeping of kvpool's vLLM connector, free of vLLM and torch.

Pool keys of a request's full token blocks, how many prompt tokens the pool can supply beyond vLLM's
own prefix cache, and which (key, paged-KV block id) pairs to load or save in each engine step; and
which pool the connector's extra config names.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.core import ClientConfig, ConfigError, InvalidArgument, block_keys
from kvpool.core import load_config as load

ADAPTER_KEYS = frozenset({"model_name", "retry_s"})
"""Keys of `kv_connector_extra_config` that are the connector's own, not PoolClient options."""

KEY_PREFIX = "vllm/"
"""Every key the connector writes starts with it (then the 64 hex chars of the chained hash)."""


def pool_config(extra: dict[str, Any] | None) -> ClientConfig:
    """The PoolClient configuration in `kv_connector_extra_config` (minus the adapter's keys), with
    `KVPOOL_*` variables filling in the rest. Raises ConfigError for an unknown key, and for an
    embedded pool: each vLLM process (scheduler, every worker) would get a private pool of its own,
    so nothing would ever be shared."""
    opts = {k: v for k, v in (extra or {}).items() if k not in ADAPTER_KEYS}
    cfg = load(ClientConfig, **opts)
    if cfg.mode == "embedded":
        raise ConfigError("the kvpool vLLM connector needs a shared pool: put \"nats_url\" (what `kvpool up` "
                          "prints) or \"worker\" in kv_connector_extra_config, or set KVPOOL_NATS_URL / "
                          "KVPOOL_WORKER; an embedded pool would be private to one vLLM process")
    return cfg


def namespace(model: str, dtype: str, block_size: int, tp_rank: int, tp_size: int, layout: str, *,
              revision: str | None = None, quantization: str | None = None) -> str:
    """The namespace hashed into every key: blocks of another model (or revision of it, or quantization
    of its weights), KV dtype, block size, TP shard or byte layout never share a key. It holds no process
    id or time, so keys are the same across restarts, and across hosts that name the model the same way.
    Its fields are a JSON list: no two sets of them render alike."""
    return _fields("vllm", model, revision, quantization, dtype, f"bs{block_size}", f"tp{tp_rank}of{tp_size}", layout)


def request_namespace(base: str, *, lora: str | None = None, lora_path: str | None = None,
                      cache_salt: str | None = None, mm_hashes: Sequence[str] = ()) -> str:
    """`base` plus what makes one request's KV differ from another's with the same token ids: its
    LoRA adapter (its name and path: one name may be loaded from another path), its cache salt (vLLM's
    per-tenant prefix-cache isolation) and its multimodal inputs (placeholder tokens are equal for
    different images). `base` itself without any."""
    if not (lora or cache_salt or mm_hashes):
        return base
    return _fields(base, lora, lora_path, cache_salt, list(mm_hashes))


def _fields(*fields: Any) -> str:
    """Fields as one string that no other fields render as (compact ASCII JSON: no spaces in the log)."""
    return json.dumps(fields, separators=(",", ":"))


def pool_keys(token_ids: Sequence[int], block_size: int, ns: str) -> list[str]:
    """One key per full block of `block_size` tokens (a trailing partial block has none); key i
    commits to every token before it and to `ns`."""
    return [KEY_PREFIX + k for k in block_keys(token_ids, block_size, ns)]


MAX_PART_BYTES = 8 << 20
"""Largest pool block the connector writes (bytes): half the pool's default largest block (its 16 MiB
slab), so a token block of a very deep or wide model is split by layers rather than refused."""


def layer_groups(num_layers: int, layer_block_bytes: int,
                 max_part_bytes: int = MAX_PART_BYTES) -> list[tuple[int, int]]:
    """[first, end) layer ranges of the pool blocks one token block is stored as: as many whole
    layers per part as fit `max_part_bytes` (at least one), all parts but the last equal."""
    if num_layers <= 0 or layer_block_bytes <= 0:
        raise InvalidArgument(f"{num_layers} layers of {layer_block_bytes} bytes: both must be > 0",
                              size=layer_block_bytes)
    per = max(1, min(num_layers, max_part_bytes // layer_block_bytes))
    return [(lo, min(num_layers, lo + per)) for lo in range(0, num_layers, per)]


def part_keys(keys: Sequence[str], parts: int) -> list[str]:
    """The pool keys of token-block `keys` stored as `parts` pool blocks each, block by block (the
    key itself when there is one part, so the common case has no suffix)."""
    if parts == 1:
        return list(keys)
    return [f"{k}/{p}of{parts}" for k in keys for p in range(parts)]


def loadable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks that may be loaded for a request of `num_tokens` tokens: never the whole request,
    since vLLM must compute at least its last token to sample the next one."""
    return max(0, (num_tokens - 1) // block_size)


def new_matched_tokens(pool_blocks: int, num_tokens: int, local_tokens: int, block_size: int) -> int:
    """Tokens the pool supplies beyond the `local_tokens` vLLM already has (block-aligned), given
    that the pool holds the first `pool_blocks` blocks: 0 on a miss or when vLLM has as many."""
    hit = min(pool_blocks, loadable_blocks(num_tokens, block_size)) * block_size
    return max(0, hit - local_tokens)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One request's blocks moved in one step: `keys[i]` <-> paged-KV block `block_ids[i]`."""

    req_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]


@dataclasses.dataclass
class StepPlan:
    """What the worker does in one step: loads before the forward pass, saves after it."""

    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    keys: list[str]
    pool_blocks: int = 0
    """Leading blocks the pool held at the last match."""
    local_tokens: int = 0
    """Tokens vLLM had in its own prefix cache at the last match (block-aligned)."""
    load: tuple[int, int] | None = None
    """(first block, count) to load when the request is next scheduled."""
    block_ids: list[int] = dataclasses.field(default_factory=list)
    saved: int = 0
    """Blocks [0, saved) need no save: they were in the pool, or were saved."""


class Planner:
    """Per-request state between vLLM's scheduler calls, and the plan of each step.

    Call order per request (as vLLM's scheduler makes them): `match` (maybe several times while the
    request waits), `allocated` once it gets blocks, `scheduled` in each step that runs it, then
    `finished`. `take_plan` returns the step's loads and saves and starts the next step's plan.
    Only prompt blocks are saved (decode blocks are rarely shared, as vLLM's own connectors assume).
    """

    def __init__(self, block_size: int, *, save: bool = True) -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size is {block_size}; it must be > 0 tokens")
        self.block_size = block_size
        self.save = save
        self._reqs: dict[str, _Req] = {}
        self._plan = StepPlan()

    def match(self, req_id: str, keys: Callable[[], list[str]], num_tokens: int, local_tokens: int,
              prefix_match: Callable[[list[str]], int]) -> int:
        """Tokens to load from the pool beyond `local_tokens`. `keys()` gives the request's full
        prompt block keys (called once per request); `prefix_match(keys)` how many leading keys the
        pool holds (0 when it cannot answer)."""
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _Req(keys=keys())
        st.pool_blocks = prefix_match(st.keys) if st.keys else 0
        st.local_tokens = local_tokens
        st.saved = max(st.saved, st.pool_blocks)
        return new_matched_tokens(st.pool_blocks, num_tokens, local_tokens, self.block_size)

    def allocated(self, req_id: str, num_external_tokens: int) -> tuple[int, int] | None:
        """vLLM allocated blocks for the request and will count `num_external_tokens` as loaded:
        plan that load (the blocks right after the local hit). Returns (first block, count) or None."""
        st = self._reqs.get(req_id)
        if st is None or num_external_tokens <= 0:
            if st is not None:
                st.load = None
            return None
        first = st.local_tokens // self.block_size
        count = -(-num_external_tokens // self.block_size)
        st.load = (first, min(count, len(st.keys) - first))
        return st.load

    def scheduled(self, req_id: str, block_ids: Iterable[int] | None, *, replace: bool,
                  num_computed_tokens: int, num_scheduled_tokens: int) -> None:
        """The request runs in this step: `block_ids` are its new blocks (all of its blocks when
        `replace`, for a new or resumed request); `num_computed_tokens` were computed (or loaded)
        before the step and `num_scheduled_tokens` are computed by it."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        if replace:
            st.block_ids = list(block_ids or ())
        elif block_ids:
            st.block_ids.extend(block_ids)
        if st.load is not None:
            first, count = st.load
            st.load = None
            count = min(count, len(st.block_ids) - first)
            if count > 0:
                self._plan.loads.append(Transfer(req_id, tuple(st.keys[first:first + count]),
                                                 tuple(st.block_ids[first:first + count])))
        if not self.save:
            return
        done = min(len(st.keys), len(st.block_ids), (num_computed_tokens + num_scheduled_tokens) // self.block_size)
        if done > st.saved:
            self._plan.saves.append(Transfer(req_id, tuple(st.keys[st.saved:done]), tuple(st.block_ids[st.saved:done])))
            st.saved = done

    def finished(self, req_id: str) -> None:
        """Forget the request (finished or aborted)."""
        self._reqs.pop(req_id, None)

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    def __len__(self) -> int:
        return len(self._reqs)
