#!/usr/bin/env python3
"""A client for tests/it/compression.rs that decodes with decoders nobody here wrote: zlib
(Python's own), Brotli and zstandard (PyPI; scripts/test.sh installs them).

    client.py get HOST PORT PATH ACCEPT_ENCODING
        One GET; prints one JSON line: status, headers (lower-case name -> list), the raw
        length, the decoded body's length and SHA-256, and the decoder used.
    client.py events HOST PORT PATH ACCEPT_ENCODING
        A GET of an event stream read as it arrives: every event is decoded from the bytes
        received so far and printed on its own line (`event <data>`) at once, before the next
        is read; `end` when the stream ends.

ACCEPT_ENCODING `-` sends no Accept-Encoding field.
"""
import hashlib
import http.client
import json
import sys
import zlib


def decoder(coding):
    if coding is None or coding == "identity":
        return lambda b: b
    if coding == "gzip":
        d = zlib.decompressobj(wbits=31)
        return d.decompress
    if coding == "br":
        import brotli
        return brotli.Decompressor().process
    if coding == "zstd":
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress
    raise SystemExit("unknown coding %r" % coding)


def request(host, port, path, ae):
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {} if ae == "-" else {"Accept-Encoding": ae}
    conn.request("GET", path, headers=headers)
    return conn.getresponse()


def get(host, port, path, ae):
    resp = request(host, port, path, ae)
    raw = resp.read()
    coding = resp.getheader("content-encoding")
    body = decoder(coding)(raw)
    headers = {}
    for k, v in resp.getheaders():
        headers.setdefault(k.lower(), []).append(v)
    print(json.dumps({
        "status": resp.status,
        "headers": headers,
        "raw_len": len(raw),
        "len": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "coding": coding or "identity",
    }))


def events(host, port, path, ae):
    resp = request(host, port, path, ae)
    decode = decoder(resp.getheader("content-encoding"))
    text = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        text += decode(chunk)
        while b"\n\n" in text:
            event, text = text.split(b"\n\n", 1)
            data = b" ".join(l[6:] for l in event.split(b"\n") if l.startswith(b"data: "))
            print("event " + data.decode(), flush=True)
    print("end", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"get": get, "events": events}[mode](*args)
