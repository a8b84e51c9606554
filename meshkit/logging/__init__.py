"""`from meshkit.logging import get_logger`: Accelerate's multi-process logger for scripts that import everything
from meshkit (`meshkit.compat.accelerate.process_logging`)."""

from __future__ import annotations

from meshkit.compat.accelerate.process_logging import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
