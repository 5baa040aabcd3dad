"""The one way an owner of resources acts as a context manager and when collected."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

__all__ = ["Closeable"]


class Closeable:
    """Mixin for objects that own resources behind a ``_closed`` flag and an idempotent
    :meth:`close`: ``with`` closes them, and one collected while still open warns
    (``ResourceWarning``, saying :meth:`_unclosed`) and closes. Until fully built an
    object keeps ``_closed`` true (or unset), so a half-built one stays quiet."""

    _closed: bool

    def close(self) -> None:
        raise NotImplementedError

    def _unclosed(self) -> str:
        """What the warning for an object collected open says."""
        return f"unclosed {self!r}"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            warnings.warn(self._unclosed(), ResourceWarning, stacklevel=2)
            self.close()
        except Exception:  # a finaliser must never raise
            pass
