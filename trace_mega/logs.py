"""Console and log-file logging of the `trace-mega` commands.

The console shows what a user acts on: trace_mega's own records (the step
line, resume / export / eval notes), warnings of trace_mega's code (not
deprecation notices), library
records at WARNING and above that come through `logging`, and every ERROR.
Library INFO records (Megatron's `OptimizerConfig(...)` and DDP config dumps,
its parameter-bucket lists, transformers' config loading, vLLM's engine
start-up) and Python warnings raised inside libraries (Transformer Engine /
Apex fallback notices, deprecations) go only to the log file — and to the
console too with `--verbose`. The log file, `<run dir>/<command>.log`
(`<command>.rank<r>.log` on rank r > 0), gets every record at INFO and above,
including those emitted before the run directory was known (they are buffered).

Console records are written with `tqdm.write`, so they land above the progress
bars instead of inside them. Ranks other than 0 print only warnings and errors.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

_PACKAGE_DIR = Path(__file__).resolve().parent
_BUFFER_RECORDS = 100_000


def _is_ours(name: str) -> bool:
    return name == "trace_mega" or name.startswith("trace_mega.")


class ConsoleFilter(logging.Filter):
    """Which records reach the console (see the module docstring)."""

    def __init__(self, verbose: bool, rank: int = 0) -> None:
        super().__init__()
        self.verbose, self.rank = verbose, rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if self.rank != 0:
            return record.levelno >= logging.WARNING and (self.verbose or _is_ours(record.name))
        if self.verbose or _is_ours(record.name):
            return True
        # Library records: logging warnings yes, Python warnings (import-time notices) no.
        return record.levelno >= logging.WARNING and record.name != "py.warnings"


class _ConsoleFormatter(logging.Formatter):
    """`HH:MM:SS message` for trace_mega's INFO; level and logger name for everything else."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self._long = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if _is_ours(record.name) and record.levelno == logging.INFO:
            return super().format(record)
        return self._long.format(record)


class _TqdmHandler(logging.StreamHandler):
    """A stderr handler that prints through `tqdm.write` (keeps progress bars intact)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001  (logging must never raise; Handler.handleError reports)
            self.handleError(record)


_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` through logging: `trace_mega.warnings` for warnings raised in
    this package's files, `py.warnings` for everyone else's and for deprecation notices
    (those attributed to this package come from library calls made through it, e.g. torch
    deprecations surfacing in the CPU compatibility layer's `__torch_function__`)."""
    try:
        ours = Path(filename).resolve().is_relative_to(_PACKAGE_DIR) and not issubclass(category, _DEPRECATIONS)
    except (OSError, ValueError):
        ours = False
    logger = logging.getLogger("trace_mega.warnings" if ours else "py.warnings")
    logger.warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)


def _route_library_loggers() -> None:
    """Make libraries that install their own stream handlers log through the root logger.

    transformers attaches a stderr handler to its `transformers` logger and
    stops propagation; vLLM does the same unless VLLM_CONFIGURE_LOGGING=0
    (read when vllm is imported, also by its engine subprocesses).
    """
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.set_verbosity_info()


class _State:
    console: Optional[logging.Handler] = None
    buffer: Optional[logging.handlers.MemoryHandler] = None
    file: Optional[logging.Handler] = None


def setup_logging(verbose: bool = False, rank: Optional[int] = None) -> None:
    """Install the console handler and start buffering records for the log file (idempotent)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    root = logging.getLogger()
    for h in (_State.console, _State.buffer, _State.file):
        if h is not None:
            root.removeHandler(h)
            h.close()
    _State.file = None
    root.setLevel(logging.INFO)
    console = _TqdmHandler()
    console.addFilter(ConsoleFilter(verbose, rank))
    console.setFormatter(_ConsoleFormatter())
    # Until `log_to_file` names the file, every record waits here (never flushed on its own).
    buffer = logging.handlers.MemoryHandler(_BUFFER_RECORDS, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    root.addHandler(console)
    root.addHandler(buffer)
    _State.console, _State.buffer = console, buffer
    warnings.showwarning = _showwarning
    _route_library_loggers()


def log_to_file(run_dir: str | Path, command: str, rank: Optional[int] = None) -> Path:
    """Write every record (the buffered ones first) to `<run_dir>/<command>[.rank<r>].log`."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = Path(run_dir) / (f"{command}.log" if rank == 0 else f"{command}.rank{rank}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    if _State.buffer is not None:
        _State.buffer.setTarget(handler)
        _State.buffer.flush()
        root.removeHandler(_State.buffer)
        _State.buffer.close()
        _State.buffer = None
    if _State.file is not None:
        root.removeHandler(_State.file)
        _State.file.close()
    root.addHandler(handler)
    _State.file = handler
    return path
