"""A logger made at its first use: :mod:`logging` costs a program ~5 ms to import, which smc-run
would add to every program that imports :mod:`socket` (smc-run loads the library then), whether
or not anything is ever logged."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from typing import Any

__all__ = ["DEBUG", "LazyLogger"]

DEBUG = 10
"""``logging.DEBUG``."""


class LazyLogger:
    """``logging.getLogger(name)``'s ``debug``/``info``/``warning``/``isEnabledFor``, the logger
    (and :mod:`logging`) fetched at the first call. Records name their caller, not this class
    (``stacklevel``)."""

    __slots__ = ("_logger", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger: logging.Logger | None = None

    @property
    def logger(self) -> logging.Logger:
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(self.name)
        return self._logger

    def isEnabledFor(self, level: int) -> bool:  # (logging's name)
        return self.logger.isEnabledFor(level)

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.debug(msg, *args, stacklevel=2, **kwargs)

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.info(msg, *args, stacklevel=2, **kwargs)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.logger.warning(msg, *args, stacklevel=2, **kwargs)
