#!/usr/bin/env python3
"""The payloads of benches/compress.sh: an API's JSON answer and an HTML page, made the same
every run (a seeded generator), of about the sizes real ones have (JSON 256 KiB, HTML 96 KiB).

    benches/compress-payload.py DIR     # writes DIR/payload.json and DIR/payload.html
"""
import json
import random
import sys

WORDS = ("order customer invoice shipped pending refund account region europe west north "
         "premium basic standard widget gadget gizmo sprocket bolt nut washer cable adapter "
         "charger battery screen keyboard mouse monitor laptop tablet phone camera lens "
         "tripod bag case strap warranty returned delivered processing cancelled").split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def json_payload(rng, size):
    items = []
    i = 0
    while True:
        i += 1
        items.append({
            "id": 100000 + i,
            "uuid": "%08x-%04x-4%03x-a%03x-%012x" % (rng.getrandbits(32), rng.getrandbits(16),
                                                     rng.getrandbits(12), rng.getrandbits(12),
                                                     rng.getrandbits(48)),
            "status": rng.choice(["pending", "shipped", "delivered", "cancelled", "refunded"]),
            "customer": {"id": rng.randint(1, 5000), "name": sentence(rng, 2)[:-1],
                         "email": "user%d@example.com" % rng.randint(1, 5000),
                         "tier": rng.choice(["free", "pro", "enterprise"])},
            "total": {"amount": round(rng.uniform(1, 2000), 2), "currency": rng.choice(["EUR", "USD", "GBP"])},
            "created_at": "2026-%02d-%02dT%02d:%02d:%02dZ" % (rng.randint(1, 12), rng.randint(1, 28),
                                                            rng.randint(0, 23), rng.randint(0, 59),
                                                            rng.randint(0, 59)),
            "lines": [{"sku": "SKU-%05d" % rng.randint(0, 99999), "qty": rng.randint(1, 9),
                       "price": round(rng.uniform(1, 500), 2)} for _ in range(rng.randint(1, 4))],
            "note": sentence(rng, rng.randint(4, 14)),
        })
        text = json.dumps({"items": items, "page": 1, "next": "/api/orders?page=2"}, indent=1)
        if len(text) >= size:
            return text.encode()


def html_payload(rng, size):
    parts = ["<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Orders</title>"
             "<link rel=\"stylesheet\" href=\"/static/site.css\"></head>\n<body>\n<main class=\"orders\">\n"]
    n = 0
    while sum(map(len, parts)) < size:
        n += 1
        parts.append(
            "<article class=\"order\" id=\"order-%d\">\n  <h2><a href=\"/orders/%d\">Order %d</a></h2>\n"
            "  <p class=\"status status-%s\">%s</p>\n  <p>%s</p>\n  <ul class=\"lines\">%s</ul>\n</article>\n"
            % (n, n, n, rng.choice(WORDS), rng.choice(WORDS), sentence(rng, rng.randint(8, 30)),
               "".join("<li><span class=\"sku\">SKU-%05d</span> &times; %d</li>" % (rng.randint(0, 99999),
                                                                                 rng.randint(1, 9))
                       for _ in range(rng.randint(1, 4)))))
    parts.append("</main>\n</body></html>\n")
    return "".join(parts).encode()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    with open(out + "/payload.json", "wb") as f:
        f.write(json_payload(random.Random(45), 256 << 10))
    with open(out + "/payload.html", "wb") as f:
        f.write(html_payload(random.Random(46), 96 << 10))


if __name__ == "__main__":
    main()
