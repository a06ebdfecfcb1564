"""The `dflash-mac` command line as a user meets it: errors in one sentence, Ctrl-C, a lazy
`--help`, flags that mean one thing everywhere, the `generate` summary and `models` layout."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from dflash_mac import cli
from dflash_mac.cli import convert
from dflash_mac.cli import models as manage
from dflash_mac.loading.loader import BUNDLED_DRAFT, BUNDLED_TARGET, LoadError
from dflash_mac.loading.registry import load_registry, parse_registry, thinking_warning

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

DFLASH = str(Path(sys.executable).parent / "dflash-mac")
runner = CliRunner()


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([DFLASH, *args], capture_output=True, text=True, timeout=timeout, **kw)


def one_error(res: subprocess.CompletedProcess, message: str) -> None:
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 1, res.stderr
    assert res.stderr == f"error: {message}\n"


def test_bad_input_is_one_sentence(tmp_path):
    """Each of these raised a traceback or misled before; now one sentence and exit 1."""
    bundled = load_registry().get("bundled")
    cases = [
        (["generate", "hi", "--seed", "-1"], "--seed must be between 0 and 2**64 - 1 (got -1)."),
        (["chat", "--seed", "-1"], "--seed must be between 0 and 2**64 - 1 (got -1)."),
        (
            ["generate", "", "--ignore-chat-template"],
            "the prompt is empty; give the text to answer, or - to read it from stdin.",
        ),
        (
            [
                "train",
                "-m",
                str(BUNDLED_TARGET),
                "--data",
                "missing.jsonl",
                "--out",
                str(tmp_path / "d"),
            ],
            "--data missing.jsonl does not exist; pass a JSONL file of prompts.",
        ),
        (
            ["generate", "hi", "--model", "/no/such/folder"],
            "the folder /no/such/folder does not exist.",
        ),
        (["pull", "/no/such/folder"], "the folder /no/such/folder does not exist."),
        (
            ["generate", "hi", "--reasoning", "foo"],  # refused before loading: no warning first
            "--reasoning must be one of on, off, low, medium, high, xhigh.",
        ),
        (
            ["convert", "bundled", str(tmp_path / "q")],
            f"'bundled' is a pair name; convert takes one model: its target "
            f"{bundled.target_source()} or its drafter {bundled.draft_source()}.",
        ),
        (
            ["convert", str(BUNDLED_DRAFT), str(tmp_path / "q"), "--group-size", "100"],
            "--group-size must be 32, 64 or 128, the sizes MLX quantizes with (got 100).",
        ),
    ]
    # a fresh data dir, as on a new machine: bad input must fail before the first-use cost
    # curve is timed (`--seed -1` once printed "saved the cost curve…" first)
    env = dict(os.environ, DFLASH_MAC_HOME=str(tmp_path / "home"))
    for args, message in cases:
        one_error(run(*args, cwd=tmp_path, env=env), message)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("delay", [0.4, 2.0])
def test_ctrl_c_during_start_up_is_one_line(delay):
    """SIGINT while the CLI imports, re-executes with OpenBLAS or loads the pair: exit 130 and
    one line, never a traceback."""
    # 2,000 plain greedy steps (~10 s) fit the context: no capping warning when the signal
    # lands after start-up, and no early end at EOS
    proc = subprocess.Popen(
        [DFLASH, "generate", "hi", "-n", "2000", "--block-size", "1", "--temp", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err == "interrupted.\n", err


def test_help_models_and_pull_import_no_mlx():
    """Building the app and rendering --help (top level) never imports MLX or a command;
    neither does the `models` / `pull` module."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from dflash_mac.cli import app\n"
        "res = CliRunner().invoke(app, ['--help'])\n"
        "assert res.exit_code == 0 and 'generate' in res.output and 'serve' in res.output\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm',"
        " 'dflash_mac.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    loaded = set(ast.literal_eval(out.strip()))
    assert not any(m == "mlx" or m.startswith(("mlx.", "mlx_lm")) for m in loaded), loaded
    commands = {module for module, _, _ in cli.LAZY_COMMANDS.values()}
    assert not loaded & (commands | {"dflash_mac.api", "dflash_mac.loading.loader"}), loaded
    assert "dflash_mac.cli" in loaded  # the negative control: the listing does see our modules
    code = (
        "import sys\nfrom dflash_mac.cli import models as manage\nmanage.models_report()\n"
        "print('mlx' in sys.modules, 'mlx_lm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == "False False"  # `models` and `pull` start without MLX


def test_cache_ls_reads_the_disk_tier_without_mlx(tmp_path):
    """`cache ls` lists a pair folder's files from their headers alone: no MLX, no mlx-lm."""
    folder = tmp_path / "prompt-cache" / "t--d-0123"
    folder.mkdir(parents=True)
    header = json.dumps({"__metadata__": {"start": "0", "end": "256"}}).encode()
    (folder / "a.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom dflash_mac.cli import app\n"
        "res = CliRunner().invoke(app, ['cache', 'ls'])\n"
        "print(res.exit_code, 'mlx' in sys.modules, 'mlx_lm' in sys.modules)\nprint(res.output)"
    )
    env = dict(os.environ, DFLASH_MAC_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    ).stdout
    assert out.splitlines()[0] == "0 False False"
    assert re.search(r"t--d-0123\s+1\s+256\s", out), out  # one file, 256 cached positions


# the controls: good input goes on to the load (an empty folder, exit 1 after the imports);
# generate and bench then load the engine too
LOADS = [
    ["generate", "hi", "--temp", "0.7", "--model", "EMPTY", "--draft", "EMPTY"],
    ["bench", "--limit", "1", "-n", "4", "--model", "EMPTY", "--draft", "EMPTY"],
    ["train", "-m", "EMPTY", "--data", "PROMPTS", "-o", "OUT"],
    ["convert", "EMPTY", "OUT"],
]


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi", "--seed", "-1"],
        ["generate", "hi", "--presence-penalty", "9"],
        ["generate", "hi", "--model", "/no/such/folder"],
        ["chat", "--min-p", "2"],
        ["chat", "--reasoning", "foo"],
        ["chat", "--model", "./no-such-folder"],
        ["serve", "--port", "0"],
        ["serve", "--port", "TAKEN"],
        ["serve", "--prompt-cache-size", "0"],
        ["serve", "--model", "/no/such/folder"],
        ["bench", "--seed", "-1"],  # a traceback after the load and warm-up, before
        ["bench", "--concurrency", "4", "--format", "csv"],
        ["bench", "--suite", "agent", "--prompts", "/no/such.json"],
        ["bench", "--cost-curve", "--shape", "nope"],
        ["bench", "--model", "/no/such/folder"],
        ["train", "-m", "bundled", "--data", "/no/such.jsonl", "-o", "OUT"],
        ["train", "-m", "bundled", "--data", "PROMPTS", "-o", "OUT", "--loss", "nope"],
        ["train", "-m", "bundled", "--data", "PROMPTS", "-o", "EMPTY"],  # not empty: --force
        ["convert", "/no/such/folder", "OUT"],
        ["convert", "EMPTY", "OUT", "--bits", "3"],
        ["cache", "nope"],
        *LOADS,
    ],
)
def test_bad_input_is_refused_before_the_slow_imports(args, tmp_path):
    """A typo costs the time Python starts, not the 2-3 s mlx-lm and the engine take."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        named = {
            "EMPTY": str(tmp_path),
            "TAKEN": str(taken.getsockname()[1]),
            "PROMPTS": str(prompts),
            "OUT": str(tmp_path.parent / f"{tmp_path.name}-out"),
        }
        args = [named.get(a, a) for a in args]
        code = (
            "import sys\nfrom typer.testing import CliRunner\nfrom dflash_mac.cli import app\n"
            f"res = CliRunner().invoke(app, {args!r})\n"
            "print(res.exit_code, 'mlx_lm' in sys.modules, 'dflash_mac.api' in sys.modules)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        ).stdout.split()
    good = args in [[named.get(a, a) for a in control] for control in LOADS]
    engine = good and args[0] in ("generate", "bench")
    assert out == ["1", str(good), str(engine)]  # refused with exit 1; the controls loaded


def test_installed_help_is_fast_and_lists_every_command():
    start = time.perf_counter()
    res = run("--help")
    assert res.returncode == 0 and time.perf_counter() - start < 10  # generous: a busy CI box
    for name in cli.LAZY_COMMANDS:
        assert re.search(rf"│ {name} ", res.stdout), name


def test_no_openblas_re_exec_for_help_and_commands_without_math():
    assert not cli.needs_blas([])
    assert not cli.needs_blas(["--help"]) and not cli.needs_blas(["generate", "-h"])
    assert not cli.needs_blas(["models"]) and not cli.needs_blas(["pull", "qwen3-4b"])
    assert not cli.needs_blas(["--version"]) and not cli.needs_blas(["cache", "ls"])
    assert cli.needs_blas(["generate", "hi"]) and cli.needs_blas(["doctor"])


def commands() -> dict[str, object]:
    group = typer.main.get_command(cli.app)
    return {name: group.get_command(None, name) for name in group.list_commands(None)}


def test_lazy_list_matches_each_command_docstring():
    """The short help in the lazy list is each command's own first docstring line."""
    for name, cmd in commands().items():
        if name in cli.LAZY_COMMANDS:
            assert cli.LAZY_COMMANDS[name][2] == cmd.help.strip().splitlines()[0], name


