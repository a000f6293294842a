#!/usr/bin/env python3
"""Load for `baton serve` (stdlib only): concurrent streaming completions, or the time
to the first token of one long prompt.

  bench/load.py streams URL N [--tokens 128]   -> aggregate generated tokens/s
  bench/load.py prefill URL [--prompt-tokens 512] [--reps 3] -> median seconds to first token
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def stream(url, body):
    """POSTs a streaming completion; returns (seconds to first token, seconds, completion tokens)."""
    start = time.perf_counter()
    result = stream_times(url, body)
    first = result["times"][0] if result["times"] else None
    return first, time.perf_counter() - start, result["tokens"]


def stream_times(url, body, absolute=False):
    """POSTs a streaming completion; returns the time each text chunk arrived (seconds
    from the request, or `time.perf_counter()` values with `absolute`) and the tokens
    generated (the usage's count when the server sends one, else the chunks)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"HTTP {response.status}: {response.read()[:300]!r}")
    times, tokens = [], None
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise SystemExit(f"error: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices") or []):
            now = time.perf_counter()
            times.append(now if absolute else now - start)
    conn.close()
    return {"times": times, "tokens": tokens if tokens is not None else len(times)}


PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a compiler turns source code into machine code.",
    "List the steps to bake bread, with a paragraph for each step.",
    "Describe the history of the Roman Empire in many paragraphs.",
    "Write a Python program that implements a linked list with many methods.",
    "Tell a long tale about a sailor lost at sea for years.",
    "Explain how the internet works, from cables to web pages, at length.",
    "Write a detailed guide to planting a vegetable garden.",
]


def streams(args):
    results = [None] * args.n

    def one(i):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        results[i] = stream(args.url, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    total = sum(r[2] for r in results)
    print(json.dumps({"streams": args.n, "tokens": total, "seconds": round(wall, 3),
                      "tokens_per_s": round(total / wall, 2)}))


def prefill(args):
    # A prompt of exactly --prompt-tokens token ids (distinct per repetition, so no
    # cached prefix helps), one token generated.
    times = []
    for rep in range(args.reps + 1):
        ids = [(1000 + 7919 * (i + 131 * rep)) % 30000 + 200 for i in range(args.prompt_tokens)]
        first, _, _ = stream(args.url, {"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True})
        if rep > 0:  # the first one warms up
            times.append(first)
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "median_s": round(statistics.median(times), 4),
                      "times": [round(t, 4) for t in times]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("streams")
    s.add_argument("url")
    s.add_argument("n", type=int)
    s.add_argument("--tokens", type=int, default=128)
    p = sub.add_parser("prefill")
    p.add_argument("url")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    streams(args) if args.cmd == "streams" else prefill(args)


if __name__ == "__main__":
    main()
