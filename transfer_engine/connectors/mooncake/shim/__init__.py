"""Holds the ``mooncake`` package shim: put this folder on ``sys.path`` (``te-mooncake
run``, ``te-mooncake install``) and ``import mooncake.engine`` gets our engine."""
