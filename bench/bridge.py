"""What crossing from grpcio's asyncio loop to trio costs (the gRPC front end's bridge).

    .venv/bin/python bench/bridge.py [--calls 20000]

An asyncio loop in a worker thread (as in ``orchestrion serve``) calls a trio async function
that returns at once, through `orchestrion.backends._asyncio_bridge.TrioBridge`, one call at a
time and 16 at once; beside it, the same loop awaiting a plain asyncio coroutine (no crossing), and
``trio.from_thread.run`` from a plain thread (a blocking bridge). Per-call microseconds; the
interesting number is the bridge minus the asyncio baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from _common import table

from orchestrion.backends._asyncio_bridge import TrioBridge


async def _noop_trio(value: int) -> int:
    return value


async def _noop_asyncio(value: int) -> int:
    return value


async def _drive(call: Callable[[int], Awaitable[Any]], calls: int, concurrency: int) -> float:
    """Seconds per call, ``concurrency`` callers sharing ``calls`` calls."""

    async def caller(count: int) -> None:
        for i in range(count):
            await call(i)

    share = calls // concurrency
    start = time.perf_counter()
    await asyncio.gather(*(caller(share) for _ in range(concurrency)))
    return (time.perf_counter() - start) / (share * concurrency)


def _asyncio_side(bridge: TrioBridge | None, calls: int) -> dict[str, float]:
    async def main() -> dict[str, float]:
        out = {}
        for concurrency in (1, 16):
            out[f"asyncio await, no crossing, x{concurrency}"] = await _drive(
                _noop_asyncio, calls, concurrency
            )
            if bridge is not None:
                out[f"TrioBridge.call, x{concurrency}"] = await _drive(
                    lambda i: bridge.call(_noop_trio, i), calls, concurrency
                )
        return out

    return asyncio.run(main())


async def _measure(calls: int) -> dict[str, float]:
    async with trio.open_nursery() as nursery:
        bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
        results = await trio.to_thread.run_sync(_asyncio_side, bridge, calls)
        token = trio.lowlevel.current_trio_token()

        def blocking() -> float:
            start = time.perf_counter()
            for i in range(calls // 4):
                trio.from_thread.run(_noop_trio, i, trio_token=token)
            return (time.perf_counter() - start) / (calls // 4)

        results["trio.from_thread.run (blocking), x1"] = await trio.to_thread.run_sync(blocking)
    return results


def _guest_mode(calls: int) -> dict[str, float]:
    """trio as a guest of the asyncio loop: both on one thread."""

    async def host() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[TrioBridge, trio.CancelScope]] = loop.create_future()
        done: asyncio.Future[object] = loop.create_future()

        async def trio_main() -> None:
            async with trio.open_nursery() as nursery:
                bridge = TrioBridge(trio.lowlevel.current_trio_token(), nursery)
                ready.set_result((bridge, nursery.cancel_scope))
                await trio.sleep_forever()

        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        bridge, scope = await ready
        out = {}
        for concurrency in (1, 16):
            out[f"TrioBridge.call, trio as asyncio's guest, x{concurrency}"] = await _drive(
                lambda i: bridge.call(_noop_trio, i), calls, concurrency
            )
        bridge.token.run_sync_soon(scope.cancel)
        await done
        return out

    return asyncio.run(host())


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    results = trio.run(_measure, args.calls)
    results.update(_guest_mode(args.calls))
    assert threading.active_count() >= 1
    baseline = results["asyncio await, no crossing, x1"]
    rows = [
        [name, f"{seconds * 1e6:.1f}", f"{(seconds - baseline) * 1e6:+.1f}"]
        for name, seconds in results.items()
    ]
    print(table(["path", "µs per call", "vs plain await (x1)"], rows))


if __name__ == "__main__":
    main()