def test_short_flags_mean_one_thing_in_every_command():
    """-n is --max-tokens wherever it exists, -m the target model, and so on."""
    same = {"--target": "--model"}  # train's target is the other commands' --model
    meaning: dict[str, set[str]] = {}
    for cmd in commands().values():
        for p in cmd.params:
            longs = [o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
            for short in (o for o in p.opts if re.fullmatch(r"-\w", o)):
                meaning.setdefault(short, set()).update(same.get(o, o) for o in longs[:1])
    clashes = {s: m for s, m in meaning.items() if len(m) > 1}
    assert clashes == {}
    assert meaning["-n"] == {"--max-tokens"}


def test_help_shows_flags_without_bool_placeholders():
    for name in ["", *cli.LAZY_COMMANDS, "generate"]:
        res = runner.invoke(
            cli.app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "120"}
        )
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.output and "BOOLEAN" not in res.output, name


def test_generate_penalty_flags():
    """--logit-bias -100 bans tokens; penalties change the output; bad values are one sentence."""
    one_error(
        run("generate", "hi", "--logit-bias", "{1: 2}"),
        "--logit-bias is not valid JSON (Expecting property name enclosed in double quotes).",
    )
    one_error(
        run("generate", "hi", "--repetition-penalty", "-1"),
        "--repetition-penalty must be > 0.0 and <= 10.0 (got -1.0).",
    )
    plain = json.loads(run("generate", "def add(a, b):", "-n", "12", "--json").stdout)["tokens"]
    banned = json.dumps({str(t): -100 for t in plain[:4]})
    res = run(
        "generate",
        "def add(a, b):",
        "-n",
        "12",
        "--json",
        "--logit-bias",
        banned,
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.3",
        "--repetition-penalty",
        "1.2",
    )
    assert res.returncode == 0, res.stderr
    tokens = json.loads(res.stdout)["tokens"]
    assert len(tokens) == 12 and not set(tokens) & set(plain[:4])


