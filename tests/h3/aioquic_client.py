"""An HTTP/3 client nobody at tollgate wrote (aioquic's), for tests/it/http3.rs.

Usage: aioquic_client.py HOST PORT CA_FILE SERVER_NAME
Sends, on one connection: GET /a, POST /b with a 70,000-byte body, then three GETs at once;
prints one JSON object per answer: {"path", "status", "headers", "body_len", "body_head"}.
"""

import asyncio
import json
import ssl
import sys

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.waiting = {}

    def quic_event_received(self, event):
        for ev in self.http.handle_event(event):
            if isinstance(ev, (HeadersReceived, DataReceived)):
                fut, answer = self.waiting[ev.stream_id]
                if isinstance(ev, HeadersReceived):
                    answer["headers"].extend((k.decode(), v.decode()) for k, v in ev.headers)
                else:
                    answer["body"] += ev.data
                if ev.stream_ended and not fut.done():
                    fut.set_result(answer)

    async def request(self, method, authority, path, body=b""):
        stream_id = self._quic.get_next_available_stream_id()
        headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ]
        if body:
            headers.append((b"content-length", str(len(body)).encode()))
        self.http.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self.http.send_data(stream_id, body, end_stream=True)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[stream_id] = (fut, {"headers": [], "body": b""})
        self.transmit()
        answer = await asyncio.wait_for(fut, 10)
        status = dict(answer["headers"]).get(":status")
        return {
            "path": path,
            "status": int(status),
            "headers": {k: v for k, v in answer["headers"] if not k.startswith(":")},
            "body_len": len(answer["body"]),
            "body_head": answer["body"][:40].decode("latin-1"),
        }


async def main(host, port, ca, name):
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=name)
    config.load_verify_locations(ca)
    config.verify_mode = ssl.CERT_REQUIRED
    async with connect(host, port, configuration=config, create_protocol=Client) as client:
        out = [await client.request("GET", name, "/a")]
        out.append(await client.request("POST", name, "/b", b"y" * 70000))
        out.extend(await asyncio.gather(*(client.request("GET", name, f"/c{i}") for i in range(3))))
        for answer in out:
            print(json.dumps(answer))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))
