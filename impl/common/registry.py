"""Named components picked by a config string: the one place a policy name turns into behaviour.

A system keeps its policies (and the baselines it runs) in a :class:`Registry`; its config names
one, :meth:`Registry.get` hands back the component or fails in one line naming the field and the
known names. Code outside a registry never branches on a policy string: it asks the component.
"""
from __future__ import annotations

from typing import Callable, Dict, Generic, Iterator, Tuple, TypeVar

from impl.common.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Components of one kind by name, in registration order."""

    def __init__(self, kind: str, field: str = "system.policy"):
        self.kind = kind
        self.field = field
        self._items: Dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item
        return item

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under each of ``names``."""
        if not names:
            raise ValueError("register needs at least one name")

        def deco(item: T) -> T:
            for name in names:
                self.add(name, item)
            return item

        return deco

    def get(self, name: str, field: str | None = None) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(f"{field or self.field}: unknown {self.kind} {name!r} "
                              f"(one of: {', '.join(self._items)})") from None

    def names(self) -> Tuple[str, ...]:
        return tuple(self._items)

    def items(self) -> Iterator[Tuple[str, T]]:
        return iter(tuple(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)
