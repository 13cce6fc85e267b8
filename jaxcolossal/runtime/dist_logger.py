"""Rank-aware logging in the style of ``colossalai.logging``.

:func:`get_dist_logger` returns a :class:`DistributedLogger`, a thin wrapper around a
stdlib :class:`logging.Logger`. Each call takes ``ranks``: ``None`` logs on every
process, a list of process indices (``jax.process_index()``) logs only there.
Messages are prefixed with ``[rank i]``.

The process index is read at each call. Before the distributed runtime or the
backend has started, every process is treated as process 0: asking JAX for the
index would start the backend and make :func:`jaxcolossal.runtime.launch.launch` impossible.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable

import jax
from jax._src import xla_bridge as _xla_bridge

__all__ = ["DistributedLogger", "get_dist_logger"]

_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
_MARK = "_jaxcolossal_handler"  # attribute set on handlers this module adds

_registry: dict[str, "DistributedLogger"] = {}
_lock = threading.Lock()


def _process_index() -> int:
    """``jax.process_index()`` once JAX has started, else 0 (without starting the backend)."""
    if _xla_bridge.backends_are_initialized() or jax.distributed.is_initialized():
        return jax.process_index()
    return 0


def _to_level(level: int | str) -> int:
    if isinstance(level, bool):
        raise TypeError(f"level must be a logging level name or int, got {level!r}")
    if isinstance(level, int):
        return level
    if isinstance(level, str):
        value = logging.getLevelName(level.strip().upper())
        if isinstance(value, int):
            return value
    raise ValueError(f"unknown logging level {level!r}; use DEBUG, INFO, WARNING, ERROR")


class _Process0Only(logging.Filter):
    """Drops records on every process except process 0 (decided at emit time)."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003
        return _process_index() == 0


class DistributedLogger:
    """Rank-filtered logger; mirrors ``colossalai.logging.DistributedLogger``.

    Create it with :func:`get_dist_logger`, not directly. The wrapped stdlib logger is
    ``self.logger``; it does not propagate to the root logger (as in Colossal-AI), so
    messages are not printed twice when the application configures logging.
    """

    def __init__(self, name: str, level: int | str = "INFO") -> None:
        self._name = name
        self._logger = logging.getLogger(name)
        self._logger.propagate = False
        self._logger.setLevel(_to_level(level))
        if not any(getattr(h, _MARK, None) == "stream" for h in self._logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            setattr(handler, _MARK, "stream")
            self._logger.addHandler(handler)

    @property
    def name(self) -> str:
        return self._name

    @property
    def logger(self) -> logging.Logger:
        """The wrapped :class:`logging.Logger`."""
        return self._logger

    def set_level(self, level: int | str) -> None:
        """Set the level of the logger (``"DEBUG"``, ``"INFO"``, ... or an int)."""
        self._logger.setLevel(_to_level(level))

    def log_to_file(self, path: str | os.PathLike, mode: str = "a", level: int | str = "INFO") -> None:
        """Also write to the file ``path``, on process 0 only.

        Mirrors ``DistributedLogger.log_to_file`` of Colossal-AI (which writes one file
        per rank; here only process 0 writes). The process index is checked when a
        record is emitted, so this may be called before launch. The file is opened at
        the first record written. Adding the same path twice adds one handler.

        Args:
          path: file path; its parent folder is created if missing.
          mode: ``"a"`` to append, ``"w"`` to truncate.
          level: minimum level written to the file.
        """
        path = os.path.abspath(os.fspath(path))
        for h in self._logger.handlers:
            if getattr(h, _MARK, None) == "file" and h.baseFilename == path:
                h.setLevel(_to_level(level))
                return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handler = logging.FileHandler(path, mode=mode, delay=True)
        handler.setLevel(_to_level(level))
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_Process0Only())
        setattr(handler, _MARK, "file")
        self._logger.addHandler(handler)

    def _log(self, level: int, msg: object, ranks: Iterable[int] | None, file_only: bool = False) -> None:
        if not self._logger.isEnabledFor(level):
            return
        rank = _process_index()
        if ranks is not None and rank not in set(ranks):
            return
        if not file_only:
            self._logger.log(level, "[rank %d] %s", rank, msg, stacklevel=3)
            return
        record = self._logger.makeRecord(self._logger.name, level, "(unknown file)", 0, "[rank %d] %s", (rank, msg),
                                         None)
        for h in self._logger.handlers:
            if getattr(h, _MARK, None) == "file" and record.levelno >= h.level:
                h.handle(record)

    def info(self, msg: object, ranks: Iterable[int] | None = None, file_only: bool = False) -> None:
        """Log ``msg`` at INFO on the processes in ``ranks`` (None: every process). ``file_only``:
        only to the files of :meth:`log_to_file`, not the console (a line the progress bar shows there)."""
        self._log(logging.INFO, msg, ranks, file_only)

    def warning(self, msg: object, ranks: Iterable[int] | None = None) -> None:
        """Log ``msg`` at WARNING on the processes in ``ranks`` (None: every process)."""
        self._log(logging.WARNING, msg, ranks)

    def error(self, msg: object, ranks: Iterable[int] | None = None) -> None:
        """Log ``msg`` at ERROR on the processes in ``ranks`` (None: every process)."""
        self._log(logging.ERROR, msg, ranks)

    def debug(self, msg: object, ranks: Iterable[int] | None = None) -> None:
        """Log ``msg`` at DEBUG on the processes in ``ranks`` (None: every process)."""
        self._log(logging.DEBUG, msg, ranks)


def get_dist_logger(
    name: str = "jaxcolossal",
    log_file: str | os.PathLike | None = None,
    level: int | str = "INFO",
) -> DistributedLogger:
    """Return the process-wide :class:`DistributedLogger` called ``name``.

    Mirrors ``colossalai.logging.get_dist_logger``. The first call creates the logger
    (stderr handler, level ``level``); later calls with the same name return the same
    object without adding handlers and without changing its level (use
    :meth:`DistributedLogger.set_level`). ``log_file``, if given, is added with
    :meth:`DistributedLogger.log_to_file` (process 0 only; the same path is added once).

    Args:
      name: logger name (also the stdlib logger name).
      log_file: optional file path written by process 0 only.
      level: level name (``"DEBUG"``, ``"INFO"``, ``"WARNING"``, ``"ERROR"``) or int,
        applied when the logger is created.

    Returns:
      The :class:`DistributedLogger` for ``name``.

    Raises:
      ValueError: unknown level name.
      TypeError: ``level`` is neither a string nor an int.
    """
    level_value = _to_level(level)
    with _lock:
        logger = _registry.get(name)
        if logger is None:
            logger = DistributedLogger(name, level_value)
            _registry[name] = logger
    if log_file is not None:
        logger.log_to_file(log_file)
    return logger
