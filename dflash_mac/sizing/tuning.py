"""What `--block-size auto` keeps about one pair between requests (`AutoTuning`): the saved cost
curves, the remembered acceptance, and the cost models and controllers that requests continue.
Front ends load and save it (files.py). Pure Python (no MLX)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..drafting.copies import CopyRates
from ..drafting.suffix import SuffixMemory
from .controller import BlockController
from .cost import CostCurve, CostModel


@dataclass
class AutoTuning:
    """What `--block-size auto` knows and learns about one pair on this machine: the saved cost
    curves (the prior; None: the generic guess), the acceptance earlier processes remembered
    by setting, and the cost models and controllers that requests continue.

    Owned by whoever serves the requests (a session, the bench, a command) and passed to the
    stream; front ends load and save it (`files.load_tuning`, `files.save_acceptance`).
    Greedy and sampled requests keep apart cost models: a sampled cycle draws its drafts and
    verifies by rejection, so greedy timings would make sampled drafting look cheaper than it
    is. Requests with the same sampling setting and context band (short, or from 1,024, 2,048,
    4,096, ... tokens) continue one controller: a chat at T = 0.7 does not relearn each turn
    that drafting does not pay, and long prompts, where drafters trained on short ones accept
    less, do not spoil short ones. The bands keep apart cost models too: at a long context a
    plain step costs more and a wide verify more of them than the curve (measured at a short
    one) says, so there the prior is the curve guessed at the band's middle
    (`CostCurve.at_context`) and the one-token step is timed afresh. `guess`: the acceptance
    per position a new controller starts from (the registry's `acceptance_guess`: what the
    drafter accepts on average, measured; None: the generic, optimistic guess)."""

    greedy_curve: CostCurve | None = None
    sampled_curve: CostCurve | None = None
    remembered: dict = field(default_factory=dict)  # Acceptance.state() by controller memory
    long_from: int = 1024  # context tokens from which a request counts as long
    loses_from: int | None = None  # context tokens from which the drafter is known to lose
    guess: float | None = None  # the drafter's measured acceptance (None: the generic guess)
    cost_models: dict[tuple[bool, int], CostModel] = field(default_factory=dict)  # (sampled, band)
    controllers: dict[tuple, BlockController] = field(default_factory=dict)
    # earlier answers, for suffix drafting (drafting/suffix.py): what the session's requests said
    answers: SuffixMemory = field(default_factory=SuffixMemory)

    @property
    def batch_prior(self) -> dict[tuple[int, int], float]:
        """Batched cycles' costs by (B rows, bs) from the saved greedy curve (none: timed)."""
        return self.greedy_curve.batches if self.greedy_curve else {}

    def band(self, context_tokens: int) -> int:
        """A context's band: 0 short, else the power of two it starts at (from `long_from`:
        1,024, 2,048, 4,096, ...), each with its own cost model and controllers."""
        if context_tokens < self.long_from:
            return 0
        band = self.long_from
        while band * 2 <= context_tokens:
            band *= 2
        return band

    def prior(self, bs_max: int, sampled: bool, band: int = 0) -> CostCurve:
        """The cost curve requests start from; in a long band, the curve guessed at its middle
        (`CostCurve.at_context`; class docstring)."""
        curve = self.sampled_curve if sampled else self.greedy_curve
        if curve is None:
            curve = CostCurve.generic(bs_max)
        return curve.at_context(round(band * 1.41)) if band else curve

    def controller(
        self,
        bs_max: int,
        setting: tuple = (),
        context_tokens: int = 0,
        sampled: bool = False,
        timed: bool = True,
        trees: tuple[int, ...] = (),
        chains: bool = True,
    ) -> BlockController:
        """The controller of a request, up to `bs_max`. Where the drafter is known to lose on
        long contexts, a long request starts with plain decoding and drafts only when its
        probes pay. A new controller starts from the remembered acceptance of its setting where
        that is better than the guess, and in a long band whatever it is (`start_from`).
        `timed=False` (seeded sampling): a fresh controller on the prior alone, so the sizes,
        and with them the random draws, depend only on the seed and the text."""
        band = self.band(context_tokens)
        loses = self.loses_from is not None and context_tokens >= self.loses_from
        key = (bs_max, setting, band, loses, trees, chains)
        if timed and key in self.controllers:
            return self.controllers[key]
        prior = self.prior(bs_max, sampled, band)
        if timed:
            model = self.cost_models.setdefault((sampled, band), CostModel(prior))
        else:
            model = CostModel(prior)
        # sampled requests keep a light guess: they mostly meet poorer acceptance, where a heavy
        # one only delays the fallback (the guess is what saves greedy starts); a drafter's own
        # measured acceptance is light too: it is what the average prompt gives, not a hope
        heavy = not sampled and self.guess is None
        controller = BlockController(
            bs_max,
            model,
            timed=timed,
            plain_first=loses,
            guess_weight=BlockController.GUESS_WEIGHT if heavy else 1.0,
            guess=BlockController.GUESS if self.guess is None else self.guess,
            trees=trees,
            chains=chains,
        )
        if timed:
            if not loses:  # known-losing contexts keep their pessimistic start, unremembered
                controller.memory = json.dumps([bs_max, list(setting), band > 0])
                memory = self.remembered.get(controller.memory)
                controller.start_from(memory, lower=band > 0)
                if isinstance(memory, dict):  # what copies and trees got then
                    controller.copy_rates = CopyRates.read(memory.get("copy"))
                    controller.tree_acc.restore(memory.get("trees"))
            self.controllers[key] = controller
        return controller

    def acceptance(self) -> dict:
        """What to remember between processes: each kept controller's acceptance, copy rates
        and tree gains by setting."""
        return {
            c.memory: c.acc.state() | {"copy": c.copy_rates.state(), "trees": c.tree_acc.state()}
            for c in self.controllers.values()
            if c.memory
        }
