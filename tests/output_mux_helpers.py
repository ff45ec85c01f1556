"""test_output_mux.py's stand-ins for Serve and the engine: calls played in one event
loop, each "remote call" a task of its own, cancelled as Serve cancels one; an engine whose
steps the test makes; and one replica's channels wired to one router's demux."""

from __future__ import annotations

import asyncio
import contextvars

from serve_app.protocol import Subscription
from serve_app.streaming.output_channels import OutputChannels
from serve_app.streaming.output_demux import OutputDemux
from workers.engine.outputs import RequestOutput


class CallCancelled(Exception):
    """What the caller of a cancelled call sees (Serve's RequestCancelledError)."""


class Call:
    """A streaming call: the replica's generator runs in a task (as in its own process);
    the caller iterates what it yields and may cancel it."""

    def __init__(self, agen):
        self._items: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run(agen))

    async def _run(self, agen) -> None:
        try:
            async for item in agen:
                self._items.put_nowait(("item", item))
            self._items.put_nowait(("end", None))
        except asyncio.CancelledError:
            self._items.put_nowait(("error", CallCancelled()))
            raise
        except Exception as e:
            self._items.put_nowait(("error", e))
        finally:
            await agen.aclose()

    def cancel(self) -> None:
        self._task.cancel()

    def done(self) -> bool:
        return self._task.done()

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._items.get()
        if kind == "item":
            return value
        self._items.put_nowait((kind, value))
        if kind == "end":
            raise StopAsyncIteration
        raise value


class Engine:
    """Requests whose outputs the test makes step by step, one per live request, all in
    one callback (as AsyncEngine delivers a step)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.closed: set[str] = set()

    async def outputs(self, rid: str):
        queue = self.queues[rid] = asyncio.Queue()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.closed.add(rid)

    def step(self, token: int, finish: bool = False) -> None:
        for rid, queue in self.queues.items():
            if rid not in self.closed:
                queue.put_nowait(_out(rid, [token], finished=finish))

    async def wait_for(self, *rids: str) -> None:
        while not all(r in self.queues for r in rids):
            await asyncio.sleep(0)


# Stands for Serve's request context, which a call made from a request's task inherits.
REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)


def _out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, tokens, "", finished=finished, num_output_tokens=tokens[-1])


class Service:
    """One replica's channels and one router's demux, its subscribe calls pinned to that
    replica (or landing on `elsewhere`, as when the pinned replica is gone)."""

    def __init__(self, idle_s: float = 10.0, elsewhere: OutputChannels | None = None) -> None:
        self.engine = Engine()
        self.channels = OutputChannels("replica-a", idle_s=idle_s)
        self.subscriptions: list[Call] = []
        self.subs: list[Subscription] = []  # what each subscribe call asked for
        self.subscribed_in: list[str | None] = []  # the REQUEST each was called in

        def subscribe(sub: Subscription) -> Call:
            call = Call((elsewhere or self.channels).subscribe(sub))
            self.subscriptions.append(call)
            self.subs.append(sub)
            self.subscribed_in.append(REQUEST.get())
            return call

        self.demux = OutputDemux(subscribe)

    def request(self, rid: str):
        call = Call(self.channels.stream(self.demux.router_id, self.engine.outputs(rid)))
        return call, self.demux.outputs(rid, call)

    async def subscribed(self) -> None:
        while not self.channels.stats()["open_subscriptions"]:
            await asyncio.sleep(0.001)

    async def run_alone(self, rid: str, token: int) -> list[int]:
        """One request that ends with its first token (no other request is live)."""
        _, outputs = self.request(rid)
        task = asyncio.ensure_future(_collect(outputs))
        await self.engine.wait_for(rid)
        self.engine.step(token, finish=True)
        return _tokens(await task)

    async def decoding(self, rid: str):
        """A request that has streamed its first token (1) and goes on."""
        call, outputs = self.request(rid)
        await self.engine.wait_for(rid)
        self.engine.step(1)
        assert (await anext(outputs)).new_token_ids == [1]
        return call, outputs


async def _collect(outputs) -> list[RequestOutput]:
    return [out async for out in outputs]


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


async def _eventually(condition, timeout_s: float = 10.0) -> None:
    """Waits until `condition()` holds: what the other tasks do next takes a few loop turns."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.001)


async def _muxed_service() -> Service:
    svc = Service()
    await svc.run_alone("warm", 1)
    await svc.subscribed()
    return svc
