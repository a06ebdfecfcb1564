"""Console-script entry point: Ctrl-C while the CLI starts up exits 130 with one line."""

from __future__ import annotations

import os
import signal
import sys

from .errors import INTERRUPTED


def _interrupted(signum: int, frame: object) -> None:
    sys.stderr.write(INTERRUPTED + "\n")
    sys.stderr.flush()
    os._exit(130)


def main() -> None:
    """Run `dflash-mac`; until the CLI's own handling takes over (cli.main), SIGINT ends the
    process at once with one line instead of a traceback from inside an import."""
    signal.signal(signal.SIGINT, _interrupted)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked across a re-exec
    from .cli import main as cli_main

    cli_main()
