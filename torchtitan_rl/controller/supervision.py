"""Process deaths become one clear ActorFailure instead of a hang or a crash of the client.

Monarch 0.7 reports a dead actor or proc to its owner as a `MeshFailure` (about 10 s after
the process exits, on a Monarch thread). The owner here is the controller's root client,
whose default `monarch.actor.unhandled_fault_hook` exits the process by interrupting the
main thread mid-await. `Supervisor` replaces that hook while a run is live: it records the
failure and wakes the controller, and `watch` turns either signal (the failure report, or
the `SupervisionError` an awaited endpoint call raises) into

    ActorFailure("generator failed during RL step 3 (rank 0): the process this actor
                  was running on failed: Killed(sig=9)")

On several hosts (controller/hosts.py) the line names the host, and a host that dies whole
surfaces once it has been silent for launcher.host_timeout_s:

    ActorFailure("generator failed during RL step 2 (rank 0 on host generator_0): its host
                  stopped answering (stopped: no status received from process)")
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import monarch.actor

# SupervisionError is not re-exported by monarch.actor in 0.7; an endpoint call whose
# actor died raises it.
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from torchtitan_rl.actors.fault_log import fault_log_path
from torchtitan_rl.weight_sync.broadcast import BroadcastBroken

T = TypeVar("T")
logger = logging.getLogger(__name__)

PEER_REPORT_WAIT_S = 30.0
"""After a collective broke (`BroadcastBroken`), how long to wait for Monarch's report of the
process that died: ~10 s for a process, launcher.host_timeout_s + ~9 s for a whole host."""

NAMED_REPORT_WAIT_S = 15.0
"""When the first report of a death names none of our actors (Monarch's own per-process
actors, e.g. its logger, can report the same death first), how long to wait for the report
that names ours."""

SETTLE_S = 12.0
"""At close, how long the run waits for Monarch's reports of deaths it survived but had not
seen reported yet (`settle`); a report comes ~10 s after the death."""
SETTLE_MARGIN_S = 1.0
"""After those reports, how long for the reports of Monarch's own actors on the same
processes, which name none of ours."""

SURVIVED_ECHO_S = 60.0
"""After a death the run survives, how long reports naming none of ours are taken for that
process's (Monarch's own actors on it, or its mesh being stopped, report it again later); a
death of ours in that time still names ours and ends the run."""

FAILURE_GRACE_S = 2.0
"""After a failure report, how long the awaited call gets to raise its own (more precise)
SupervisionError before the controller cancels it."""

_MESH_POINT = re.compile(r"(\w+)(?:-\w+)?\{((?:'\w+': \d+/\d+(?:, )?)+)\}")
"""An actor in a report: `generator{'procs': 0/1}` (the name given to spawn, a point of
its mesh), `trainer{'hosts': 1/2, 'procs': 0/1}` on a mesh over several hosts, or
`logger-tTVtQ3vHas1{'gpus': 1/2}` for Monarch's own per-proc actors."""
HOST_SILENT = "no status received from process"
"""How Monarch reports an actor whose whole host went silent (killed, powered off, cut off)."""
_COORD = re.compile(r"'\w+': (\d+)/(\d+)")


_QUERIED = re.compile(r'querying for "(\w+?)-\w+"')
"""An actor mesh a failed call was waiting on: `... while querying for "generator-AFvLhU7V2c2".
The process likely crashed` (the name given to spawn, then Monarch's suffix; no rank)."""


def _actors(report: str) -> list[tuple[str, int | None]]:
    """(name, flat rank) of every actor a report names; the rank is row-major over the
    mesh's dimensions (hosts, then processes per host), as `current_rank().rank`, or None
    where the report names the actor's mesh only."""
    found: list[tuple[str, int | None]] = []
    for name, point in _MESH_POINT.findall(report):
        rank = 0
        for index, size in _COORD.findall(point):
            rank = rank * int(size) + int(index)
        found.append((name, rank))
    return found + [(name, None) for name in _QUERIED.findall(report)]


