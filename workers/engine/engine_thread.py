"""The one thread that touches an `LLMEngine`, and the command queue that feeds it.

`AsyncEngine` (the caller side) owns one. Callers queue commands (`Add`, `Abort`,
`Call`: commands.py) under this object's lock; the thread runs them between steps, sends
each step's outputs to their streams' event loops, and sleeps while the engine has
nothing to compute (waking on commands, and every `_TIMER_POLL_S` while handoffs are
held or imports wait). If anything escapes, it fails every request and never touches
the engine again (async_engine.py's failure policy).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from workers.engine.commands import (
    Abort,
    Add,
    Call,
    Stream,
    abort_output,
    call_soon,
    deliver,
    fail,
    fail_all,
    resolve,
)
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.thread_policy import run_as_engine_thread
from workers.errors import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

# While the engine has nothing to compute but held handoffs wait for their deadline or
# imports wait for blocks, the engine thread re-checks this often instead of spinning.
_TIMER_POLL_S = 0.5


class EngineThread:
    def __init__(self, engine: LLMEngine, max_pending_requests: int | None):
        """Starts the thread. Beyond `max_pending_requests` requests accepted but not yet
        running (None: unbounded), `check_room` raises EngineOverloadedError."""
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self._cond = threading.Condition()
        # Everything below is guarded by _cond.
        self._commands: list[Add | Abort | Call] = []
        self._commands_running: list[Add | Abort | Call] = []
        self._num_queued_adds = 0  # adds not yet reflected in _stats.num_waiting
        self._stats = engine.stats()  # safe: the thread does not exist yet
        self._stopping = False
        self._engine_shut_down = False
        self._error: EngineDeadError | None = None
        # Touched by the engine thread only.
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    # -- the caller side (any thread) ----------------------------------------

    def add(self, command: Add) -> None:
        """Queues a request; EngineDeadError or EngineOverloadedError if it may not."""
        with self._cond:
            self._check_room()
            self._num_queued_adds += 1
            self._commands.append(command)
            self._cond.notify()

    def call(self, command: Call) -> None:
        """Queues a call; EngineDeadError once the engine is dead or shut down."""
        with self._cond:
            self._check_alive()
            self._commands.append(command)
            self._cond.notify()

    def abort(self, command: Abort) -> bool:
        """Queues an abort (never raises); False when nothing is live any more, or the
        shutdown under way aborts it anyway."""
        with self._cond:
            if self._error is not None or self._stopping:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    def check_room(self) -> None:
        """EngineDeadError or EngineOverloadedError unless a new request may queue."""
        with self._cond:
            self._check_room()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step or command batch (never blocks on a step)."""
        with self._cond:
            return self._stats

    def is_alive(self) -> bool:
        """True until the thread failed, stopped or was asked to stop."""
        with self._cond:
            return self._error is None and not self._stopping and self._thread.is_alive()

    def request_stop(self) -> None:
        """Asks the thread to abort every request and stop, without waiting."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self) -> bool:
        """Waits for the thread to stop (up to one step after `request_stop`). True for the
        first caller only, who then shuts the engine down."""
        self._thread.join()
        with self._cond:
            first, self._engine_shut_down = not self._engine_shut_down, True
        return first

    def _check_room(self) -> None:
        self._check_alive()
        limit = self.max_pending_requests
        if limit is not None and self._stats.num_waiting + self._num_queued_adds >= limit:
            raise EngineOverloadedError(
                f"{limit} requests are already waiting for this engine; retry later"
            )

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(str(self._error)) from self._error.__cause__
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    # -- the engine thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            run_as_engine_thread()
            self.engine.use_thread()
            while True:
                # The engine's work only changes on this thread, so one look before
                # sleeping is enough; commands and shutdown notify to wake it.
                engine = self.engine
                idle = not engine.needs_step()
                timers = engine.has_timers()
                with self._cond:
                    if idle:
                        self._cond.wait_for(
                            lambda: self._commands or self._stopping,
                            timeout=_TIMER_POLL_S if timers else None,
                        )
                    commands, self._commands = self._commands, []
                    # Kept until run: if running them fails midway, _die must still
                    # answer the ones after the failure.
                    self._commands_running = commands
                    stopping = self._stopping
                num_adds = self._execute(commands)
                # Not kept while idle: a command's closure or reply may hold an export.
                self._commands_running = commands = []
                if stopping:
                    self._abort_all()
                    self._publish_stats(num_adds)
                    return
                if engine.has_unfinished() or engine.has_timers():
                    # Expires handoffs and admits imports, whose first tokens go out now.
                    self._dispatch(engine.ready_outputs())
                    self._dispatch(engine.step())
                self._publish_stats(num_adds)
        except BaseException as exc:  # anything escaping here leaves the engine unusable
            logger.exception("engine thread failed; failing every request")
            self._die(exc)

    def _execute(self, commands: list[Add | Abort | Call]) -> int:
        num_adds = 0
        for command in commands:
            if isinstance(command, Add):
                num_adds += 1
                self._add(command)
            elif isinstance(command, Call):
                self._call(command)
            else:
                self._abort(command)
        return num_adds

    def _call(self, command: Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:  # the caller's error (e.g. ValueError), not the engine's
            call_soon(command.reply_loop, fail, command.reply, exc)
            return
        call_soon(command.reply_loop, resolve, command.reply, result)

    def _add(self, command: Add) -> None:
        stream = command.stream
        try:
            command.submit(self.engine)
        except Exception as exc:  # refused before any engine state changed: only it fails
            self._send({stream.loop: [(stream, exc)]})
            return
        self._streams[stream.request_id] = stream

    def _abort(self, command: Abort) -> None:
        rid = command.request_id
        live = self._streams.get(rid)
        aborted = False
        if command.stream is None or live is command.stream:
            aborted = self.engine.abort(rid)
            self._streams.pop(rid, None)
            if live is not None and command.stream is None:
                # The consumer is still reading: tell it how its request ended.
                self._send({live.loop: [(live, abort_output(live))]})
        elif live is None and command.stream.handoff is not None:
            # The request finished before its consumer left, but a prefill-only one still
            # holds its handoff, which nobody will export now: free it at once rather
            # than at its deadline. Its own handoff only: a stream the engine refused (an
            # id in use) must not free the handoff of the request holding that id.
            aborted = self.engine.release_handoff(rid, command.stream.handoff)
        if command.reply is not None and command.reply_loop is not None:
            call_soon(command.reply_loop, resolve, command.reply, aborted)

    def _abort_all(self) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, stream in self._streams.items():
            self.engine.abort(rid)
            batches.setdefault(stream.loop, []).append((stream, abort_output(stream)))
        self._streams.clear()
        self._send(batches)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # its consumer left; the abort is queued behind this step
            stream.num_output_tokens = out.num_output_tokens
            stream.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                del self._streams[out.request_id]
                stream.handoff = out.handoff
            batches.setdefault(stream.loop, []).append((stream, out))
        self._send(batches)

    def _send(self, batches: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in batches.items():
            if not call_soon(loop, deliver, items):
                # The consumer's loop is gone: nobody will read these, so stop computing them.
                for stream, _ in items:
                    if self._streams.get(stream.request_id) is stream:
                        del self._streams[stream.request_id]
                        self.engine.abort(stream.request_id)

    def _publish_stats(self, num_adds: int) -> None:
        stats = self.engine.stats()
        with self._cond:
            self._stats = stats
            self._num_queued_adds -= num_adds

    def _die(self, exc: BaseException) -> None:
        error = EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self._cond:
            self._error = error
            queued, self._commands = self._commands_running + self._commands, []
            self._commands_running = []
        streams, self._streams = list(self._streams.values()), {}
        fail_all(streams, queued, error)
