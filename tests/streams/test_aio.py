"""AsyncConsumer on the caller's event loop: order, acks, groups and by-reference payloads."""
from __future__ import annotations

import asyncio

from kvpool.core.client import PoolClient
from kvpool.streams import AsyncConsumer, Producer


def test_async_iteration_acks_and_redelivery(nats, make_stream):
    s = make_stream()
    with PoolClient(dram_bytes="64MiB") as pool, Producer(s, nats.url, pool=pool, inline_max=100) as p:
        p.publish({"i": 0})
        p.publish(b"z" * 1000)
        p.publish({"i": 2})

        async def consume() -> list:
            got = []
            async with AsyncConsumer(s, nats.url, pool=pool, ack_wait_s=1.0) as c:
                async for msg in c:
                    got.append((msg.seq, msg.kind, msg.delivered, bytes(msg.data)))
                    if msg.seq == 2 and msg.delivered == 1:
                        continue  # not acked: comes back after ack_wait
                    await msg.ack()
                    if len(got) == 4:
                        break
                assert await c.receive(0.3) is None
            return got

        got = asyncio.run(asyncio.wait_for(consume(), 20))
    assert got == [(1, "inline", 1, b'{"i": 0}'), (2, "ref", 1, b"z" * 1000), (3, "inline", 1, b'{"i": 2}'),
                   (2, "ref", 2, b"z" * 1000)]


def test_async_group_members_split_the_messages(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p:
        for i in range(10):
            p.publish({"i": i})

    async def member(name: str) -> list[int]:
        got = []
        async with AsyncConsumer(s, nats.url, group="g") as c:
            while (m := await c.receive(0.5)) is not None:
                got.append(m.json()["i"])
                await m.ack()
                await asyncio.sleep(0.01)
        return got

    async def both() -> tuple:
        return await asyncio.gather(member("a"), member("b"))

    a, b = asyncio.run(asyncio.wait_for(both(), 20))
    assert sorted(a + b) == list(range(10)) and a and b


def test_callback_form_acks_on_return_redelivers_on_error_and_stops(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url) as p:
        for i in range(4):
            p.publish({"i": i})

    async def run() -> list:
        seen: list = []
        all_in = asyncio.Event()

        async def on_message(msg) -> None:
            seen.append((msg.json()["i"], msg.delivered))
            if len(seen) == 5:
                all_in.set()
            if seen[-1] == (1, 1):
                raise RuntimeError("a bad message must not stop the loop")

        async with AsyncConsumer(s, nats.url, ack_wait_s=1.0) as c:
            handle = await c.consume(on_message, nak_delay_s=0.2)
            await asyncio.wait_for(all_in.wait(), 10)
            await handle.stop()
            assert not handle.running
            assert await c.receive(1.5) is None  # every message acked: nothing comes back after ack_wait
            with Producer(s, nats.url) as p:
                p.publish({"i": 4})
            plain: list = []
            handle = await c.consume(lambda m: plain.append(m.json()["i"]))  # a plain function works too
            while not plain:
                await asyncio.sleep(0.05)
            await handle.stop()
            assert plain == [4]
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 30))
    assert seen == [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2)]
