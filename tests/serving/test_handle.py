"""A handle's events as asyncio code awaits them: put() from the engine's thread wakes the event
loop itself, with no worker thread in between."""
import asyncio
import threading
import time

import pytest

from edgellm.serving.handle import DONE, Handle, Request


def _put_later(handle: Handle, events: list, delay_s: float) -> threading.Thread:
    def run() -> None:
        for event in events:
            time.sleep(delay_s)
            handle.put(event)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_events_put_by_another_thread_arrive_in_order_without_a_worker_thread():
    handle = Handle(Request("hi"))

    async def consume() -> list:
        producer = _put_later(handle, ["a", "b", "c", DONE], 0.01)
        threads = threading.active_count()
        got = []
        while (event := await handle.next_event_async(5.0)) is not DONE:
            got.append(event)
            assert threading.active_count() <= threads  # no thread started to wait for it
        producer.join()
        return got

    assert asyncio.run(consume()) == ["a", "b", "c"]


def test_an_event_put_before_the_wait_is_taken_at_once_and_a_quiet_handle_times_out():
    handle = Handle(Request("hi"))
    handle.put("early")

    async def consume() -> tuple:
        first = await handle.next_event_async(5.0)
        started = time.perf_counter()
        nothing = await handle.next_event_async(0.05)
        return first, nothing, time.perf_counter() - started

    first, nothing, waited = asyncio.run(consume())
    assert first == "early" and nothing is None and 0.04 < waited < 2.0


def test_an_error_that_ended_the_request_is_raised_and_the_stream_then_ends():
    handle = Handle(Request("hi"))

    async def consume() -> None:
        _put_later(handle, [ValueError("broken")], 0.01).join()
        with pytest.raises(ValueError, match="broken"):
            await handle.next_event_async(5.0)
        assert await handle.next_event_async(5.0) is DONE

    asyncio.run(consume())


def test_a_put_after_the_waiting_loop_closed_does_not_fail_the_engine_thread():
    handle = Handle(Request("hi"))
    loop = asyncio.new_event_loop()
    task = loop.create_task(handle.next_event_async(None))
    loop.run_until_complete(asyncio.sleep(0.01))  # the task now waits, its waker set
    task.cancel()
    loop.close()  # closed while the handle still holds the waker
    handle.put("late")  # must neither raise nor hang
    assert handle.next_event(0.1) == "late"
