"""How the Engine exposes its components' verbs: `save_state = Delegated("checkpoints", Checkpoints)`.

On an engine, the attribute is the component's own (a bound method, or a property's value); on the class it is
the component class's function or property, so `help(Engine.save_state)` and signatures show the real ones.
"""

from __future__ import annotations

from typing import Any


class Delegated:
    def __init__(self, component: str, kind: type) -> None:
        self.component = component
        self.kind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if not hasattr(self.kind, name):
            raise TypeError(f"{owner.__name__}.{name}: {self.kind.__name__} has no {name!r} to delegate to")
        self.name = name
        self.__doc__ = getattr(self.kind, name).__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return getattr(self.kind, self.name)
        return getattr(getattr(instance, self.component), self.name)
