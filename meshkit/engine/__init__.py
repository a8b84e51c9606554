"""The Engine, the one object a training script touches, and the components it is built from."""

from meshkit.engine.engine import ConfigConflictWarning, Engine, EngineError, WrappedModelWarning

__all__ = ["ConfigConflictWarning", "Engine", "EngineError", "WrappedModelWarning"]
