"""A gRPC upstream and client (grpcio, raw bytes: no protobuf), for tests/it/messages.rs.

    grpc_peer.py serve                  # prints the port it listens on (h2c), serves until killed
    grpc_peer.py upload TARGET COUNT SIZE            # client streaming /t.Chat/Upload
    grpc_peer.py download TARGET COUNT               # server streaming /t.Chat/Download
    grpc_peer.py echo TARGET COUNT                   # bidi /t.Chat/Echo

The service: Upload takes every message and answers with how many it got (as text);
Download answers COUNT messages of 100 bytes; Echo sends each message back. A client prints
one JSON line: the status code's name, its details, the trailing metadata, how many messages
went and came back, and the call's answer (for Upload).
"""

import json
import sys
import time
from concurrent import futures

import grpc


def serve():
    def upload(requests, context):
        n = sum(1 for _ in requests)
        return str(n).encode()

    def download(request, context):
        for i in range(int(request.decode())):
            yield bytes([i % 256]) * 100

    def echo(requests, context):
        for r in requests:
            yield r

    handler = grpc.method_handlers_generic_handler(
        "t.Chat",
        {
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
            "Download": grpc.unary_stream_rpc_method_handler(download),
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def client(mode, target, count, size):
    out = {"code": "OK", "details": None, "trailers": {}, "sent": 0, "received": 0, "answer": None}
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])

    def messages():
        for i in range(count):
            out["sent"] += 1
            yield bytes([i % 256]) * size

    try:
        if mode == "upload":
            call = channel.stream_unary("/t.Chat/Upload")
            answer, c = call.with_call(messages(), timeout=30)
            out["answer"] = answer.decode()
            out["trailers"] = dict(c.trailing_metadata() or ())
        elif mode == "download":
            call = channel.unary_stream("/t.Chat/Download")(str(count).encode(), timeout=30)
            for _ in call:
                out["received"] += 1
            out["trailers"] = dict(call.trailing_metadata() or ())
        elif mode == "echo":
            call = channel.stream_stream("/t.Chat/Echo")(messages(), timeout=30)
            for _ in call:
                out["received"] += 1
            out["trailers"] = dict(call.trailing_metadata() or ())
    except grpc.RpcError as e:
        out["code"] = e.code().name
        out["details"] = e.details()
        out["trailers"] = dict(e.trailing_metadata() or ())
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        size = int(sys.argv[4]) if len(sys.argv) > 4 else 10
        client(sys.argv[1], sys.argv[2], int(sys.argv[3]), size)
