"""What a request asks for (`GenerationConfig`) and what each step of its stream gives back
(`GenerationEvent`), alike alone (decode.py) and in a batch (batching/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.penalties import Penalties
from ..sizing.choice import BlockChoice
from .constraints import Grammar
from .stats import DecodeStats
from .verify import SamplingParams, TokenLogprob


@dataclass
class GenerationConfig:
    """Per-request settings."""

    max_tokens: int = 256
    block: BlockChoice | None = None  # None: `auto` up to the pair's default size
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    use_eos: bool = True
    prefill_step_size: int = 2048
    pipeline: bool = True  # queue the next drafter pass before the host bookkeeping
    penalties: Penalties | None = None  # None: no penalties, no cost
    logprobs: int | None = None  # None: none; k: each committed token's and the top k
    grammar: Grammar | None = None  # structured output (constraints.py); None: free text
    # copy drafting where the last tokens repeat earlier text (drafting/copies.py); None: on, but
    # not at a fixed block of 1, which is plain decoding (True there: copies only)
    copy: bool | None = None
    tree: int | None = None  # tree drafting (drafting/tree.py): None `auto`, 0 chains only, N nodes
    # suffix drafting from earlier answers (drafting/suffix.py, `AutoTuning.answers`); None:
    # wherever copies run
    suffix: bool | None = None

    @property
    def copies(self) -> bool:
        """Copy drafting runs: asked for, or by default unless the blocks are plain decoding."""
        if self.copy is not None:
            return self.copy
        return not (self.block is not None and self.block.plain)

    @property
    def suffixes(self) -> bool:
        """Suffix drafting from earlier answers runs: asked for, or wherever copies run; never
        for a seeded sampled request, whose random draws would then follow what earlier
        requests answered (same seed, same text)."""
        if self.seed is not None and not self.sampling.greedy:
            return False
        return self.copies if self.suffix is None else self.suffix


@dataclass
class GenerationEvent:
    """What one step of the stream committed."""

    text: str
    tokens: list[int]
    accepted: int  # tokens committed by this cycle incl. the bonus (0 for the prefill token)
    stats: DecodeStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in `tokens`, when asked
    stop: str | None = None  # the stop string that ended the text (finish_reason "stop")
