"""Per-instance hooks: wrap ONE module instance's `__call__`, never its class.

Installing the first hook swaps the instance's `__class__` to a subclass made for it alone,
whose `__call__` runs the hooks around the original one; the hooks and the original class live
on that subclass (nothing is set on the instance). Parameter paths are unchanged, so quantize and
save still work, and removing the last hook restores the instance's class exactly.

A hook is a callable `hook(obj, call, *args, **kwargs)` run in place of `obj(*args, **kwargs)`;
`call(*args, **kwargs)` runs what it wraps (the hooks installed before it, then the original).
Installing a hook already on the instance adds a user (streams sharing one capture); it comes off
with its last user."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from mlx import nn

Hook = Callable[..., Any]
H = TypeVar("H", bound=Hook)


class _Hooks:
    """What a hooked instance's own subclass holds: its original class, the hooks (innermost
    first) with their counts of users, and the call through all of them."""

    __slots__ = ("original", "hooks", "users", "entry")

    def __init__(self, obj: Any) -> None:
        self.original = type(obj)
        self.hooks: tuple[Hook, ...] = ()
        self.users: dict[int, int] = {}  # id(hook) -> installs not yet removed
        self.chain(obj)

    def chain(self, obj: Any) -> None:
        # built once per change, not per call: a forward calls hooked layers many times
        call = partial(self.original.__call__, obj)
        for hook in self.hooks:
            call = partial(hook, obj, call)
        self.entry: Callable[..., Any] = call


def _state(obj: object) -> _Hooks | None:
    return type(obj).__dict__.get("_hooks")


def _call(self: Any, *args: Any, **kwargs: Any) -> Any:
    return type(self)._hooks.entry(*args, **kwargs)


def install(obj: nn.Module, hook: H) -> H:
    """Wrap `obj`'s calls with `hook` (outermost), or add a user to it if it is already there;
    returns `hook`. For hooks that outlive a `with` block; `remove` takes them off."""
    state = _state(obj)
    if state is None:
        cls = type(obj)
        state = _Hooks(obj)
        body = {"__call__": _call, "_hooks": state, "__module__": cls.__module__}
        obj.__class__ = type(f"Hooked{cls.__name__}", (cls,), body)
    if id(hook) not in state.users:
        state.hooks = (*state.hooks, hook)
        state.chain(obj)
    state.users[id(hook)] = state.users.get(id(hook), 0) + 1
    return hook


def remove(obj: nn.Module, hook: Hook) -> None:
    """One user less of `hook` on `obj` (nothing if it is not there); the last user takes it
    off, and the last hook out restores `obj`'s class."""
    state = _state(obj)
    if state is None or id(hook) not in state.users:
        return
    state.users[id(hook)] -= 1
    if state.users[id(hook)]:
        return
    del state.users[id(hook)]
    state.hooks = tuple(h for h in state.hooks if h is not hook)
    state.chain(obj)
    if not state.hooks:
        obj.__class__ = state.original


@contextmanager
def hooked(obj: nn.Module, hook: H) -> Iterator[H]:
    """`install` for the length of a `with` block, removed however it ends."""
    install(obj, hook)
    try:
        yield hook
    finally:
        remove(obj, hook)


def hooks_of(obj: nn.Module) -> tuple[Hook, ...]:
    """The hooks on `obj`, innermost first (empty when it carries none)."""
    state = _state(obj)
    return state.hooks if state is not None else ()


def find(obj: nn.Module, kind: type[H]) -> H | None:
    """The hook of type `kind` on `obj`, if any (the innermost one)."""
    return next((h for h in hooks_of(obj) if isinstance(h, kind)), None)


def original_class(obj: nn.Module) -> type:
    """`obj`'s class without hooks: what it was before the first install."""
    state = _state(obj)
    return state.original if state is not None else type(obj)


def is_hooked(module: nn.Module, ignore: object = None) -> bool:
    """True if `module` or any module in it carries a hook, not counting the hook `ignore` (a
    distributed target's own, which lasts as long as the pair)."""
    return any(h is not ignore for m in module.modules() for h in hooks_of(m))