def test_generate_prints_a_summary_line_and_json_names_the_pair():
    res = run("generate", "def add(a, b):", "-n", "6")
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(
        r"6 tokens · [\d.]+ tok/s · τ [\d.]+ · block auto ≤\d+ · TTFT \d+ ms "
        r"\(-v for details\)",
        res.stderr.splitlines()[-1],
    ), res.stderr
    res = run("generate", "def add(a, b):", "-n", "6", "--json")
    doc = json.loads(res.stdout)
    assert doc["model"] == str(BUNDLED_TARGET) and doc["drafter"] == str(BUNDLED_DRAFT)
    assert len(doc["tokens"]) == 6 and res.stderr == ""


def test_block_size_above_the_trained_block_is_clamped(tiny_pair):
    from dflash_mac.sizing.choice import block_size_for

    trained = tiny_pair.drafter.config.block_size
    clamped = block_size_for(tiny_pair, 999)
    assert clamped.size == trained and not clamped.auto
    assert clamped.warning == (
        f"block size 999 > the drafter's trained block {trained}; using {trained}."
    )  # a plain sentence: each front end styles it
    assert block_size_for(tiny_pair, trained).warning is None
    assert block_size_for(tiny_pair, None).size == trained


GOOD = {
    "name": "toy",
    "kind": "dflash",
    "target": "org/Toy-1B",
    "draft": "lab/Toy-1B-DFlash",
    "block_size": 16,
    "quantized_block_size": 5,
    "thinking": False,
    "target_gb": 1.0,
    "draft_gb": 0.1,
    "kv_kib_per_token": 10,
}


