"""The coordinator's side: one persistent worker process per device, kept across prompts.

    WorkerPool(devices)        spawns one process per device (torch.multiprocessing, spawn), waits until each
                               joined the process group (gloo on CPUs, NCCL on GPUs; rendezvous through a file)
    pool.call(fn, *args)       puts the same job on every rank, waits for every answer, returns them in rank order
    pool.close()               asks the workers to stop, ends those that do not, frees the rendezvous file
    pool_for(devices)          the one pool this process keeps (a pool for other devices is closed first)
    close_pools()              ComfyUI's /free (through nodes/bridge.py) and the end of the process

The coordinator decides and the ranks act alike: it picks the model chain (`ensure_model`), and whether a run keeps
its cache; every rank then does the same with its share. Faults never leave a half-working pool behind:
- a worker that dies (its process ended) or hangs (no message for `hang_seconds`) ends the pool and raises
  `WorkerError` naming the device, the job and the last step; the next run starts a new pool;
- an error raised by every rank alike (bad input) leaves the pool as it is; one raised by some ranks only ends it
  (the others would wait in a collective);
- `check_interrupt()` (the host's interrupt check, polled while waiting) that raises sets the shared interrupt
  flag: the ranks agree on it after their current step (worker.py) and all stop there; the host's exception is
  then re-raised.
"""

import contextlib
import os
import queue
import runpy
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from . import worker
from .ranks import MAX_RANKS

_ROOT = Path(__file__).resolve().parents[2]  # the pack's folder
_PACKAGE = __name__.split(".")[0]  # the name the host imported the pack under (a worker registers the same)
_ENTRY = str(Path(__file__).with_name("spawn_entry.py"))
START_SECONDS = 300.0  # a worker that has not joined the group by then is reported as failed
GRACE_SECONDS = 20.0  # after one rank answered with an error or stopped: how long the others get to answer