_RUN_OF_MESH: dict[str, int] = {}
"""Monarch's name of every actor mesh a run of this process spawned ("generator-fbMY4eh854b")
-> that run's `Supervisor.run`. A mesh stopped at a run's close while its actor was still
starting reports "cleanup error: deadline has elapsed" seconds later; with several runs in
one process (tests, benches) that report reaches the next run, and named its replicas
(generator, generator_r1) as this run's."""
_RUNS = itertools.count()


def after_run_report(failure) -> None:
    """Monarch's fault hook between runs: a process of a closed run reporting its end late.
    The run already said what failed; the report goes to the debug log."""
    lines = failure.report().strip().splitlines()
    logger.debug("a process of a closed run reported late: %s", lines[-1] if lines else "")


class ActorFailure(RuntimeError):
    """A trainer or generator actor died or failed to start; the message is the one line
    shown to the user. `actor` is the name of ours it names (None: the report named none)."""

    def __init__(self, line: str, actor: str | None = None):
        super().__init__(line)
        self.actor = actor


def _our_actor(report: str, names: tuple[str, ...]) -> tuple[str, int | None] | None:
    """(name, rank) of the first actor the report names that is one of `names`."""
    return next(((n, r) for n, r in _actors(report) if n in names), None)


def describe_failure(
    report: str, names: tuple[str, ...], where: str, hosts: dict[str, list[str]] | None = None
) -> str:
    """One line naming the actor (one of `names`, the names its mesh was spawned under),
    its rank and, when `hosts` ({name: host of each rank}) knows it, its host; the stage of
    the run and the reason."""
    role, rank = _our_actor(report, names) or ("an actor", None)
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    reason = lines[-1] if lines else "no reason given"
    reason = reason.removeprefix("actor explicitly aborted due to: ")
    if reason.endswith(HOST_SILENT):
        reason = f"its host stopped answering ({reason})"
    rank_text = ""
    if rank is not None:
        host = (hosts or {}).get(role, [])
        on = f" on host {host[rank]}" if rank < len(host) else ""
        rank_text = f" (rank {rank}{on})"
    return f"{role} failed {where}{rank_text}: {reason}"


