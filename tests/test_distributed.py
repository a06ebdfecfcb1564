"""Distributed DFlash (dflash_mac/distributed/): the packet, the one-sentence errors, and two
local ranks on loopback started with `dflash-mac launch` compared token for token with
single-process decoding (tensor and pipeline parallel, a hybrid GatedDeltaNet target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mac.cli.launch import LaunchError, hosts_from, ring_file
from dflash_mac.distributed.group import CAPACITY, HEADER, PACKET, Cmd, Header, packet
from dflash_mac.distributed.sharded import check_divisible, choose_mode
from dflash_mac.errors import LoadError

LAUNCH_TIMEOUT_S = 150


def test_packet_layout():
    head = Header(Cmd.FORWARD, slot=3, trim=5, n=4, armed=1, free=2)
    pkt = packet(head, mx.array([7, 8, 9, 10]))
    assert pkt.shape == (PACKET,) and pkt.dtype == mx.int32
    assert Header.parse(pkt[:HEADER].tolist()) == head
    assert pkt[HEADER : HEADER + 4].tolist() == [7, 8, 9, 10]
    assert pkt[HEADER + 4 :].tolist() == [0] * (CAPACITY - 4)
    long = packet(Header(Cmd.FORWARD, 1, 0, CAPACITY + 1), mx.zeros((CAPACITY + 1,)))
    assert long[HEADER:].tolist() == [0] * CAPACITY  # long inputs follow in a second all_sum


def test_mode_and_shard_errors(tiny_pair):
    target = tiny_pair.target  # qwen3: tensor parallel only
    assert choose_mode(target, None, "t") == "tensor"
    with pytest.raises(LoadError) as e:
        choose_mode(target, "pipeline", "t")
    assert (
        str(e.value)
        == "target 't' (qwen3) cannot be split with --parallel pipeline; use --parallel tensor."
    )

    class Spec:
        model = label = "t"
        text_config = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8}

    check_divisible(Spec, 2)
    with pytest.raises(LoadError) as e:
        check_divisible(Spec, 3)
    assert "does not shard over 3 ranks (4 attention heads are not divisible by 3)" in str(e.value)
    assert "; use -n 2," in str(e.value)  # the rank counts that divide all three


def test_hosts_errors(tmp_path):
    with pytest.raises(LaunchError, match=r"pass -n N \(at least 2 local ranks\)"):
        hosts_from(1, None)
    bad = tmp_path / "hosts.json"
    bad.write_text("[{")
    with pytest.raises(LaunchError, match="is not an MLX hostfile"):
        hosts_from(None, bad)
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}]))
    with pytest.raises(LaunchError, match="a job needs at least 2"):
        hosts_from(None, one)
    hosts, backend, _ = hosts_from(2, None)
    ring = ring_file(hosts, None)
    assert backend == "ring" and len({a for (a,) in ring}) == 2
    assert all(a.startswith("127.0.0.1:") for (a,) in ring)


# -- two local ranks, the installed command (slow) --------------------------------------------


def launch(args: list[str], home: Path, **kw) -> subprocess.Popen:
    env = dict(
        os.environ, DFLASH_MAC_HOME=str(home), HF_HUB_OFFLINE="1", DFLASH_MAC_BLAS="reference"
    )
    cmd = [sys.executable, "-m", "dflash_mac", "launch", "-n", "2", "--timeout", "90", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launch did not finish in {LAUNCH_TIMEOUT_S} s: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    from helpers.tiny_hybrid import build_tiny_hybrid_pair

    return build_tiny_hybrid_pair(tmp_path_factory.mktemp("hybrid"), block_size=8)


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    """A tiny llama GGUF target (Q8_0) and a random drafter for it: `launch` loads GGUF
    targets on every rank as one process does (issue 55: the default pair's is a GGUF)."""
    from gguf_files import write_drafter_for, write_gguf

    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(folder / "m.gguf", "llama", "Q8_0")
    return folder / "m.gguf", write_drafter_for(folder / "draft")


CASES = {  # name: (pair, parallel, generate flags, collectives per forward on rank 0)
    "bundled-tensor-greedy": (None, "tensor", ["--temp", "0"], 2 * 6 + 1),
    "gguf-tensor-greedy": ("gguf", "tensor", ["--temp", "0"], 2 * 2 + 1),
    # a fixed block: sampled text follows the sizes, and `auto` times a sharded pair's own
    "gguf-tensor-sampled": ("gguf", "tensor", ["--temp", "0.7", "--seed", "5", "-b", "4"], 5),
    "hybrid-tensor-sampled": ("hybrid", "tensor", ["--temp", "0.7", "--seed", "7"], 2 * 6 + 1),
    # pipeline: the packet, rank 0's recv, the all_gather of the last hidden state, features
    "hybrid-pipeline-greedy": ("hybrid", "pipeline", ["--temp", "0"], 4),
    "hybrid-pipeline-sampled": ("hybrid", "pipeline", ["--temp", "0.7", "--seed", "3"], 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_launch_matches_single_process(case, hybrid_dirs, gguf_dirs, tmp_path):
    """Two ranks give the tokens of a single process, and each forward costs exactly the
    counted collectives (tensor parallel: 2 per layer + the packet)."""
    from dflash_mac.api import generate
    from dflash_mac.loading.loader import load

    which, mode, flags, collectives = CASES[case]
    dirs = {"hybrid": hybrid_dirs, "gguf": gguf_dirs}.get(which, (None, None))
    pair_flags = []
    if which is not None:
        pair_flags = ["--model", str(dirs[0]), "--draft", str(dirs[1])]
        pair_flags += ["--ignore-chat-template"]
    prompt = "Write a function that adds two numbers. " * 8  # > 64 tokens: a second all_sum
    args = ["generate", prompt, "--json", "-n", "16", *pair_flags, *flags]
    proc = launch(["--parallel", mode, "--", *args], tmp_path)
    code, out, err = finish(proc)
    assert code == 0, err[-2000:]
    got = json.loads(out)
    pair = load(*dirs)
    temp = float(flags[1])
    seed = int(flags[3]) if len(flags) > 2 else None
    want = generate(
        pair,
        prompt,
        max_tokens=16,
        temp=temp,
        seed=seed,
        ignore_chat_template=which is not None,
        block_size=int(flags[5]) if len(flags) > 4 else None,
    )
    assert got["tokens"] == want.tokens
    assert (got["ranks"], got["parallel"]) == (2, mode)
    assert got["collectives_per_cycle"] == collectives


def rank_pid(launcher: int, rank: int) -> int | None:
    """The PID of `rank` among the launcher's children (Linux /proc)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    for pid in children.read_text().split():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks via /proc")
@pytest.mark.parametrize("lost", [1, 0])
def test_killed_rank_stops_the_others(lost, tmp_path):
    """A worker (or the leader) killed mid-generation: the survivor exits non-zero with one
    sentence naming the lost rank, within 10 s, and the launcher says how that rank ended."""
    # greedy from a prompt the bundled target writes on from to the token limit (a sampled text,
    # or greedy from another prompt, may end early at EOS)
    args = ["--", "generate", "import os", "-n", "1500", "--ignore-chat-template", "--temp", "0"]
    proc = launch(args, tmp_path)
    pid = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        pid = rank_pid(proc.pid, lost)
        ready = list(Path(tempfile.gettempdir()).glob(f"dflash-launch-{proc.pid}-*/[01]"))
        if pid and len(ready) == 2:  # both ranks have loaded
            break
        time.sleep(0.2)
    assert pid, f"rank {lost} never started"
    time.sleep(1.0)
    os.kill(pid, 9)
    killed = time.monotonic()
    code, out, err = finish(proc)
    took = time.monotonic() - killed
    assert took < 10
    assert code != 0
    survivor = 1 - lost
    said = f"rank {survivor} lost the connection to rank {lost} (it exited or is unreachable)."
    # the survivor's own sentence; when missing, how long it lasted tells a hang (the launcher
    # stops a survivor after 8 s) from a sentence lost on the way
    assert said in err, (round(took, 1), code, err, out[-300:])
    assert f"rank {lost} was killed by SIGKILL." in err
    assert "Traceback" not in err


@pytest.mark.parametrize("survivor_exits", [False, True])
def test_a_survivor_stuck_on_a_lost_neighbour_is_named_by_the_launcher(
    survivor_exits, tmp_path, monkeypatch
):
    """Rank 1 dies; rank 0 either leaves on its own (it said why) or stays stuck past the grace
    (MLX's ring waiting in a collective): the launcher stops it and says what it lost."""
    from dflash_mac.cli import launch as launcher

    monkeypatch.setattr(launcher, "GRACE_S", 2.0)
    stay = f"import time; time.sleep(0.3 if {survivor_exits} else 60); raise SystemExit(1)"
    die = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    ranks = []
    for i, code in enumerate((stay, die)):
        (tmp_path / str(i)).touch()  # both ready
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        ranks.append(launcher.Rank(i, "127.0.0.1", proc))
    status, why = launcher.supervise(ranks, tmp_path, timeout=30)
    lost = "rank 0 lost the connection to rank 1 (it exited or is unreachable)."
    assert status == 1 and why[-1] == "rank 1 was killed by SIGKILL."
    assert why[:-1] == ([] if survivor_exits else [lost])


def test_busy_port_and_lost_rank_sentences(monkeypatch, tmp_path):
    import socket

    from dflash_mac.distributed.group import join_error, lost_peer_message

    hosts, _, _ = hosts_from(2, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(LaunchError) as e:
            ring_file(hosts, port)
    assert str(e.value) == f"port {port} on 127.0.0.1 is busy; pass another --starting-port."
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    err = join_error(RuntimeError("[ring] Couldn't bind socket (error: 98)"))
    assert str(err) == "rank 1 could not listen on 127.0.0.1:5001: the port is busy."
    assert lost_peer_message(ValueError("other")) is None


def ring_writes(*words) -> list[bytes]:
    """One ring backend message as MLX writes it to unbuffered std::cerr: word by word."""
    out = [b"[ring]"]
    for w in words:
        out += [b" ", str(w).encode()]
    return [*out, b"\n"]


def relayed(data: bytes, verbose: bool = False) -> bytes:
    import io
    import types

    from dflash_mac.cli.launch import relay

    out = types.SimpleNamespace(buffer=io.BytesIO())
    relay(io.BytesIO(data), out, "", verbose)
    return out.buffer.getvalue()


def test_a_sentence_written_inside_the_ring_backends_chatter_is_shown_whole():
    """The survivor's sentence lands between any two words of the ring's own socket messages
    (two socket threads): the user sees the sentence and none of the chatter; a rank's own
    lines pass untouched; --verbose shows everything."""
    sentence = b"error: rank 0 lost the connection to rank 1 (it exited or is unreachable).\n"
    send = ring_writes("Sending to socket", 4, "failed with errno", 32)
    closed = ring_writes("Socket", 5, "was closed by the peer")
    for cut in range(len(send) + 1):
        for other in (closed, []):
            data = b"".join(send[:cut] + [sentence] + send[cut:] + other + send)
            assert relayed(data) == sentence, (cut, data)
            assert relayed(data, verbose=True) == data
    mixed = b"".join(x for pair in zip(send, closed) for x in pair)  # two threads, word by word
    assert relayed(mixed + sentence) == sentence
    own = b"42 tokens\nSocket programming\n-3\n\n[rank 1] ready\n"
    assert relayed(own) == own  # negative control: nothing of the ring's in them


def test_doctor_memory_per_rank():
    from dflash_mac.cli.doctor import memory_need_gb, memory_per_rank_gb
    from dflash_mac.loading.registry import load_registry

    entry = load_registry().get("qwen3-8b")
    one = memory_need_gb(entry, 4096)
    two = memory_per_rank_gb(entry, 4096, 2)
    assert two["worker"] == pytest.approx((one["target"] + one["kv"]) / 2 + one["overhead"])
    assert two["rank0"] == pytest.approx(two["worker"] + one["drafter"])
    assert two["rank0"] < one["total"]


def test_unreachable_host(tmp_path, monkeypatch):
    """A host that ssh cannot reach is named in one sentence, before any rank starts."""
    from dflash_mac.cli.launch import check_reachable

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(
        "#!/bin/sh\necho 'ssh: connect to host mac-2 port 22: No route' >&2\nexit 255\n"
    )
    (fake / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    with pytest.raises(LaunchError) as e:
        check_reachable("mac-2")
    assert str(e.value) == (
        "host mac-2 is unreachable over ssh (ssh: connect to host mac-2 port 22: No route)."
    )
