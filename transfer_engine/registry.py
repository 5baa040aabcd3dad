"""Runs a membership registry on its own: ``python -m transfer_engine.registry --bind
tcp://HOST:PORT``. The service lives in :mod:`transfer_engine.control.registry`."""

from transfer_engine.control.registry import Registry, main

__all__ = ["Registry", "main"]

if __name__ == "__main__":
    main()
