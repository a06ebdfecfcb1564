"""`bench --suite agent-loop`: the decode speed of agent loops, which send the same shapes
again and again (tool-call JSON, a file repeated with a few lines changed, a plan re-stated, a
fix tried twice).

Shipped traces (`data/suites/agent-loop.json`: a system prompt, then per trace its user and
tool turns) are replayed turn by turn; each turn's answer is the target's own, generated here
and appended to the conversation before the next turn, so a greedy replay is the same on every
run. Three rows replay every trace: plain decoding (block 1), DFlash (`auto`) and DFlash with
copies and suffix drafting. Each row has ONE `Session` and ONE `AutoTuning` for all its
traces, as a server has, so later turns can draft from earlier answers (`AutoTuning.answers`),
and nothing of one row reaches another. Rows take turns answering each turn (their order
rotated from turn to turn), so a machine that slows down during the run slows every row alike.

Per row: decode tok/s (Σ tokens after each answer's first ÷ Σ their decode time), the speedup
against the plain row, τ, which strategy won the cycles (drafter, copy of the request's own
text, suffix draft from earlier answers, plain step), and for greedy whether every answer is
token-identical to the plain row's.

Light at import (no engine, no MLX): the command checks its options and reads the traces
before the slow imports; the replay imports the engine when it runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_mac.settings import check_request

from .inputs import SUITE_DIR, BenchError, parse_block_sizes

if TYPE_CHECKING:
    from dflash_mac.engine.stats import DecodeStats
    from dflash_mac.pair import Pair
    from dflash_mac.session import Session
    from dflash_mac.sizing.tuning import AutoTuning

SCHEMA = "dflash-mac-agent-loop/1"
KIND = "agent-loop"
TRACES = SUITE_DIR / "agent-loop.json"
ROLES = ("user", "tool")
STRATEGIES = ("drafter", "copy", "suffix", "plain")  # who won a cycle; see `strategies`


# -- the traces ----------------------------------------------------------------------------


def read_traces(path: Path | None = None) -> dict:
    """The traces file (the shipped one by default), checked: `{"system", "traces": [{"id",
    "turns": [{"role": "user"|"tool", "content"}], "system"?}]}`; BenchError otherwise."""
    path = Path(path or TRACES)
    try:
        doc = json.loads(path.read_text())
        assert isinstance(doc.get("system", ""), str), "system is not a string"
        traces = doc["traces"]
        assert isinstance(traces, list) and traces, "no traces"
        ids = [t["id"] for t in traces]
        assert all(isinstance(i, str) and i for i in ids), "a trace without an id"
        assert len(set(ids)) == len(ids), "two traces with one id"
        for t in traces:
            assert isinstance(t.get("system", ""), str), f"{t['id']}: system is not a string"
            assert t["turns"], f"{t['id']} has no turns"
            for turn in t["turns"]:
                assert turn["role"] in ROLES, f"{t['id']}: role {turn['role']!r}"
                assert isinstance(turn["content"], str) and turn["content"], f"{t['id']}: content"
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise BenchError(
            f'{path} is not an agent-loop traces file ({{"system", "traces": [{{"id", '
            f'"turns": [{{"role": "user"|"tool", "content"}}]}}]}}): {e}'
        )
    return doc


def check_options(
    fmt: str,
    block_size: str | None,
    trials: int | None,
    copy: bool | None,
    temps: list[float] | None,
    max_tokens: int,
    sampling: dict,
) -> list[float]:
    """The options `--suite agent-loop` takes, checked before the slow imports; returns the
    temperatures (default: greedy only). BenchError with one sentence otherwise."""
    if fmt not in ("md", "json"):
        raise BenchError(f"--suite agent-loop writes md or json (got --format {fmt}).")
    if block_size is not None and "," in str(block_size):
        raise BenchError("--suite agent-loop runs one DFlash block size (auto or a number).")
    sizes = parse_block_sizes(block_size)
    if sizes == [1]:  # the DFlash rows would be the plain row again
        raise BenchError(
            "--suite agent-loop's DFlash rows need --block-size auto or 2 or more (block 1 is its "
            "plain row)."
        )
    if trials is not None:
        raise BenchError(
            "--suite agent-loop replays each trace once per row; --trials does not apply "
            "(the temperature is --temp)."
        )
    if copy is not None:  # the rows themselves say where copies and suffix drafts run
        raise BenchError(
            "--suite agent-loop runs its rows with copies and suffix drafting off and on; "
            "--copy/--no-copy and --suffix do not apply."
        )
    temps = temps or [0.0]
    for t in temps:
        check_request(max_tokens=max_tokens, temp=t, **sampling)
    return temps


# -- the rows and the answers --------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One row: how it decodes."""

    name: str  # JSON key
    label: str  # what a person reads
    block: int | str  # 1: plain decoding; else the DFlash block size ("auto")
    copy: bool
    suffix: bool


