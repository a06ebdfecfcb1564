"""Feature stores built in several processes on a CPU, one store (data file) per task.

MLX runs elementwise work (the attention softmax, SiLU) on one CPU thread, so one process
building stores leaves a core idle for much of each forward; two processes with one BLAS
thread each keep both busy (a fresh two-core machine rebuilds the SmolLM2 stores ~1.4x
faster). Each worker loads its own target once. A store is as a single process builds it
(`FeatureStore.open_or_build`), so a later run opens it, and an interrupted one resumes.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from .data import Sequence
from .features import FeatureStore
from .soft import LossSpec

POLL_SECONDS = 30.0  # how often the parent reports the workers' progress

_target = None  # a worker process's target, loaded once by `_start` (the pool's initializer)
_parent = 0  # ... and its parent's pid: a worker whose parent was killed stops


def _start(load: Callable, target_dir: Path) -> None:
    global _target, _parent
    _target, _parent = load(target_dir)[0], os.getppid()


def _orphaned(done: int, total: int) -> None:
    """A worker whose parent died exits at the chunk just written (a rerun resumes there);
    an exception would only go back to the dead pool."""
    if os.getppid() != _parent:
        os._exit(1)


def _build(layer_ids: list[int], seqs: list[Sequence], file: Path, max_length: int, spec) -> None:
    FeatureStore.open_or_build(_target, layer_ids, seqs, file, max_length, spec, _orphaned)


@contextmanager
def one_blas_thread():
    """Workers spawned inside inherit one BLAS thread each (the cores go to the processes)."""
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    old = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "1" for n in names})
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def build_in_workers(
    load: Callable,
    target_dir: Path,
    parts: list[tuple[list[Sequence], Path]],
    layer_ids: list[int],
    max_length: int,
    spec: LossSpec,
    workers: int,
    log: Callable[[str], None],
) -> None:
    """Build the unfinished stores of `parts` ((sequences, data file) each) in `workers`
    processes, largest first; `load(target_dir)` gives a worker its (target, tokenizer)."""
    folders = [FeatureStore.folder_of(f, layer_ids, max_length, spec) for _, f in parts]
    todo = [(seqs, f) for (seqs, f), d in zip(parts, folders) if FeatureStore.done(d) < len(seqs)]
    if not todo:
        return
    todo.sort(key=lambda p: -sum(min(len(q.ids), max_length) for q in p[0]))
    total = sum(len(seqs) for seqs, _ in parts)
    t0 = time.perf_counter()
    with (
        one_blas_thread(),
        ProcessPoolExecutor(
            max_workers=min(workers, len(todo)),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start,
            initargs=(load, target_dir),
        ) as pool,
    ):
        pending = {pool.submit(_build, layer_ids, s, f, max_length, spec) for s, f in todo}
        while pending:
            finished, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            for fut in finished:
                fut.result()  # a worker's error stops the build here
            done = sum(min(FeatureStore.done(d), len(s)) for d, (s, _) in zip(folders, parts))
            log(
                f"target features: {done}/{total} sequences in {min(workers, len(todo))} "
                f"processes ({time.perf_counter() - t0:.0f} s)"
            )
