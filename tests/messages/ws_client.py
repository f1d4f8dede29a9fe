"""A WebSocket client (the `websockets` library) that sends faster than a route's message
limit, for tests/it/messages.rs.

    ws_client.py URL COUNT SIZE

Sends COUNT binary messages of SIZE bytes as fast as the connection takes them, while reading
the echoes; prints one JSON line: how many were sent and echoed, the close code and reason
the client got (null if none), and the seconds from the first send to the last echo.
"""

import asyncio
import json
import sys
import time

import websockets


async def main(url, count, size):
    out = {"sent": 0, "echoed": 0, "close_code": None, "close_reason": None, "seconds": None}
    started = time.monotonic()

    def closed(e):
        if e.rcvd is not None:
            out["close_code"] = e.rcvd.code
            out["close_reason"] = e.rcvd.reason

    try:
        async with websockets.connect(url, max_size=None, ping_interval=None) as ws:

            async def send():
                for i in range(count):
                    await ws.send(bytes([i % 256]) * size)
                    out["sent"] += 1

            sender = asyncio.create_task(send())
            try:
                while out["echoed"] < count:
                    await ws.recv()
                    out["echoed"] += 1
                out["seconds"] = time.monotonic() - started
            except websockets.ConnectionClosed as e:
                closed(e)
            finally:
                sender.cancel()
                try:
                    await sender
                except BaseException:
                    pass
    except websockets.ConnectionClosed as e:
        closed(e)
    except Exception:
        # The library's own teardown after the server closed with a message half sent.
        if out["close_code"] is None:
            raise
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