def modes(block: int | str = "auto") -> list[Mode]:
    """The rows, plain first (the reference of the speedups and of greedy identity)."""
    return [
        Mode("plain", "plain decoding", 1, False, False),
        Mode("dflash", "DFlash", block, False, False),
        Mode("dflash+copy+suffix", "DFlash + copies + suffix", block, True, True),
    ]


@dataclass(frozen=True)
class Setting:
    """The sampling and the per-answer budget of one replay."""

    max_tokens: int = 128
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    use_eos: bool = True
    tree: int | None = None  # the DFlash rows' tree budget (None: `auto` weighs trees)
    reasoning: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def label(self) -> str:
        if self.greedy:
            return "greedy"
        extra = [f"top-p {self.top_p}"] if self.top_p < 1 else []
        extra += [f"top-k {self.top_k}"] if self.top_k else []
        extra += [f"min-p {self.min_p}"] if self.min_p else []
        return ", ".join([f"T {self.temp:g}", *extra])


@dataclass
class Answer:
    """One row's answer to one turn."""

    trace: str
    turn: int  # 1-based
    row: str  # Mode.name
    prompt_tokens: int
    reused_tokens: int  # prompt tokens the session had cached
    tokens: list[int]
    finish_reason: str
    decode_tokens: int  # tokens after the first (the first is the prefill's)
    decode_time_s: float
    cycles: int
    committed: int  # tokens the cycles committed (τ = committed / cycles)
    drafter: int  # cycles won by each strategy (`strategies`)
    copy: int
    suffix: int
    plain: int
    tree: int  # drafter cycles that verified a tree
    copy_tokens: int  # tokens committed by copies of this request's own text
    suffix_tokens: int  # tokens committed by suffix drafts from earlier answers
    identical: bool | None = None  # greedy: the same tokens as the plain row's answer
    text: str = field(default="", repr=False)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("text")  # the tokens are the record; the text is for the next turn's prompt
        return d


def strategies(s: DecodeStats) -> dict[str, int]:
    """Cycles by the strategy that drafted them: a suffix draft (from earlier answers), a copy
    (of this request's own text), a plain target step (block 1), else the drafter (a chain or a
    tree). Suffix cycles are copy cycles whose source was an earlier answer, so they are
    counted once, as suffix."""
    n = s.cycles
    pad = (False,) * n
    copied, suffixed = s.copied or pad, s.suffixed or pad
    sizes = s.block_sizes or (s.block_size,) * n
    out = dict.fromkeys(STRATEGIES, 0)
    for c, x, b in zip(copied, suffixed, sizes):
        out["suffix" if x else "copy" if c else "plain" if b == 1 else "drafter"] += 1
    return out


def answer(
    session: Session, ids: list[int], mode: Mode, setting: Setting, trace: str, turn: int
) -> Answer:
    """One turn answered by one row's session."""
    text, tokens, last = [], [], None
    for ev in session.stream(
        ids,
        max_tokens=setting.max_tokens,
        block_size=mode.block,
        temp=setting.temp,
        top_p=setting.top_p,
        top_k=setting.top_k,
        min_p=setting.min_p,
        use_eos=setting.use_eos,
        copy=mode.copy,
        suffix=mode.suffix,
        tree=None if mode.block == 1 else setting.tree,
    ):
        text.append(ev.text)
        tokens += ev.tokens
        last = ev
    s = last.stats
    won = strategies(s)
    return Answer(
        trace, turn, mode.name, s.prompt_tokens, s.cached_tokens,
        tokens[: s.generation_tokens], last.finish_reason or "", max(s.generation_tokens - 1, 0),
        s.decode_time, s.cycles, sum(s.acceptance_lengths), won["drafter"], won["copy"],
        won["suffix"], won["plain"], s.tree_cycles, s.copy_tokens - s.suffix_tokens,
        s.suffix_tokens, text="".join(text),
    )  # fmt: skip


