"""`mooncake.store` backed by kvpool: see kvpool.backends.mooncake_compat."""
from kvpool.backends.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]