@pytest.mark.parametrize(
    "template, reasoning, advice",
    [
        ("{{ enable_thinking }}", "on", " (pass --reasoning off)."),
        ("{{ reasoning_effort }}", "on", " (omit --reasoning on)."),  # no switch: --reasoning off
        ("{{ reasoning_effort }}", "high", " (omit --reasoning high)."),  # would be refused
    ],
)
def test_thinking_advice_names_only_a_flag_that_helps(template, reasoning, advice):
    entry = parse_registry({"schema": 1, "default": "toy", "pair": [GOOD]}).get("toy")
    msg = thinking_warning(entry, reasoning, SimpleNamespace(chat_template=template))
    assert msg == (
        f"drafter 'lab/Toy-1B-DFlash' was trained without thinking but --reasoning "
        f"{reasoning} turns thinking on; acceptance will be low{advice}"
    )


def test_convert_fails_when_nothing_was_quantized(tmp_path, tiny_dirs):
    import mlx.core as mx

    out = tmp_path / "float"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), {"w": mx.zeros((4, 100))})
    with pytest.raises(LoadError) as e:
        convert.check_quantized("src", out, 128)
    assert str(e.value) == (
        "nothing in 'src' could be quantized with group size 128 (no weight "
        "width is a multiple of it); try --group-size 32."
    )
    assert not out.exists()
    res = runner.invoke(
        cli.app, ["convert", str(tiny_dirs[1]), str(tmp_path / "q"), "--group-size", "32"]
    )
    assert res.exit_code == 0, res.output
    assert convert.quantized_tensors(tmp_path / "q") > 0
    assert re.fullmatch(r"wrote 4-bit drafter to .* \(\d+ quantized weights\)\n", res.stdout)


def test_models_is_one_line_per_pair_when_piped():
    res = run("models", env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    names = [p.name for p in load_registry().pairs]
    assert len(lines) == 1 + len(names)
    assert not set("┃│━─┏") & set(res.stdout) and "\x1b[" not in res.stdout
    for name, line in zip(names, lines[1:]):
        assert line.split()[0] in (name, "★") and name in line.split()
    q = load_registry().get("qwen3-8b")
    assert q.draft in next(line for line in lines if " qwen3-8b " in line)


def test_models_fits_80_columns_on_a_terminal(monkeypatch):
    console = Console(width=80, force_terminal=True, color_system=None, record=True)
    monkeypatch.setattr(manage, "out", console)
    manage.models_command(as_json=False)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for p in load_registry().pairs:  # every name whole, on one row with its block sizes
        row = next(line for line in text.splitlines() if f" {p.name} " in line)
        assert f"{p.block_size} / {p.quantized_block_size}" in row
    assert "dflash-mac models --json" in " ".join(text.split())


def test_the_first_use_download_runs_before_the_spinner(monkeypatch):
    """Issue 55: the "Loading model pair…" spinner was drawn into pip's progress lines; the
    default pair's target is now fetched first (pip's bar alone), then the spinner runs, and
    an offline fallback's sentence is still said."""
    from contextlib import contextmanager

    from dflash_mac.cli import terminal

    events = []

    @contextmanager
    def spinner(*args, **kwargs):
        events.append("spinner on")
        yield
        events.append("spinner off")

    def fetch():
        events.append("download")
        return "tgt", "drf", "offline: using the tiny pair instead."

    def prepare(model, draft, **kwargs):
        events.append(f"load {model} {draft}")
        return SimpleNamespace(warnings=["w"])

    said = []
    monkeypatch.setattr(terminal.err, "status", spinner)
    monkeypatch.setattr(terminal, "default_sources", fetch)
    monkeypatch.setattr(terminal, "prepare", prepare)
    monkeypatch.setattr(terminal, "warn_line", said.append)
    monkeypatch.setattr(terminal, "default_download", lambda: True)
    terminal.load_pair(None, None)
    assert events == ["download", "spinner on", "load tgt drf", "spinner off"]
    assert said == ["offline: using the tiny pair instead.", "w"]
    events.clear()
    monkeypatch.setattr(terminal, "default_download", lambda: False)  # downloaded already
    terminal.load_pair(None, None)
    assert events == ["spinner on", "load None None", "spinner off"]