def conversation_ids(pair: Pair, messages: list[dict], system: str, setting: Setting) -> list[int]:
    """A conversation's prompt ids; a template that cannot render it is one sentence."""
    from dflash_mac.api import prompt_ids
    from dflash_mac.errors import is_user_error

    try:
        return prompt_ids(pair.tokenizer, messages, system=system, reasoning=setting.reasoning)
    except Exception as e:  # jinja's errors: a template without a "tool" role, say
        if is_user_error(e):
            raise
        raise BenchError(f"the model's chat template cannot render this trace: {e}")


def turns(doc: dict, limit: int | None) -> Iterator[tuple[dict, int, dict]]:
    """(trace, 1-based turn, turn) in replay order: each trace's turns, trace after trace."""
    for trace in doc["traces"][:limit] if limit else doc["traces"]:
        for k, turn in enumerate(trace["turns"], 1):
            yield trace, k, turn


def replay(
    pair: Pair,
    doc: dict,
    setting: Setting,
    rows: list[Mode],
    tuning: Callable[[], AutoTuning],
    limit: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[Answer]:
    """Every trace (the first `limit`), turn by turn, answered by every row; `tuning` makes
    each row's own `AutoTuning` (a fresh one per row: rows share nothing)."""
    from dflash_mac.session import Session

    n = len(doc["traces"][:limit] if limit else doc["traces"])
    sessions = {m.name: Session(pair, cache_size=n + 1, tuning=tuning()) for m in rows}
    history: dict[tuple[str, str], list[dict]] = {}  # (row, trace) -> its conversation
    out: list[Answer] = []
    for slot, (trace, k, turn) in enumerate(turns(doc, limit)):
        system = trace.get("system", doc.get("system", ""))
        message = {"role": turn["role"], "content": turn["content"]}
        order = rows[slot % len(rows) :] + rows[: slot % len(rows)]  # each row in every slot
        said = []
        for m in order:
            messages = history.get((m.name, trace["id"]), []) + [message]
            ids = conversation_ids(pair, messages, system, setting)
            if len(ids) >= pair.context_length:
                raise BenchError(
                    f"trace {trace['id']} turn {k} ({m.label}) has {len(ids)} prompt tokens, "
                    f"more than the model's {pair.context_length}-token context holds; give "
                    "fewer new tokens (-n) or fewer traces (--limit)."
                )
            a = answer(sessions[m.name], ids, m, setting, trace["id"], k)
            history[(m.name, trace["id"])] = messages + [{"role": "assistant", "content": a.text}]
            out.append(a)
            said.append(f"{m.label} {len(a.tokens)} tokens {a.decode_tps:.1f} tok/s")
        progress(f"{trace['id']} turn {k}: " + ", ".join(said))
    # the plain row's answers, read once every row has answered (whatever order they took)
    reference = {(a.trace, a.turn): a.tokens for a in out if a.row == rows[0].name}
    if setting.greedy:
        for a in out:
            if a.row != rows[0].name:
                a.identical = a.tokens == reference[(a.trace, a.turn)]
    for s in sessions.values():
        s.cache.close()
    return out


def warm_up(pair: Pair, doc: dict, setting: Setting, rows: list[Mode], tuning) -> None:
    """One short answer per row in a throwaway session, so that the first timed row does not
    pay for first use (MLX's compiled kernels, the hooks) and no row keeps what it saw."""
    from dflash_mac.session import Session

    trace = doc["traces"][0]
    turn = trace["turns"][0]
    message = [{"role": turn["role"], "content": turn["content"]}]
    ids = conversation_ids(pair, message, trace.get("system", doc.get("system", "")), setting)
    short = replace(setting, max_tokens=8, use_eos=False)
    for m in rows:
        answer(Session(pair, tuning=tuning()), ids, m, short, trace["id"], 0)


# -- the report ----------------------------------------------------------------------------


def summarize(answers: list[Answer], rows: list[Mode], greedy: bool) -> list[dict]:
    """One summary per row, in row order; speedups against the first (plain) row."""
    out = []
    for m in rows:
        mine = [a for a in answers if a.row == m.name]
        tokens = sum(a.decode_tokens for a in mine)
        seconds = sum(a.decode_time_s for a in mine)
        cycles = sum(a.cycles for a in mine)
        checked = [a.identical for a in mine if a.identical is not None]
        out.append(
            {
                "row": m.name,
                "label": m.label,
                "block": str(m.block),
                "copy": m.copy,
                "suffix": m.suffix,
                "answers": len(mine),
                "generation_tokens": sum(len(a.tokens) for a in mine),
                "decode_tokens": tokens,
                "decode_time_s": seconds,
                "decode_tps": tokens / seconds if seconds > 0 else 0.0,
                "tau": sum(a.committed for a in mine) / cycles if cycles else 0.0,
                "cycles": cycles,
                "won": {k: sum(getattr(a, k) for a in mine) for k in STRATEGIES},
                "tree_cycles": sum(a.tree for a in mine),
                "copy_tokens": sum(a.copy_tokens for a in mine),
                "suffix_tokens": sum(a.suffix_tokens for a in mine),
                "identical": sum(checked) if greedy and m is not rows[0] else None,
                "checked": len(checked) if greedy and m is not rows[0] else None,
            }
        )
    base = out[0]["decode_tps"]
    for r in out:
        r["speedup"] = r["decode_tps"] / base if base > 0 else 0.0
    return out


def setting_doc(setting: Setting, answers: list[Answer], rows: list[Mode]) -> dict:
    """One sampling setting's part of the report."""
    summary = summarize(answers, rows, setting.greedy)
    checked = [r for r in summary if r["checked"] is not None]
    return {
        "setting": setting.label,
        "temp": setting.temp,
        "top_p": setting.top_p,
        "top_k": setting.top_k,
        "min_p": setting.min_p,
        "rows": summary,
        "identical": {
            "checked": sum(r["checked"] for r in checked),
            "equal": sum(r["identical"] for r in checked),
        }
        if setting.greedy
        else None,
        "answers": [a.as_dict() for a in answers],
    }


def run_suite(
    pair: Pair,
    doc: dict,
    settings: list[Setting],
    block: int | str,
    tuning: Callable[[], AutoTuning],
    limit: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """Warm up, then replay the traces at each setting; each setting's report part."""
    rows = modes(block)
    warm_up(pair, doc, settings[0], rows, tuning)
    parts = []
    for setting in settings:
        if len(settings) > 1:
            progress(setting.label)
        answers = replay(pair, doc, setting, rows, tuning, limit, progress)
        parts.append(setting_doc(setting, answers, rows))
    return parts


def report(header: dict, config: dict, parts: list[dict]) -> dict:
    """The report document (`"kind": "agent-loop"`, schema `SCHEMA`)."""
    return {"kind": KIND, "schema": SCHEMA, "header": header, "config": config, "settings": parts}


ROW_KEYS = {
    "row", "label", "block", "copy", "suffix", "answers", "generation_tokens", "decode_tokens",
    "decode_time_s", "decode_tps", "tau", "cycles", "won", "tree_cycles", "copy_tokens",
    "suffix_tokens", "identical", "checked", "speedup",
}  # fmt: skip


def validate(doc: dict) -> list[str]:
    """Problems of an agent-loop report document ([] when none)."""
    problems = [f"missing {k!r}" for k in ("header", "config", "settings") if k not in doc]
    if doc.get("kind") != KIND or doc.get("schema") != SCHEMA:
        problems.append(f"not {KIND} / {SCHEMA}")
    answer_keys = set(Answer.__dataclass_fields__) - {"text"}
    for i, part in enumerate(doc.get("settings", [])):
        for j, row in enumerate(part.get("rows", [])):
            if set(row) != ROW_KEYS:
                problems.append(f"settings[{i}].rows[{j}]: fields {sorted(set(row) ^ ROW_KEYS)}")
            elif set(row["won"]) != set(STRATEGIES):
                problems.append(f"settings[{i}].rows[{j}]: won {sorted(row['won'])}")
        for j, a in enumerate(part.get("answers", [])):
            if set(a) != answer_keys:
                problems.append(
                    f"settings[{i}].answers[{j}]: fields {sorted(set(a) ^ answer_keys)}"
                )
        counted = sum(r.get("answers", 0) for r in part.get("rows", []))
        if counted != len(part.get("answers", [])):
            problems.append(f"settings[{i}]: the rows count {counted} answers")
    return problems


def identical_line(part: dict) -> str:
    """The lossless sentence of a setting: "greedy identical N/N ..." or why not compared."""
    same = part["identical"]
    if same is None:
        return (
            f"{part['setting']}: each row answers with its own samples, so answers are not "
            "compared."
        )
    line = f"Greedy identical {same['equal']}/{same['checked']}"
    if same["equal"] == same["checked"]:
        return line + ": every answer of every row is token-identical to plain decoding."
    first = next(a for a in part["answers"] if a["identical"] is False)
    return (
        line + f": {same['checked'] - same['equal']} answer(s) differ from plain decoding "
        f"(first: {first['trace']} turn {first['turn']}, {first['row']})."
    )


def agent_loop_markdown(doc: dict, brief: bool = True) -> str:
    """The report as markdown: per setting the lossless line and the rows' table; `brief`
    False adds the machine and every answer."""
    h, c = doc["header"], doc["config"]
    lines = [
        f"# Agent-loop bench: {h.get('target', '?')} + {h.get('draft', '?')}",
        "",
        f"{h.get('cpu', '')}, {h.get('dtype', '')}, {h.get('date', '')}; "
        f"{len(c['traces_run'])} traces, {c['turns']} turns, up to {c['max_tokens']} new "
        f"tokens per answer, each answer the target's own.",
    ]
    if not brief:
        lines += ["", machine_line(h)]
    for part in doc["settings"]:
        lines += [
            "",
            f"## {part['setting']}",
            "",
            identical_line(part),
            "",
            "| row | block | decode tok/s | speedup | τ | drafter | copy | suffix | plain "
            "| tokens |" + (" identical |" if part["identical"] else ""),
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
            + (" ---: |" if part["identical"] else ""),
        ]
        for r in part["rows"]:
            w = r["won"]
            same = f" {r['identical']}/{r['checked']} |" if r["checked"] is not None else " — |"
            lines.append(
                f"| {r['label']} | {r['block']} | {r['decode_tps']:.1f} | {r['speedup']:.2f}× "
                f"| {r['tau']:.2f} | {w['drafter']} | {w['copy']} | {w['suffix']} "
                f"| {w['plain']} | {r['generation_tokens']} |" + (same if part["identical"] else "")
            )
        lines += [
            "",
            "decode tok/s: tokens after each answer's first ÷ their decode time, over every "
            "answer; drafter / copy / suffix / plain: the cycles each strategy won (a drafter "
            "block or tree, a copy of the request's own text, a draft from earlier answers, a "
            "plain target step).",
        ]
        if not brief:
            lines += ["", *answers_table(part)]
    return "\n".join(lines) + "\n"


def machine_line(h: dict) -> str:
    keys = ("machine", "os", "mlx", "device", "blas", "load_avg", "dflash_mac")
    return "; ".join(f"{k} {h[k]}" for k in keys if h.get(k) is not None)


def answers_table(part: dict) -> list[str]:
    """Every answer: trace, turn, prompt, the tokens the session reused, and the row's figures."""
    lines = [
        "| trace | turn | row | prompt | reused | tokens | tok/s | τ | drafter | copy | suffix "
        "| plain | identical |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    rank = {r["row"]: i for i, r in enumerate(part["rows"])}
    turn_at: dict[tuple, int] = {}
    for a in part["answers"]:
        turn_at.setdefault((a["trace"], a["turn"]), len(turn_at))
    # the rows of a turn in row order (they ran in rotated orders)
    ordered = sorted(
        part["answers"], key=lambda a: (turn_at[a["trace"], a["turn"]], rank[a["row"]])
    )
    for a in ordered:
        tps = a["decode_tokens"] / a["decode_time_s"] if a["decode_time_s"] > 0 else 0.0
        tau = a["committed"] / a["cycles"] if a["cycles"] else 0.0
        same = {None: "", True: "yes", False: "NO"}[a["identical"]]
        lines.append(
            f"| {a['trace']} | {a['turn']} | {a['row']} | {a['prompt_tokens']} "
            f"| {a['reused_tokens']} | {len(a['tokens'])} | {tps:.1f} | {tau:.2f} "
            f"| {a['drafter']} | {a['copy']} | {a['suffix']} | {a['plain']} | {same} |"
        )
    return lines


def differing(doc: dict) -> int:
    """Greedy answers that differ from plain decoding, over every setting."""
    return sum(
        p["identical"]["checked"] - p["identical"]["equal"]
        for p in doc["settings"]
        if p["identical"]
    )


def config_doc(doc: dict, path: Any, limit: int | None, block, setting: Setting) -> dict:
    """The report's config: what was replayed and how."""
    run = doc["traces"][:limit] if limit else doc["traces"]
    return {
        "suite": KIND,
        "traces": str(path) if path else "shipped",
        "limit": limit,
        "traces_run": [t["id"] for t in run],
        "turns": sum(len(t["turns"]) for t in run),
        "max_tokens": setting.max_tokens,
        "block_size": str(block),
        "tree_budget": "auto" if setting.tree is None else setting.tree,
        "use_eos": setting.use_eos,
        "reasoning": setting.reasoning,
        "rows": [asdict(m) for m in modes(block)],
    }
