"""A NATS server restarted mid-stream: clients reconnect, no acked-or-pending message is lost."""
from __future__ import annotations

import time

from kvpool.core.nats_server import NatsServer
from kvpool.streams import Consumer, Producer, StreamUnavailable


def test_clients_reconnect_after_nats_restart_and_nothing_is_lost(nats, make_stream):
    s = make_stream()
    with Producer(s, nats.url, timeout_s=2) as p, Consumer(s, nats.url, group="decode", timeout_s=2) as c:
        for i in range(3):
            p.publish({"i": i})
        first = c.receive(2)
        first.ack()
        nats.stop()
        restarted = NatsServer(nats.store_dir, port=nats.port).start()
        try:
            deadline, sent = time.monotonic() + 15, False
            while not sent:  # the producer's connection comes back on its own
                try:
                    p.publish({"i": 3})
                    sent = True
                except StreamUnavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            got = []
            while len(got) < 3 and time.monotonic() < deadline:
                m = c.receive(0.5)
                if m is not None:
                    got.append(m.json()["i"])
                    m.ack()
            assert (first.json()["i"], got) == (0, [1, 2, 3])
        finally:
            restarted.stop()
