"""Small name-keyed registries for the swappable parts.

Allocators, advantage estimators, losses, environments and rollout engines are
each chosen by name from a config. A registry maps name -> factory and, on a
bad name, raises an error that lists every valid name (`check`: a ConfigError
naming the config field, raised where the component is built).
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from trace_mega.configbase import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to factories, filled with the `register` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries)) or "(none registered)"
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def check(self, name: str, field: str) -> T:
        """The entry `name`, or a ConfigError naming the config `field` and every valid name."""
        if name not in self._entries:
            valid = ", ".join(sorted(self._entries)) or "(none registered)"
            raise ConfigError(f"{field}: unknown {self.kind} {name!r}; valid names: {valid}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
