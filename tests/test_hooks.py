"""The one per-instance hook helper (dflash_mac/target/hooks.py): wraps one instance, nests, shares,
and restores the instance exactly (class, attributes, parameter paths)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from dflash_mac.target import hooks


class Tag:
    """A hook that records its name around the call it wraps."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __call__(self, obj, call, *args, **kwargs):
        self.log.append(f"{self.name}>")
        out = call(*args, **kwargs)
        self.log.append(f"<{self.name}")
        return out


def snapshot(m: nn.Module) -> tuple:
    return type(m), dict(vars(m)), [k for k, _ in tree_flatten(m.parameters())]


def test_install_wraps_one_instance_and_remove_restores_it():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    before, x, log = snapshot(a), mx.ones((1, 2)), []
    want = a(x)
    tag = hooks.install(a, Tag("t", log))
    assert type(a) is not nn.Linear and isinstance(a, nn.Linear)
    assert hooks.original_class(a) is nn.Linear and hooks.hooks_of(a) == (tag,)
    assert dict(vars(a)) == before[1]  # nothing is set on the instance
    assert [k for k, _ in tree_flatten(a.parameters())] == before[2]
    assert mx.array_equal(a(x), want) and log == ["t>", "<t"]
    b(x)
    assert log == ["t>", "<t"] and type(b) is nn.Linear  # the class is untouched
    hooks.remove(a, tag)
    assert snapshot(a) == before and not hooks.is_hooked(a)
    hooks.remove(a, tag)  # nothing left to remove


def test_nested_hooks_run_outermost_last_and_come_off_in_any_order():
    m, log = nn.Linear(2, 2), []
    inner, outer = Tag("in", log), Tag("out", log)
    with hooks.hooked(m, inner), hooks.hooked(m, outer):
        m(mx.ones((1, 2)))
        assert log == ["out>", "in>", "<in", "<out"]
        hooks.remove(m, inner)
        log.clear()
        m(mx.ones((1, 2)))
        assert log == ["out>", "<out"] and hooks.find(m, Tag) is outer
    assert type(m) is nn.Linear


def test_a_shared_hook_comes_off_with_its_last_user():
    m, tag = nn.Linear(2, 2), Tag("t", [])
    hooks.install(m, tag)
    hooks.install(m, tag)
    assert hooks.hooks_of(m) == (tag,)
    hooks.remove(m, tag)
    assert hooks.hooks_of(m) == (tag,)
    hooks.remove(m, tag)
    assert type(m) is nn.Linear


def test_hooked_restores_on_error_and_is_hooked_sees_submodules():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    deep = model.layers[1].layers[0]
    with pytest.raises(RuntimeError), hooks.hooked(deep, Tag("t", [])):
        assert hooks.is_hooked(model) and not hooks.is_hooked(model.layers[0])
        raise RuntimeError
    assert not hooks.is_hooked(model) and type(deep) is nn.Linear
    lasting = hooks.install(model, Tag("lasting", []))
    assert hooks.is_hooked(model) and not hooks.is_hooked(model, ignore=lasting)
    hooks.remove(model, lasting)
