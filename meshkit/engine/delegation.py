"""How the Engine exposes its components' verbs, typed as the components define them.

    save_state = Verb("checkpoints", Checkpoints.save_state)      # engine.save_state(...) -> str
    process_index = Attribute[int]("processes", Processes)        # engine.process_index: int

On an engine the attribute is the component's own (a bound method, or a property's value), and a type checker
or an editor sees the component's signature and return type; on the class it is the component's function or
property, so `help(Engine.save_state)` shows the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Verb(Generic[P, R]):
    """A method of the component held in the attribute `component` of the owner."""

    def __init__(self, component: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.component = component
        self.method = method
        self.name = method.__name__
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"{owner.__name__}.{name} delegates to a method named {self.name!r}: use one name")

    @overload
    def __get__(self, instance: None, owner: type) -> Callable[Concatenate[Any, P], R]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self.method
        return getattr(getattr(instance, self.component), self.name)


class Attribute(Generic[T]):
    """A property (or plain attribute) of the component held in the attribute `component` of the owner; the
    type is given where it is declared: `Attribute[int]("processes", Processes)`."""

    def __init__(self, component: str, kind: type) -> None:
        self.component = component
        self.kind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if not hasattr(self.kind, name):
            raise TypeError(f"{owner.__name__}.{name}: {self.kind.__name__} has no {name!r} to delegate to")
        self.name = name
        self.__doc__ = getattr(self.kind, name).__doc__

    @overload
    def __get__(self, instance: None, owner: type) -> Any: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return getattr(self.kind, self.name)
        return getattr(getattr(instance, self.component), self.name)
