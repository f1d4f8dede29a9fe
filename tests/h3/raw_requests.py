"""HTTP/3 requests exactly as written, for tests/it/http3.rs: header lists in any order and
with any fields (aioquic sends what it is given), DATA that need not match Content-Length, a
stream left open. Reports what came back on each stream, QUIC's STOP_SENDING and RESET_STREAM
codes included.

Usage: raw_requests.py HOST PORT CA_FILE SERVER_NAME CASES_JSON
CASES_JSON: a list of {"headers": [[name, value], ...], "data": str or null, "end": bool}:
the head, then the data (if any), the stream ended after it when "end" is true. Each case
goes on its own stream of one connection, one after the other. Prints one JSON object per
case: {"status", "headers", "body_len", "reset", "stop_sending"} (codes as numbers, or null).
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
from aioquic.quic.events import StopSendingReceived, StreamReset

# How long a stream whose answer is complete is watched for a STOP_SENDING still to come.
SETTLE = 1.0


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.streams = {}

    def quic_event_received(self, event):
        if isinstance(event, (StopSendingReceived, StreamReset)):
            s = self.streams.get(event.stream_id)
            if s is not None:
                key = "stop_sending" if isinstance(event, StopSendingReceived) else "reset"
                s["answer"][key] = event.error_code
                s["changed"].set()
        for ev in self.http.handle_event(event):
            if isinstance(ev, (HeadersReceived, DataReceived)):
                s = self.streams[ev.stream_id]
                answer = s["answer"]
                if isinstance(ev, HeadersReceived):
                    for k, v in ev.headers:
                        k, v = k.decode(), v.decode()
                        if k == ":status":
                            answer["status"] = int(v)
                        else:
                            answer["headers"][k] = v
                else:
                    answer["body_len"] += len(ev.data)
                if ev.stream_ended:
                    s["ended"] = True
                s["changed"].set()

    async def run(self, case):
        stream_id = self._quic.get_next_available_stream_id()
        headers = [(k.encode(), v.encode()) for k, v in case["headers"]]
        data = case.get("data")
        end = case.get("end", True)
        s = {
            "answer": {"status": None, "headers": {}, "body_len": 0, "reset": None, "stop_sending": None},
            "ended": False,
            "changed": asyncio.Event(),
        }
        self.streams[stream_id] = s
        self.http.send_headers(stream_id, headers, end_stream=end and data is None)
        if data is not None:
            self.http.send_data(stream_id, data.encode(), end_stream=end)
        self.transmit()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        settle = None
        answer = s["answer"]
        while loop.time() < deadline:
            if answer["reset"] is not None:
                break
            if s["ended"] and settle is None:
                settle = loop.time() + SETTLE
            if settle is not None and (answer["stop_sending"] is not None or not case.get("watch_stop")):
                break
            if settle is not None and loop.time() >= settle:
                break
            s["changed"].clear()
            try:
                await asyncio.wait_for(s["changed"].wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        return answer


async def main(host, port, ca, name, cases):
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=name)
    config.load_verify_locations(ca)
    config.verify_mode = ssl.CERT_REQUIRED
    async with connect(host, port, configuration=config, create_protocol=Client) as client:
        for case in cases:
            print(json.dumps(await client.run(case)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])))
