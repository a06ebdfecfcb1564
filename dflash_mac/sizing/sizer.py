"""What the loops ask of a block-size controller: the interfaces that `BlockController`
(controller.py), `BatchBlockRule` (batch_rule.py) and the cost-curve measurement's scripted
sizes (calibrate.py) each implement. Typing only: the loops take any object of this shape.

- `BlockSizer`: one request's cycles (`engine/decode.py`). Each cycle the loop asks `choose()`
  for a `Decision` (a block size, a tree budget), runs it, and feeds it back with `update`;
  between the two it reads `last` (the tree budget, the reason it shows) and gives the cycle
  `copy_rates` to keep (what its copies got). `BlockController` and calibrate's
  `ScriptedSizes` implement it.
- `CopySizer`: a `BlockSizer` that also prices copies: how long a copy runs (`copy_length`)
  and whether a doubtful one rides on the cycle's tree (`graft_pays`), asked only when a cycle
  has a copy to verify (copy or suffix drafting: `GenerationConfig.copies`, `suffixes`); and
  a one-token step's seconds (`plain_step`), what a plain step's wait for its token on the
  host (a copy may follow it) is priced in. `BlockController` implements them,
  `ScriptedSizes` (whose measurement runs with copies off) does not.
- `BatchSizer`: the batch scheduler's (`batching/scheduler.py`). It is not a `BlockSizer`: a
  batch's cycle has one block size for all its rows, chosen for the number of rows and the room
  they have left (`choose(batch, room)` gives a size, not a `Decision`: no trees, no copies),
  and fed back with every row's acceptance at once (`update(batch, bs, seconds, accepted)`);
  a lone request's cycles, which the one-request loop runs, teach it their acceptance alone
  (`learn`). `BatchBlockRule` and calibrate's `TimedRule` implement it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..drafting.copies import CopyRates
from .controller import Decision


class BlockSizer(Protocol):
    """Each cycle's block size for one request (module docstring)."""

    last: Decision  # the latest choice: its tree budget and reason are read after `choose`
    copy_rates: CopyRates  # what the request's copies got, kept across its cycles

    def choose(self) -> Decision:
        """The next cycle: a plain step (size 1), a chain of some size or a tree of a budget."""
        ...

    def update(
        self,
        bs: int,
        accepted: int,
        seconds: float | None,
        steady: bool = True,
        tree: int = 0,
        chain: int = 0,
        odds: Sequence[float] = (),
        reach: int = 0,
    ) -> None:
        """A finished cycle at `bs` (a tree's: of budget `tree`) accepted `accepted` drafts
        (`chain`: what the chain of a tree's likeliest children accepted, `reach` how deep
        that chain went in the tree) in `seconds` (None:
        not timed); `steady`: timed amid cycles of its kind; `odds`: a sampled chain's
        acceptance probabilities (`acceptance.positions`), () where there are none."""
        ...


class CopySizer(BlockSizer, Protocol):
    """A `BlockSizer` that also prices copies (module docstring)."""

    def copy_length(self, longest: int, rate: float) -> int:
        """How many of a copy's `longest` tokens to propose (0: none), given `rate`."""
        ...

    def graft_pays(self, budget: int, copy: int, hit: float, zero: float) -> bool:
        """Whether a copy of `copy` tokens should ride on this cycle's tree of `budget` nodes."""
        ...

    def copied(self, width: int, seconds: float) -> None:
        """A copy cycle verifying `width` tokens took `seconds` (what `copy_length` prices)."""
        ...

    def plain_step(self) -> float | None:
        """A one-token step's seconds now (None: not timed yet): what a wait is priced in."""
        ...


class BatchSizer(Protocol):
    """One block size for each cycle of a batch (module docstring)."""

    bs_max: int  # the largest size it picks
    last_reason: str  # why it chose its last size (the rows' statistics show it)

    def choose(self, batch: int, room: int) -> int:
        """The block size of the next cycle of `batch` rows, at most `room`."""
        ...

    def update(
        self,
        batch: int,
        bs: int,
        seconds: float | None,
        accepted: list[int],
        odds: Sequence[Sequence[float]] = (),
    ) -> None:
        """A cycle of `batch` rows at `bs` took `seconds` (None: not a cycle of that shape);
        row i accepted `accepted[i]` drafts (`odds[i]`: a sampled row's acceptance odds)."""
        ...

    def learn(self, bs: int, accepted: list[int], odds: Sequence[Sequence[float]] = ()) -> None:
        """Acceptance alone, from cycles at `bs` the batch did not run (a lone request's)."""
        ...
