#!/usr/bin/env python3
"""Serving many users: baton against llama-server in the same run.

Concurrent greedy streaming completions (1, 8, 32 at once by default, 128 tokens each)
against, on one node, `baton serve --stages 1` and `llama-server` with the same threads,
and on two nodes, `baton serve --local-workers 2 --no-head-stage` and `llama-server
--rpc` to two `ggml-rpc-server`s (1 thread each). For each: aggregate generated
tokens/s, time to first token and time per output token (median and 90th percentile
over the streams). Then, on one node, streams decoding while a long prompt arrives:
the 90th percentile of the gaps between their tokens while the prompt is prefilled.

Writes bench/results/<date>-serve-scaling.md and an SVG plot beside it.

  bench/serve-scaling [--model M] [--streams 1,8,32] [--tokens 128] [--threads 2]
"""
import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402
from suite import PEER, ROOT, Procs, free_port, http_ready, wait_port  # noqa: E402


def percentile(values, q):
    """The q-quantile (0..1) of values, by linear interpolation."""
    values = sorted(values)
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def run_streams(url, n, tokens):
    """n concurrent streams; returns the measures of one round."""
    results = [None] * n

    def one(i):
        body = {"prompt": load.PROMPTS[i % len(load.PROMPTS)] + f" (story {i})", "max_tokens": tokens,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        results[i] = load.stream_times(url, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    total = sum(r["tokens"] for r in results)
    ttft = [r["times"][0] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1 and r["times"]]
    return {
        "streams": n,
        "tokens": total,
        "tok_s": total / wall,
        "ttft_med": statistics.median(ttft),
        "ttft_p90": percentile(ttft, 0.9),
        "tpot_med": statistics.median(tpot),
        "tpot_p90": percentile(tpot, 0.9),
    }


def prefill_under_load(url, n_streams, prompt_tokens, tokens):
    """n_streams decoding; a prompt of prompt_tokens arrives once they all stream.
    Returns (p90 token gap before the prompt, p90 and longest gap while it is prefilled,
    prefill s). A gap counts as "while" when it overlaps the prefill at all, so a stream
    that stalls across the whole prefill shows its stall."""
    results = [None] * n_streams
    window = {}

    def one(i):
        body = {"prompt": load.PROMPTS[i % len(load.PROMPTS)], "max_tokens": tokens, "temperature": 0,
                "stream": True}
        results[i] = load.stream_times(url, body, absolute=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    ids = [(1000 + 7919 * i) % 30000 + 200 for i in range(prompt_tokens)]
    window["start"] = time.perf_counter()
    load.stream_times(url, {"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True})
    window["end"] = time.perf_counter()
    for t in threads:
        t.join()
    before, during = [], []
    for r in results:
        for a, b in zip(r["times"], r["times"][1:]):
            if b <= window["start"]:
                before.append(b - a)
            elif a < window["end"] and b > window["start"]:
                during.append(b - a)
    return percentile(before, 0.9), percentile(during, 0.9), max(during), window["end"] - window["start"]


class Server:
    """One server under test: started, measured, stopped."""

    def __init__(self, name, setup, model, threads, parallel, ctx):
        self.name, self.setup, self.model = name, setup, model
        self.threads, self.parallel, self.ctx = threads, parallel, ctx
        self.procs = Procs()

    def start(self):
        port = free_port()
        baton = ROOT / "target" / "release" / "baton"
        common = ["--parallel", self.parallel, "--ctx-size", self.ctx, "--port", port]
        if self.name == "baton" and self.setup == "1 node":
            proc = self.procs.start([baton, "serve", "--model", self.model, "--stages", 1, "--threads", self.threads]
                                    + common)
        elif self.name == "baton":
            proc = self.procs.start([baton, "serve", "--model", self.model, "--local-workers", 2, "--no-head-stage",
                                     "--threads", 1] + common)
        elif self.setup == "1 node":
            proc = self.procs.start([PEER / "llama-server", "-m", self.model, "-t", self.threads, "-np", self.parallel,
                                     "-c", self.ctx, "--host", "127.0.0.1", "--port", port])
        else:
            dial = []
            for _ in range(2):
                rpc_port = free_port()
                rpc = self.procs.start([PEER / "ggml-rpc-server", "-t", 1, "-H", "127.0.0.1", "-p", rpc_port])
                wait_port(rpc_port, rpc, "ggml-rpc-server")
                dial.append(f"127.0.0.1:{rpc_port}")
            proc = self.procs.start([PEER / "llama-server", "-m", self.model, "--rpc", ",".join(dial), "-ngl", 99,
                                     "-t", 1, "-np", self.parallel, "-c", self.ctx, "--host", "127.0.0.1",
                                     "--port", port])
        http_ready(port, proc, self.name, 300)
        self.url = f"http://127.0.0.1:{port}"
        run_streams(self.url, 1, 8)  # warm-up

    def stop(self):
        self.procs.stop()


def svg_plot(rows, path):
    """Aggregate tok/s against concurrent streams, one line per server and setup."""
    series = {}
    for r in rows:
        series.setdefault(f"{r['server']}, {r['setup']}", []).append((r["streams"], r["tok_s"]))
    w, h, pad = 640, 400, 60
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ymax = max(y for pts in series.values() for _, y in pts) * 1.1
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]

    def px(x):
        return pad + (w - 2 * pad) * (xs.index(x) / max(1, len(xs) - 1))

    def py(y):
        return h - pad - (h - 2 * pad) * y / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">concurrent streams</text>',
           f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">'
           'aggregate tokens/s</text>']
    for x in xs:
        out.append(f'<text x="{px(x)}" y="{h - pad + 18}" text-anchor="middle">{x}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{pad - 8}" y="{py(y) + 4}" text-anchor="end">{y:.0f}</text>')
    for (name, pts), color in zip(sorted(series.items()), colors):
        pts = sorted(pts)
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        k = list(sorted(series)).index(name)
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * k}" fill="{color}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--setups", default="1 node,2 workers")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per stream count; the median is reported")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    parallel = max(streams)
    ctx = parallel * 512
    model = ROOT / args.model
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)

    rows, prefill_rows = [], []
    for setup in args.setups.split(","):
        for name in ["baton", "llama-server"]:
            server = Server(name, setup, model, args.threads, parallel, ctx)
            try:
                server.start()
                for n in streams:
                    # The round of median throughput: one round swings by 15% on a
                    # shared 2-core machine.
                    rounds = sorted((run_streams(server.url, n, args.tokens) for _ in range(args.rounds)),
                                    key=lambda r: r["tok_s"])
                    r = rounds[len(rounds) // 2]
                    r.update(server=name, setup=setup, rounds=[round(x["tok_s"], 1) for x in rounds])
                    print(json.dumps(r), flush=True)
                    rows.append(r)
            finally:
                server.stop()
            if setup == "1 node":
                # 4 streams and the long prompt, each in a slot of its own that holds it.
                server = Server(name, setup, model, args.threads, 5, 5 * (args.prefill_tokens + 512))
                try:
                    server.start()
                    before, during, longest, secs = prefill_under_load(server.url, 4, args.prefill_tokens, 256)
                finally:
                    server.stop()
                prefill_rows.append((name, before, during, longest, secs))
                print(json.dumps({"server": name, "gap_p90_before": before, "gap_p90_prefill": during,
                                  "gap_max_prefill": longest, "prefill_s": secs}), flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc)
    out = ROOT / "bench" / "results" / f"{now:%Y-%m-%d}-serve-scaling.md"
    lines = [
        "# Serving many users: baton and llama-server side by side",
        "",
        f"commit {commit}, {now:%Y-%m-%dT%H:%MZ}, {len(__import__('os').sched_getaffinity(0))} cores, model "
        f"{model.name}. Greedy streaming completions of {args.tokens} tokens, all streams at once; "
        f"`--parallel`/`-np` {parallel}, context {ctx}. 1 node: `baton serve --stages 1 -t {args.threads}` vs "
        f"`llama-server -t {args.threads}`. 2 workers: `baton serve --local-workers 2 --no-head-stage -t 1` vs "
        "`llama-server --rpc` to 2 `ggml-rpc-server -t 1` (`-ngl 99`), all on this machine. TTFT: time to first "
        "token; TPOT: time per output token of a stream after its first; median and p90 over the streams. "
        f"Each row is the round of median throughput of {args.rounds} (all rounds' tok/s in the last column).",
        "",
        "| setup | streams | server | aggregate tok/s | vs llama.cpp | TTFT med / p90 (s) | TPOT med / p90 (ms) "
        "| rounds tok/s |",
        "|---|---:|---|---:|---:|---|---|---|",
    ]
    for r in rows:
        peer = next((p for p in rows if p["setup"] == r["setup"] and p["streams"] == r["streams"]
                     and p["server"] == "llama-server"), None)
        ratio = f"{r['tok_s'] / peer['tok_s']:.2f}" if peer else ""
        peer_name = "llama-server" if r["setup"] == "1 node" else "llama-server over RPC"
        name = r["server"] if r["server"] == "baton" else peer_name
        lines.append(f"| {r['setup']} | {r['streams']} | {name} | {r['tok_s']:.1f} | {ratio} | "
                     f"{r['ttft_med']:.2f} / {r['ttft_p90']:.2f} | "
                     f"{r['tpot_med'] * 1e3:.0f} / {r['tpot_p90'] * 1e3:.0f} | "
                     f"{', '.join(str(x) for x in r['rounds'])} |")
    if prefill_rows:
        lines += ["", f"## 4 streams decoding while a {args.prefill_tokens}-token prompt is prefilled (1 node)", "",
                  "A gap counts as during the prefill when it overlaps it at all.", "",
                  "| server | p90 gap between tokens before (ms) | p90 gap during the prefill (ms) | longest gap "
                  "during it (ms) | prefill (s) |",
                  "|---|---:|---:|---:|---:|"]
        for name, before, during, longest, secs in prefill_rows:
            lines.append(f"| {name} | {before * 1e3:.0f} | {during * 1e3:.0f} | {longest * 1e3:.0f} | {secs:.2f} |")
    plot = out.with_suffix(".svg")
    svg_plot(rows, plot)
    lines += ["", f"![aggregate tokens/s]({plot.name})", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