@contextlib.contextmanager
def _main_script_hidden():
    """While the workers start: the host's `__main__` without its `__file__`. multiprocessing's spawn runs the parent's
    main script again in every child (as `__mp_main__`) when `__main__` has a file and no module spec: under ComfyUI
    that is its `main.py`, which sets up a server's worth of state there and fails outside ComfyUI's folder. The
    workers need nothing from it (spawn_entry.py brings the pack), so spawn is shown no script; restored at once.
    A main run as a module (`python -m ...`, the tests' pytest) is imported by name as usual."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = script


class WorkerError(RuntimeError):
    """A worker died, hung or failed alone; the pool was closed (the next run starts a new one)."""


class WorkerPool:
    """One worker process per device (rank i on `devices[i]`), alive until `close`. One device is a DiT of its own on
    another device than the host's (no split)."""

    def __init__(self, devices, threads: int | None = None, hang_seconds: float = 600.0):
        self.devices = tuple(devices)
        if not 1 <= len(self.devices) <= MAX_RANKS:  # the loader refuses more when it validates; this is the last gate
            raise ValueError(f"a worker pool runs on 1 to {MAX_RANKS} devices; got {len(self.devices)}.")
        self.hang_seconds = float(hang_seconds)
        if threads is None:  # CPU ranks share the cores; a GPU rank needs few
            threads = max(1, (os.cpu_count() or 1) // len(self.devices))
        self.model_key = None
        self.step = (0, 0)  # the last step every rank finished, of how many
        self._job = 0
        self._folder = tempfile.mkdtemp(prefix="qi21-ranks-")
        context = mp.get_context("spawn")
        self._interrupt = context.Event()
        self._results = context.Queue()
        self._jobs = [context.Queue() for _ in self.devices]
        self._processes = []
        try:
            with _main_script_hidden():
                self._start(context, threads)
            self._await_start()
        except BaseException:
            self.close()
            raise

    def _start(self, context, threads: int) -> None:
        for rank, device in enumerate(self.devices):
            arguments = dict(rank=rank, world=len(self.devices), device=device,
                             store_path=os.path.join(self._folder, "rendezvous"), jobs=self._jobs[rank],
                             results=self._results, interrupt=self._interrupt, threads=threads)
            process = context.Process(
                target=runpy.run_path, name=f"qi21-rank{rank}-{device}", daemon=True,
                kwargs=dict(path_name=_ENTRY, run_name="__qi21_worker__",
                            init_globals={"QI21_SPAWN": dict(package=_PACKAGE, root=str(_ROOT), arguments=arguments)}))
            process.start()
            self._processes.append(process)

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def _await_start(self) -> None:
        ready, deadline = set(), time.monotonic() + START_SECONDS
        while len(ready) < len(self.devices):
            try:
                message = self._results.get(timeout=0.2)
            except queue.Empty:
                self._raise_if_dead("starting")
                if time.monotonic() > deadline:
                    raise WorkerError(f"the workers on {self._names(set(range(len(self.devices))) - ready)} did not "
                                      f"start within {START_SECONDS:.0f} s.") from None
                continue
            if message[0] == "failed":
                raise WorkerError(f"the worker on {self.devices[message[1]]} could not start: {message[2]}")
            if message[0] == "ready":
                ready.add(message[1])

    def _names(self, ranks) -> str:
        return ", ".join(f"{self.devices[r]} (rank {r})" for r in sorted(ranks))

    def _where(self, what: str) -> str:
        done, total = self.step
        return f"{what} at step {done + 1} of {total}" if total else what

    def _raise_if_dead(self, what: str) -> None:
        dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
        if dead:
            codes = ", ".join(str(self._processes[r].exitcode) for r in dead)
            self.close()
            raise WorkerError(f"the Qwen-Image worker on {self._names(dead)} stopped (exit code {codes}) during "
                              f"{self._where(what)}; the workers were shut down and the next run starts new ones.")

    # -- jobs -------------------------------------------------------------------------------------------------
    def call(self, function, *args, what: str = "a job", check_interrupt=None, on_progress=None) -> list:
        """`function(rank_state, *args)` on every rank; their answers in rank order.

        `what` names the job in errors ("sampling"); `on_progress(step, total)` runs when every rank finished a
        step. Raises `WorkerError` (pool closed) for a dead, hung or lone failing worker, `RuntimeError` for an
        error every rank raised alike, and `check_interrupt`'s own exception once every rank stopped."""
        if not self.alive:
            self._raise_if_dead(what)
        self._job += 1
        job = self._job
        self._interrupt.clear()
        self.step = (0, 0)
        for jobs in self._jobs:
            jobs.put((job, function, args))
        answers, steps, interrupted = {}, {}, None
        last_message, first_answer = time.monotonic(), None
        while len(answers) < len(self.devices):
            try:
                message = self._results.get(timeout=0.1)
            except queue.Empty:
                message = None
            now = time.monotonic()
            if message is not None:
                last_message = now
                if message[0] == "progress" and message[1] == job:
                    _, _, rank, done, total = message
                    steps[rank] = (done, total)
                    if len(steps) == len(self.devices) and min(s[0] for s in steps.values()) > self.step[0]:
                        self.step = (min(s[0] for s in steps.values()), total)
                        if on_progress is not None:
                            on_progress(*self.step)
                elif message[0] == job:
                    answers[message[1]] = message[2:]
                    first_answer = first_answer or now
                if len(answers) == len(self.devices):
                    break
            self._raise_if_dead(what)
            if check_interrupt is not None and interrupted is None:
                try:
                    check_interrupt()
                except BaseException as stop:  # the host's interrupt: every rank stops after its current step
                    interrupted = stop
                    self._interrupt.set()
            waited = now - (first_answer or last_message)
            limit = GRACE_SECONDS if first_answer else self.hang_seconds
            if waited > limit:
                silent = set(range(len(self.devices))) - set(answers)
                self.close()
                raise WorkerError(f"the Qwen-Image worker on {self._names(silent)} did not answer for {limit:.0f} s "
                                  f"during {self._where(what)}; the workers were shut down and the next run starts "
                                  "new ones.")
        return self._outcome([answers[r] for r in range(len(self.devices))], what, interrupted)

    def _outcome(self, answers, what: str, interrupted):
        statuses = [status for status, _ in answers]
        if interrupted is not None and all(s in ("ok", "interrupted") for s in statuses):
            raise interrupted  # also when the ranks had finished: the host's cancel was taken from it, so it stands
        if all(s == "ok" for s in statuses):
            return [value for _, value in answers]
        errors = [(r, value) for r, (status, value) in enumerate(answers) if status != "ok"]
        if all(s == "error" for s in statuses) and len({v for _, v in answers}) == 1:
            raise RuntimeError(f"{what} failed on every device: {answers[0][1]}")
        self.close()  # ranks that disagree may be inside a collective with a lost peer
        detail = "; ".join(f"{self.devices[r]}: {value}" for r, value in errors)
        raise WorkerError(f"{self._where(what)} failed on some devices only ({detail}); the workers were shut down "
                          "and the next run starts new ones.")

    def ensure_model(self, key, build, args: tuple = (), mode: str = "ulysses") -> bool:
        """Have every rank hold the model chain `key` (`build(device, *args)`, built in the worker, split by `mode`);
        True if it was built."""
        key = (key, mode)
        if self.model_key == key:
            return False
        self.model_key = None
        self.call(worker.load_model, key, build, args, mode, what="loading the model")
        self.model_key = key
        return True

    def close(self) -> None:
        """Stop the workers (politely, then by force), free the rendezvous folder; safe to call twice."""
        for process, jobs in zip(self._processes, self._jobs):
            if process.is_alive():
                try:
                    jobs.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        self._processes = []
        self.model_key = None
        shutil.rmtree(self._folder, ignore_errors=True)


_pool: WorkerPool | None = None


def pool_for(devices, **options) -> WorkerPool:
    """The kept pool for `devices` (started when there is none, when it died, or when it runs on other devices: a
    device serves one pool)."""
    global _pool
    devices = tuple(devices)
    if _pool is not None and (_pool.devices != devices or not _pool.alive):
        close_pools()
    if _pool is None:
        _pool = WorkerPool(devices, **options)
    return _pool


def current_pool() -> WorkerPool | None:
    return _pool


def close_pools() -> None:
    """End the workers (ComfyUI's /free, unloading models); the next parallel run starts new ones."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()
