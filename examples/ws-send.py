"""Sends COUNT text messages on a WebSocket as fast as it can and says how the connection ended
(docs/guides/limit-what-a-stream-sends.md). Needs `pip install websockets`.

    python3 examples/ws-send.py ws://localhost:8080/chat 20
"""

import asyncio
import sys

import websockets


async def main(url, count):
    try:
        async with websockets.connect(url) as ws:
            for i in range(count):
                await ws.send(f"message {i + 1}")
            for _ in range(count):
                await ws.recv()
            print(f"all {count} messages echoed")
    except websockets.ConnectionClosed as e:
        if e.rcvd is None:
            print("closed without a close frame")
        else:
            print(f"closed: {e.rcvd.code} {e.rcvd.reason}")


asyncio.run(main(sys.argv[1], int(sys.argv[2])))