class Supervisor:
    """Installed for the duration of a run; `names` are the actor names given to
    `ProcMesh.spawn` (e.g. ("trainer", "generator")), used to name the one that died."""

    def __init__(self, names: tuple[str, ...], log_dir: Path | None = None):
        self.names = names
        self.log_dir = log_dir
        """Where actors leave their stacks when a signal kills them (actors/fault_log.py)."""
        self.reports: list[str] = []
        self.hosts: dict[str, list[str]] = {}
        """{actor name: host of each rank}, when the meshes span several hosts."""
        self.where = "at start-up"
        self.survive: Callable[[str], bool] | None = None
        """Asked on the event loop with the name of an actor of ours that died: True when the
        run carries on without it (a generator replica the fleet restarts,
        controller/fleet.py); its report, and the reports naming none of ours that came with
        it, are then set aside in `survived`."""
        self.survived: list[str] = []
        self._survived_at = -float("inf")
        self._unreported: set[str] = set()
        """Actors of ours the run survived the death of, whose report has not come yet."""
        self.fatal: ActorFailure | None = None
        """Set by `stop_run`: the line a run that cannot go on ends with."""
        self.run = next(_RUNS)
        """This run's number in this process (`own`)."""
        self._owning: set[asyncio.Task] = set()
        self._failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous_hook = None

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._previous_hook = monarch.actor.unhandled_fault_hook
        monarch.actor.unhandled_fault_hook = self._on_failure

    def own(self, actor) -> None:
        """`actor` (a mesh just spawned) is this run's: a report of another run's mesh is
        that run's, handed to `after_run_report` (its name resolves in ~0.3 s, also while the
        actor is still starting)."""

        async def record():
            try:
                _RUN_OF_MESH[await actor._name] = self.run
            except Exception as e:  # a mesh that did not spawn: its report is ours by name
                logger.debug("no mesh name for %r: %s", actor, e)

        task = asyncio.get_running_loop().create_task(record())
        self._owning.add(task)
        task.add_done_callback(self._owning.discard)

    async def settle(self) -> None:
        """Before the run closes: wait up to SETTLE_S for the reports of deaths it survived
        but heard of first (a process seen gone, a call that failed), and SETTLE_MARGIN_S
        more for Monarch's own actors' reports of them. Else they come after the close and,
        with another run in this process (tests, benches), reach that run and end it. Only
        actors of a mesh Monarch named for this run (`own`): of another (a fake in tests)
        Monarch reports nothing."""
        owned = list(_RUN_OF_MESH.items())  # one step: `own` may write it meanwhile
        spawned = {mesh.rsplit("-", 1)[0] for mesh, run in owned if run == self.run}
        self._unreported &= spawned
        if not self._unreported:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while self._unreported and loop.time() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(SETTLE_MARGIN_S)

    def uninstall(self) -> None:
        """Hand reports to `after_run_report`, not back to Monarch's default hook: a stopped
        process's report can arrive seconds after the run closed (a dead process's per-proc
        actors report ~10 s after it), and the default hook would interrupt whatever this
        process does by then."""
        for task in self._owning:
            task.cancel()
        if self._previous_hook is not None:
            monarch.actor.unhandled_fault_hook = after_run_report
            self._previous_hook = None

    def _on_failure(self, failure) -> None:
        """Runs on a Monarch thread; returning normally marks the failure handled."""
        if _RUN_OF_MESH.get(getattr(failure, "mesh_name", None), self.run) != self.run:
            after_run_report(failure)  # a mesh of an earlier run of this process
            return
        report = failure.report()
        assert self._loop is not None
        if self._loop.is_closed():  # a late report after the run ended needs no wake-up
            self.reports.append(report)
        else:  # sorted on the loop, so the watch never sees a report not sorted yet
            self._loop.call_soon_threadsafe(self._sort, report)

    def _sort(self, report: str) -> None:
        """On the event loop: a report of a death the run survives is set aside, with the
        reports naming none of ours so far (Monarch's own actors on the same process);
        either way the watch wakes to look."""
        self.reports.append(report)
        ours = _our_actor(report, self.names)
        now = self._loop.time()
        if ours is not None:
            if self.survive is not None and self.survive(ours[0]):
                self.survived_death()
                self._set_aside(report)
            self._unreported.discard(ours[0])
        elif now - self._survived_at <= SURVIVED_ECHO_S:
            self._set_aside(report)
        self._failed.set()

    def survived_death(self, name: str | None = None) -> None:
        """A process the run survives died (told by `survive`, or by the fleet when a call
        on it failed first): the reports naming none of ours so far, and those of the next
        SURVIVED_ECHO_S, are taken for its own. `name`: the actor of ours that died, heard
        of before its report (`settle` waits for that report)."""
        if name is not None:
            self._unreported.add(name)
        self._survived_at = asyncio.get_running_loop().time()
        self._set_aside(None)
        self._failed.set()

    def _set_aside(self, report: str | None) -> None:
        """Move `report` and every report naming none of ours to `survived`."""
        aside = [r for r in self.reports if r is report or _our_actor(r, self.names) is None]
        self.survived.extend(aside)
        self.reports = [r for r in self.reports if not any(r is a for a in aside)]

    def stop_run(self, line: str) -> None:
        """End the run with `line` (e.g. every generator replica down for too long)."""
        self.fatal = ActorFailure(line)
        self._failed.set()

    def _named_reports(self) -> list[str]:
        return [r for r in self.reports if _our_actor(r, self.names) is not None]

    def failure(self) -> ActorFailure | None:
        """The recorded failure (the report naming a known actor first), if any."""
        if not self.reports:
            return None
        return self._failure((self._named_reports() or self.reports)[0])

    async def _wait_for_named_report(self, timeout: float, *, reported: bool = True) -> None:
        """Until a report names one of `names` (Monarch's own per-process actors, e.g. its
        logger, may report the same death first), or `timeout` seconds. `reported`: a report
        came already, so the wait also ends once every report was set aside as survived."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._named_reports() and loop.time() < deadline:
            if reported and not self.reports:
                break
            self._failed.clear()  # set again by the next report
            if self._named_reports():
                break
            try:
                await asyncio.wait_for(self._failed.wait(), deadline - loop.time())
            except TimeoutError:
                break

    async def _named_failure(self) -> ActorFailure | None:
        """The failure a report naming one of ours describes, waiting up to
        NAMED_REPORT_WAIT_S for that report; None if none came."""
        if not self._named_reports():
            await self._wait_for_named_report(NAMED_REPORT_WAIT_S)
        return self.failure() if self._named_reports() else None

    def _failure(self, report: str) -> ActorFailure:
        """The one line, plus the dead process's Python stacks file when it wrote one."""
        line = describe_failure(report, self.names, self.where, self.hosts)
        name, rank = _our_actor(report, self.names) or (None, 0)
        if name is not None and self.log_dir is not None:
            path = fault_log_path(self.log_dir, name, rank or 0)
            if path.is_file() and path.stat().st_size:
                line += f"; its Python stacks at death: {path}"
        return ActorFailure(line, name)

    def translate(self, error: BaseException) -> BaseException:
        """A dead actor's SupervisionError (or an ActorError wrapping one) as ActorFailure;
        anything else unchanged."""
        if isinstance(error, ActorError) and isinstance(error.exception, SupervisionError):
            error = error.exception
        if isinstance(error, SupervisionError):
            return self._failure(str(error))
        return error

    async def watch(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, but end with ActorFailure soon after any process dies: within
        FAILURE_GRACE_S of the report naming the dead actor, or NAMED_REPORT_WAIT_S after a
        report that names none of ours when no report naming ours follows. A death the run
        survives (`survive`) wakes it only to look."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                failed = asyncio.ensure_future(self._failed.wait())
                try:
                    done, _ = await asyncio.wait(
                        {task, failed}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    failed.cancel()
                if task not in done and self.fatal is None and not self.reports:
                    self._failed.clear()  # every report so far was of a survived death
                    continue
                if task not in done and self.fatal is None:
                    # give the call a moment to fail with its own message
                    await asyncio.wait({task}, timeout=FAILURE_GRACE_S)
                if task.done():
                    return await self._result(task)
                if self.fatal is not None:
                    raise self.fatal
                failure = await self._named_failure()
                if failure is None and not self.reports:
                    self._failed.clear()  # the report that names ours said it is survived
                    continue
                raise failure or self.failure()
        finally:
            if not task.done():
                task.cancel()

    async def _result(self, task: asyncio.Future) -> T:
        """The finished task's result, or its error as ActorFailure when it was a death."""
        error = None if task.cancelled() else task.exception()
        if isinstance(error, BroadcastBroken) and not getattr(error, "reports_awaited", False):
            await self._wait_for_named_report(PEER_REPORT_WAIT_S, reported=False)
        if isinstance(error, BroadcastBroken) and self.reports:
            raise self.failure() from error  # the death that broke it, named
        if error is not None:
            translated = self.translate(error)
            if translated is error:
                raise error
            if isinstance(translated, ActorFailure) and translated.actor is None:
                # Monarch's own actors on that process may speak first; ours follows
                translated = await self._named_failure() or translated
            raise translated from error
        if self.fatal is not None:
            raise self.fatal
        if self.reports:  # a death not survived came while it finished (it may have gone on
            # past it: a validation scores its lost rollouts): it ends the run all the same
            failure = await self._named_failure()
            if failure is not None or self.reports:
                raise failure or self.failure()
        return task.result()
