"""kvpool's stand-in for the `mooncake` package: `mooncake.store` is kvpool's Mooncake-API drop-in.

Only `mooncake.store` is provided here; the package path is extended (as Mooncake's own package
does) so that other submodules, e.g. `mooncake.engine`, still load from a real Mooncake if one is
installed further down sys.path.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
