"""``mooncake.store`` on the project's KV store (``kvstore.mooncake_store``)."""

try:
    from kvstore.mooncake_store import *  # noqa: F403
    from kvstore.mooncake_store import __all__  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "kvstore.mooncake_store":
        raise
    raise ImportError("mooncake.store: this install of the project has no Mooncake Store "
                      "API (kvstore.mooncake_store)") from None
