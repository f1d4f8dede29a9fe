#!/usr/bin/env python3
"""Idle keep-alive clients for benches/conns.sh.

    conns_client.py HOST PORT N h1|h2 [SOURCES]

Opens N connections to HOST:PORT, each from one of SOURCES source addresses (127.0.0.2,
127.0.0.3, ...; default 8) so the ephemeral port range is not the limit. Each sends one
request (HTTP/1.1 `GET /`, or h2c with prior knowledge: preface, SETTINGS, one GET
stream), reads the whole answer and then stays open and idle; an h2c connection answers
the server's SETTINGS and PINGs, as a real client's would. When every connection has its
answer (or failed), prints `ready ok=K failed=F` on stdout, then holds them until stdin
closes, closes them all, prints `closed lost=L` (connections the server closed while they
were held) and exits.
"""

import asyncio
import socket
import struct
import sys

IP_BIND_ADDRESS_NO_PORT = 24
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


# HPACK: :method GET (2), :scheme http (6), :path / (4), :authority (1) literal, no indexing.
H2_REQUEST = (
    PREFACE
    + h2_frame(4, 0, 0)
    + h2_frame(1, 0x5, 1, b"\x82\x86\x84\x01\x09localhost")
)
H1_REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


class Conn:
    lost = 0

    def __init__(self):
        self.writer = None


async def open_conn(host, port, source):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock)


async def h1_answer(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    await reader.readexactly(length)


async def h2_frames(reader, writer, answered):
    """Reads frames until the connection ends; sets `answered` once stream 1 has ended."""
    while True:
        head = await reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        payload = await reader.readexactly(length)
        if kind == 4 and not flags & 1:
            writer.write(h2_frame(4, 1, 0))
        elif kind == 6 and not flags & 1:
            writer.write(h2_frame(6, 1, 0, payload))
        elif kind == 7:
            raise ConnectionError("GOAWAY")
        elif kind in (0, 1) and stream == 1 and flags & 1 and not answered.done():
            answered.set_result(None)


async def one(host, port, proto, source, conn, done):
    reader, writer = await open_conn(host, port, source)
    conn.writer = writer
    if proto == "h1":
        writer.write(H1_REQUEST)
        await h1_answer(reader)
        done.set_result(None)
        # Idle: a keep-alive connection reads nothing more until the server closes it.
        await reader.read(1)
    else:
        writer.write(H2_REQUEST)
        await h2_frames(reader, writer, done)


async def run(host, port, n, proto, sources):
    conns, tasks, answers = [], [], []
    gate = asyncio.Semaphore(256)
    ok = failed = 0

    async def start(i):
        nonlocal ok, failed
        conn, done = Conn(), asyncio.get_running_loop().create_future()
        conns.append(conn)
        async with gate:
            task = asyncio.ensure_future(one(host, port, proto, sources[i % len(sources)], conn, done))
            tasks.append(task)
            finished, _ = await asyncio.wait([task, done], return_when=asyncio.FIRST_COMPLETED)
            if done in finished and done.exception() is None:
                ok += 1
            else:
                failed += 1
                if len(sys.argv) > 6 and task.done() and task.exception():
                    print(repr(task.exception()), file=sys.stderr)
                if not done.done():
                    done.cancel()
                task.cancel()

    await asyncio.gather(*(start(i) for i in range(n)))
    print(f"ready ok={ok} failed={failed}", flush=True)
    live = [t for t in tasks if not t.done()]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    lost = ok - sum(1 for t in live if not t.done())
    for c in conns:
        if c.writer is not None:
            c.writer.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"closed lost={lost}", flush=True)


def main():
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    host, port, n, proto = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    count = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    sources = [f"127.0.0.{2 + i}" for i in range(count)]
    asyncio.run(run(host, port, n, proto, sources))


if __name__ == "__main__":
    main()
