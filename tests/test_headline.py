"""scripts/headline.py writes README's headline table from bench reports; the README's first
screen tells a newcomer how to start."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "scripts" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


headline = _load_script()

HEADER = {
    "machine": "x86_64",
    "os": "Linux 6.1",
    "cpu": "Test CPU",
    "cpu_count": 2,
    "mlx": "0.32.4",
    "mlx_lm": "0.32.2",
    "device": "cpu",
    "blas": "OpenBLAS",
    "blas_threads": "2",
    "target": "bundled/target",
    "draft": "bundled/dflash2",
    "drafter_kind": "DFlash 2",
    "target_quantization": "none",
    "draft_quantization": "none",
    "dtype": "float32",
    "dflash_mac": "0.1.0",
}


def _row(bs: int | str, speedup: float, tau: float, greedy: bool, mix: dict | None = None) -> dict:
    return {
        "block_size": bs,
        "suite": "code",
        "prompts": 2,
        "trials": 3,
        "runs": 6,
        "baseline_tps": [200.0, 1.0],
        "dflash_tps": [200.0 * speedup, 2.0],
        "speedup": [speedup, 0.01],
        "speedup_ci": [speedup - 0.1, speedup + 0.1],
        "tau": [tau, 1.0],
        "block_mix": mix or {},
        "lossless_equal": 6 if greedy else None,
        "lossless_checked": 6 if greedy else None,
    }


def _report(temp: float, sizes: list, rows: list[dict], date: str, vs: list, v: int = 2) -> dict:
    return {
        "schema": f"dflash-mac-bench/{v}",
        "header": {**HEADER, "date": date},
        "config": {
            "suite": "code",
            "prompts_file": None,
            "trials": 3,
            "max_tokens": 128,
            "block_sizes": sizes,
            "temp": temp,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
        },
        "rows": rows,
        "best_block_size": sizes[-1],
        "auto_vs_fixed": [{"block_size": b, "ratio": r, "ci": [r - 0.02, r + 0.02]} for b, r in vs],
        "lossless": {"checked": None, "equal": None, "mismatches": []},
        "prompts": [{"prompt_tokens": 30}, {"prompt_tokens": 60}],
    }


GREEDY = _report(  # schema /2: `auto` is the block size "auto"
    0.0,
    ["auto", 8],
    [_row("auto", 1.9, 4.0, True, {"1": 10, "8": 90}), _row(8, 2.0, 4.3, True, {"8": 100})],
    "2026-12-01 10:00 UTC",
    [(8, 0.95)],
)
SAMPLED_OLD = _report(
    0.7, [0, 1], [_row(0, 0.5, 1.0, False), _row(1, 0.5, 1.0, False)], "2026-12-01 10:05 UTC", [], 1
)
SAMPLED = _report(  # schema /1: `auto` was block size 0
    0.7,
    [0, 1],
    [_row(0, 1.05, 1.3, False, {"1": 75, "4": 25}), _row(1, 1.0, 1.0, False, {"1": 100})],
    "2026-12-01 10:10 UTC",
    [(1, 1.05)],
    v=1,
)


@pytest.fixture
def files(tmp_path):
    greedy = tmp_path / "greedy.jsonl"
    greedy.write_text(json.dumps(GREEDY) + "\n" + json.dumps({"flat": "row"}) + "\n")
    sampled = tmp_path / "t07.jsonl"
    sampled.write_text(json.dumps(SAMPLED_OLD) + "\n" + json.dumps(SAMPLED) + "\n")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- headline:start -->\nold\n<!-- headline:end -->\n\nrest\n")
    return readme, greedy, sampled


def test_writes_the_section_from_several_files(files, capsys):
    readme, greedy, sampled = files
    assert headline.main([str(greedy), str(sampled), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n<!-- headline:start -->\n") and text.endswith("\n\nrest\n")
    assert "old" not in text
    section = text.split("<!-- headline:start -->")[1].split("<!-- headline:end -->")[0]
    assert "`greedy.jsonl`, `t07.jsonl`" in section  # the files, named
    assert "Test CPU, 2 cores; MLX 0.32.4 on the CPU, BLAS: OpenBLAS (2 threads)" in section
    assert "2026-12-01 10:00–10:10 UTC" in section
    assert "1 earlier report of the same setting left out" in section
    rows = [line for line in section.splitlines() if line.startswith(("| greedy", "| T = "))]
    assert len(rows) == 4
    assert rows[0].startswith("| greedy | 2 code, 30–60 tokens × 3 trials | auto (drafts in 90 %")
    assert "1.90× [1.80, 2.00]" in rows[0] and "0.950× [0.930, 0.970] vs 8" in rows[0]
    assert "6/6 identical" in rows[1]
    assert rows[2].startswith("| T = 0.7 | 2 code, 30–60 tokens × 3 trials | auto (drafts in 25 %")
    assert "1.05×" in rows[2]  # the later T 0.7 report
    assert "0.50×" not in section
    assert "1 (plain steps)" in rows[3] and "sampled, not compared" in rows[3]
    # the CPU sentence, with this run's cycle cost: block 8 at η = 2.0 / 4.3
    assert "block-8 cycle costs 2.1 plain steps" in section
    assert "What a CPU figure predicts for a Mac" in section


def test_check_and_rewrite_from_the_named_sources(files, capsys):
    readme, greedy, sampled = files
    assert headline.main(["--check", str(greedy), str(sampled), "--readme", str(readme)]) == 1
    assert headline.main([str(greedy), str(sampled), "--readme", str(readme)]) == 0
    written = readme.read_text()
    assert headline.main(["--check", "--readme", str(readme)]) == 0  # sources from the README
    assert headline.main(["--check", str(greedy), "--readme", str(readme)]) == 1  # other files
    readme.write_text(written.replace("1.05×", "1.50×"))  # a hand edit
    assert headline.main(["--check", "--readme", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert headline.main(["--readme", str(readme)]) == 0  # rewritten from the named files
    assert readme.read_text() == written


def test_refuses_what_it_cannot_make(files, tmp_path, capsys):
    readme, greedy, sampled = files
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    assert headline.main([str(greedy), "--readme", str(bare)]) == 2
    assert headline.main(["--readme", str(readme)]) == 2  # no files given or named
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"flat": "row"}) + "\n")
    assert headline.main([str(empty), "--readme", str(readme)]) == 2
    assert (
        headline.main([str(greedy), str(sampled), "--max-rows", "3", "--readme", str(readme)]) == 2
    )
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({**SAMPLED, "header": {**SAMPLED["header"], "cpu": "Other"}}))
    assert headline.main([str(greedy), str(other), "--readme", str(readme)]) == 2
    assert "different machines" in capsys.readouterr().err


def test_readme_first_screen_says_how_to_start():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "make run" in first
    assert "make test" in first
    assert ".venv/bin" in first


def test_readme_headline_is_current():
    """The README's table is what scripts/headline.py makes of the files it names."""
    assert headline.main(["--check"]) == 0
