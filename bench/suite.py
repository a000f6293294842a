#!/usr/bin/env python3
"""baton against llama.cpp RPC on emulated links (toxiproxy). Run through `bench/run`.

Every link between nodes of both systems goes through a toxiproxy proxy that adds the
profile's latency and bandwidth limit in each direction:
  RPC:   host -> each ggml-rpc-server;
  baton: head -> each worker, and worker -> worker (workers advertise their proxy).
Each node is one process with one compute thread; the RPC host and the baton head
compute nothing (`-ngl 99`; `--no-head-stage`), so both systems use the same N nodes, with
the layers split evenly (`--split`).
"""
import argparse
import csv
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "bench/peer/build/bin"
BATON = ROOT / "target/release/baton"
RESULTS = ROOT / "bench/results"

# latency: ms added each way (toxiproxy's unit is whole milliseconds); rate: KB/s each way.
PROFILES = {
    "loopback": {"latency_ms": None, "rate_kbs": None, "nominal_ms": 0.0},
    "lan": {"latency_ms": 0, "rate_kbs": 125_000, "nominal_ms": 0.25},
    "wifi": {"latency_ms": 15, "rate_kbs": 15_000, "nominal_ms": 15.0},
    "wan": {"latency_ms": 40, "rate_kbs": 5_000, "nominal_ms": 40.0},
}
MODELS = {
    "qwen2": "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma3": "models/gemma-3-270m-q4_k_m.gguf",
}
N_LAYERS = {MODELS["qwen2"]: 24, MODELS["gemma3"]: 18}
TOKEN = "bench-suite-token"
# Every baton process of the suite reads the cluster token from its environment, never
# from its command line (which every user of the machine can read).
os.environ["BATON_TOKEN"] = TOKEN


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


class Procs:
    """Child processes, stopped together."""

    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen([str(a) for a in args], **kw)
        self.procs.append(proc)
        return proc

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


class Toxiproxy:
    def __init__(self, procs, profile):
        self.api_port = free_port()
        self.profile = profile
        self.names = []
        exe = PEER / "toxiproxy-server"
        proc = procs.start([exe, "-port", self.api_port, "-proxy-metrics"])
        wait_port(self.api_port, proc, "toxiproxy-server")

    def _call(self, method, path, body=None):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.api_port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    def proxy(self, upstream_port):
        """A shaped proxy in front of upstream_port; returns the port to dial instead."""
        name = f"p{len(self.names)}"
        port = free_port()
        self._call("POST", "/proxies", {
            "name": name, "listen": f"127.0.0.1:{port}", "upstream": f"127.0.0.1:{upstream_port}",
        })
        p = self.profile
        for stream in ("upstream", "downstream"):
            if p["latency_ms"]:
                self._call("POST", f"/proxies/{name}/toxics", {
                    "name": f"lat_{stream}", "type": "latency", "stream": stream,
                    "attributes": {"latency": p["latency_ms"], "jitter": 0},
                })
            if p["rate_kbs"]:
                self._call("POST", f"/proxies/{name}/toxics", {
                    "name": f"bw_{stream}", "type": "bandwidth", "stream": stream,
                    "attributes": {"rate": p["rate_kbs"]},
                })
        self.names.append(name)
        return port

    def _bytes(self):
        total = 0
        for line in self._call("GET", "/metrics").splitlines():
            if line.startswith("toxiproxy_proxy_received_bytes_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def bytes(self):
        """Bytes carried so far by every proxy, both directions, once the counters stop
        moving (toxiproxy counts a chunk when it has passed the toxics, so the last
        frames of a run that just ended can still be on their way)."""
        last = self._bytes()
        for _ in range(50):
            time.sleep(0.3)
            now = self._bytes()
            if now == last:
                return now
            last = now
        return last


def http_ready(port, proc, what, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} was not ready within {timeout} s")


def per_token_bytes(tox, a, b, generate):
    """Bytes on every link per generated token: `generate(n)` runs a generation of n
    tokens; the difference between runs of `a` and `b` tokens cancels loading and warm-up."""
    used = []
    for n in (a, b):
        before = tox.bytes()
        generate(n)
        used.append(tox.bytes() - before)
    return (used[1] - used[0]) / (b - a)


def run(args, timeout):
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{Path(str(args[0])).name} failed ({out.returncode}): {out.stderr[-800:]}")
    return out.stdout


# ---------------------------------------------------------------- llama.cpp RPC


class Rpc:
    """N ggml-rpc-servers behind shaped proxies."""

    def __init__(self, opts, profile, model, n):
        self.opts, self.profile, self.model, self.n = opts, profile, ROOT / model, n
        self.cache = Path(tempfile.mkdtemp(prefix="rpc-cache-"))

    def cluster(self, procs, cache):
        tox = Toxiproxy(procs, self.profile)
        exe = PEER / "ggml-rpc-server"
        env = dict(os.environ, LLAMA_CACHE=str(self.cache))
        dial = []
        for _ in range(self.n):
            port = free_port()
            proc = procs.start([exe, "-t", 1, "-H", "127.0.0.1", "-p", port] + (["-c"] if cache else []), env=env)
            wait_port(port, proc, "ggml-rpc-server")
            dial.append(f"127.0.0.1:{tox.proxy(port)}")
        return tox, ",".join(dial)

    def ready(self, cache):
        procs = Procs()
        try:
            _, dial = self.cluster(procs, cache)
            port = free_port()
            start = time.monotonic()
            srv = procs.start([PEER / "llama-server", "-m", self.model, "--rpc", dial, "-ngl", 99, "-t", 1,
                               "-c", 4096, "--host", "127.0.0.1", "--port", port])
            http_ready(port, srv, "llama-server", self.opts.timeout)
            return time.monotonic() - start
        finally:
            procs.stop()

    def bench(self, pp, tg, reps):
        procs = Procs()
        try:
            _, dial = self.cluster(procs, cache=True)
            out = run([PEER / "llama-bench", "-m", self.model, "--rpc", dial, "-ngl", 99, "-t", 1,
                       "-p", pp, "-n", tg, "-r", reps, "-o", "csv"], self.opts.timeout)
            rows = list(csv.DictReader(out[out.index("build_commit"):].splitlines()))
            rate = lambda key: next(float(r["avg_ts"]) for r in rows if int(r[key]) > 0)
            return rate("n_prompt"), rate("n_gen")
        finally:
            procs.stop()

    def speculative(self, prompts, tokens, reps):
        """{kind: {mode: (tok/s, text)}}: llama-server over RPC without speculation and
        with its own n-gram speculation (`--spec-type ngram-simple`)."""
        modes = {"off": ["--spec-type", "none"],
                 "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", 3,
                           "--spec-ngram-simple-size-m", 8, "--spec-draft-n-max", 8]}
        out = {kind: {} for kind in prompts}
        for mode, flags in modes.items():
            procs = Procs()
            try:
                _, dial = self.cluster(procs, cache=True)
                port = free_port()
                srv = procs.start([PEER / "llama-server", "-m", self.model, "--rpc", dial, "-ngl", 99, "-t", 1,
                                   "-c", 4096, "--host", "127.0.0.1", "--port", port, *flags])
                http_ready(port, srv, "llama-server", self.opts.timeout)
                for kind, prompt in prompts.items():
                    runs = [llama_server_completion(port, prompt, tokens, self.opts.timeout) for _ in range(reps)]
                    out[kind][mode] = max(runs)
            finally:
                procs.stop()
        return out

    def bytes_per_token(self, a, b):
        procs = Procs()
        try:
            tox, dial = self.cluster(procs, cache=True)
            # Fill the servers' -c caches first, or the first run carries the weights.
            run([PEER / "llama-bench", "-m", self.model, "--rpc", dial, "-ngl", 99, "-t", 1,
                 "-p", 0, "-n", 1, "-r", 1, "-o", "csv"], self.opts.timeout)
            return per_token_bytes(tox, a, b, lambda n: run(
                [PEER / "llama-bench", "-m", self.model, "--rpc", dial, "-ngl", 99, "-t", 1,
                 "-p", 0, "-n", n, "-r", 1, "-o", "csv"], self.opts.timeout))
        finally:
            procs.stop()


def llama_server_completion(port, prompt, tokens, timeout):
    """(generation tok/s, text) from llama-server's own timings of a greedy completion."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.load(r)
    return reply["timings"]["predicted_per_second"], reply["content"]


# ---------------------------------------------------------------- baton


class Baton:
    """N baton workers behind shaped proxies; the head computes nothing."""

    def __init__(self, opts, profile, model, n):
        self.opts, self.profile, self.model, self.n = opts, profile, ROOT / model, n
        # Layers split evenly over the workers, as llama.cpp RPC splits them over equal
        # servers (left to itself, baton's planner may use fewer nodes for a small model).
        layers = N_LAYERS[model]
        self.split = ",".join(str(layers // n + (i < layers % n)) for i in range(n))

    def cluster(self, procs, local_file, state):
        tox = Toxiproxy(procs, self.profile)
        dial = []
        for i in range(self.n):
            if state is not None and i < len(state):
                models = state[i]
            else:
                models = Path(tempfile.mkdtemp(prefix="baton-worker-"))
                self.dirs.append(models)
                if local_file:
                    os.link(self.model, models / self.model.name)
            port = free_port()
            proxy = tox.proxy(port)
            proc = procs.start([BATON, "worker", "--listen", f"127.0.0.1:{port}", "--advertise",
                                f"127.0.0.1:{proxy}", "--models", models, "--threads", 1])
            wait_port(port, proc, "baton worker")
            dial.append(f"127.0.0.1:{proxy}")
        return tox, ",".join(dial)

    def session(fn):
        """Runs `fn` on a fresh cluster. Workers get new, empty models directories
        (holding a link to the GGUF when `local_file`), removed afterwards; or, with
        `state` (a list the first such session fills), the directories of that session,
        with the state it left (speed measurement, streamed tensors)."""
        def wrapped(self, *args, local_file=True, state=None):
            procs = Procs()
            self.dirs = []
            try:
                return fn(self, procs, *self.cluster(procs, local_file, state), *args)
            finally:
                procs.stop()
                if state is not None and not state:
                    state.extend(self.dirs)
                else:
                    for d in self.dirs:
                        shutil.rmtree(d, ignore_errors=True)
        return wrapped

    def head(self, dial):
        # The context llama-server gets (-c 4096): baton's default is the model's trained
        # context for each of --parallel sequences, a KV cache of several hundred MB per
        # stage to allocate before it is ready.
        return ["--model", self.model, "--workers", dial, "--no-head-stage",
                "--split", self.split, "--threads", 1, "--ctx-size", 4096]

    @session
    def ready(self, procs, tox, dial):
        start = time.monotonic()
        srv = procs.start([BATON, "serve", *self.head(dial), "--port", 0, "--host", "127.0.0.1"],
                          stdout=subprocess.PIPE, text=True)
        line = srv.stdout.readline()
        if not line.startswith("listening on"):
            raise RuntimeError(f"baton serve did not start: {line!r}")
        return time.monotonic() - start

    @session
    def bench(self, procs, tox, dial, pp, tg, reps):
        out = run([BATON, "bench", *self.head(dial), "--pp", pp, "--tg", tg, "--reps", reps, "--llama-bench", "none"],
                  self.opts.timeout)
        cell = lambda test, col: float(next(l for l in out.splitlines() if l.startswith(f"| {test}")).split("|")[col])
        return cell(f"pp{pp}", 2), cell(f"tg{tg}", 2), cell(f"pp{pp}", 3), cell(f"tg{tg}", 3)

    @session
    def bytes_per_token(self, procs, tox, dial, a, b):
        # bench's generation ignores end-of-text, so both runs generate exactly n tokens.
        return per_token_bytes(tox, a, b, lambda n: run(
            [BATON, "bench", *self.head(dial), "--pp", 8, "--tg", n, "--reps", 1, "--llama-bench", "none"],
            self.opts.timeout))

    @session
    def streams(self, procs, tox, dial, n, tokens):
        srv = procs.start([BATON, "serve", *self.head(dial), "--port", 0, "--host", "127.0.0.1",
                           "--parallel", n], stdout=subprocess.PIPE, text=True)
        line = srv.stdout.readline()
        if not line.startswith("listening on"):
            raise RuntimeError(f"baton serve did not start: {line!r}")
        url = line.split()[-1]
        run([sys.executable, ROOT / "bench/load.py", "streams", url, 1, "--tokens", 8], self.opts.timeout)
        out = run([sys.executable, ROOT / "bench/load.py", "streams", url, n, "--tokens", tokens], self.opts.timeout)
        return json.loads(out)["tokens_per_s"]


    @session
    def speculative(self, procs, tox, dial, prompts, tokens, reps):
        """{kind: {mode: (tok/s, text)}} for modes off and ngram, per-request, one server."""
        srv = procs.start([BATON, "serve", *self.head(dial), "--port", 0, "--host", "127.0.0.1", "--draft", "ngram",
                           "--draft-max", 8], stdout=subprocess.PIPE, text=True)
        line = srv.stdout.readline()
        if not line.startswith("listening on"):
            raise RuntimeError(f"baton serve did not start: {line!r}")
        url = line.split()[-1]
        out = {}
        for kind, prompt in prompts.items():
            out[kind] = {}
            for mode in ("off", "ngram"):
                runs = [baton_stream(url, prompt, tokens, mode, self.opts.timeout) for _ in range(reps)]
                out[kind][mode] = max(runs)
        return out


def baton_stream(url, prompt, tokens, draft, timeout):
    """(generation tok/s, text) of a greedy streamed completion: tokens after the first
    over the time after the first arrived (the prompt's time left out)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "draft": draft}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, stamps = "", []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            stamps.append(time.monotonic())
            text += piece
    # One event per token (the first may be empty text held back; it still counts).
    n = len(stamps)
    return ((n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0), text


# The speculative-decoding scenario: a code-editing request (the answer repeats much of
# the prompt, where prompt-lookup drafts hit) and free text (where they rarely do), as
# raw ChatML for the qwen2 coder model.
def chatml(user):
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


SPEC_CODE = """def summarize(orders):
    total = 0
    count = 0
    largest = None
    for order in orders:
        amount = order["amount"]
        total = total + amount
        count = count + 1
        if largest is None or amount > largest:
            largest = amount
    average = total / count if count else 0
    return {"total": total, "count": count, "largest": largest, "average": average}
"""
SPEC_PROMPTS = {
    "code edit": chatml(f"Here is a Python function:\n\n```python\n{SPEC_CODE}```\n\nRename the variable `total` to "
                        "`revenue` everywhere and return the whole function."),
    "free text": chatml("Write a short story about a lighthouse keeper who finds a message in a bottle."),
}


# ---------------------------------------------------------------- the suite


def measure(opts, profile_name, model_key, n):
    """Rows (metric, baton, rpc) for one model and node count on one profile."""
    profile = PROFILES[profile_name]
    model = MODELS[model_key]
    rpc, baton = Rpc(opts, profile, model, n), Baton(opts, profile, model, n)
    rows = []

    def row(metric, unit, b, r, better, extra=None):
        rows.append({"profile": profile_name, "model": model_key, "nodes": n, "metric": metric, "unit": unit,
                     "baton": b, "rpc": r, "better": better, **(extra or {})})
        log(f"  {metric}: baton {b} rpc {r}")

    log(f"{profile_name} {model_key} {n} nodes")
    want = lambda part: not opts.only or part in opts.only
    if want("ready"):
        measure_ready(rpc, baton, row)
    if want("speed"):
        b_pp, b_tg, l_pp, l_tg = baton.bench(opts.pp, opts.tg, opts.reps)
        r_pp, r_tg = rpc.bench(opts.pp, opts.tg, opts.reps)
        row(f"generation tok/s (tg{opts.tg})", "tok/s", b_tg, round(r_tg, 2), "higher", {"libllama": l_tg})
        row(f"prompt tok/s (pp{opts.pp})", "tok/s", b_pp, round(r_pp, 2), "higher", {"libllama": l_pp})
    if want("bytes"):
        a, b = opts.bytes_tokens
        row("bytes on the wire per generated token", "B", round(baton.bytes_per_token(a, b)),
            round(rpc.bytes_per_token(a, b)), "lower")
    if want("spec") and model_key == "qwen2" and opts.spec:
        reps = max(2, opts.reps)
        b = baton.speculative(SPEC_PROMPTS, opts.tg, reps)
        r = rpc.speculative(SPEC_PROMPTS, opts.tg, reps)
        for kind in SPEC_PROMPTS:
            (b_off, b_text), (b_on, b_spec_text) = b[kind]["off"], b[kind]["ngram"]
            (r_off, _), (r_on, _) = r[kind]["off"], r[kind]["ngram"]
            same = "same text" if b_text == b_spec_text else "TEXT DIFFERS"
            row(f"{kind}: generation tok/s, no speculation", "tok/s", round(b_off, 2), round(r_off, 2), "higher")
            row(f"{kind}: generation tok/s, n-gram speculation", "tok/s", round(b_on, 2), round(r_on, 2), "higher",
                {"note": f"baton {b_on / b_off:.2f}x without ({same}); RPC {r_on / r_off:.2f}x without; "
                         f"baton with / RPC without {b_on / r_off:.2f}x"})
    if want("streams") and opts.streams:
        one = baton.streams(1, opts.tg)
        agg = baton.streams(opts.streams, opts.tg)
        row(f"{opts.streams} concurrent streams, aggregate tok/s", "tok/s", round(agg, 2), None, "higher",
            {"note": f"{agg / one:.2f}x one stream ({one:.1f} tok/s) through the same server"})
    shutil.rmtree(rpc.cache, ignore_errors=True)
    return rows


def measure_ready(rpc, baton, row):
    # Cold: nothing cached anywhere. RPC: servers without -c. baton: workers whose models
    # directory holds just the GGUF (baton's deployment: every node has the file), no
    # state of baton's (the speed self-benchmark runs). The OS page cache is warm for
    # both systems alike (this container cannot drop it).
    rpc_cold = round(rpc.ready(cache=False), 2)
    state = []
    row("ready, cold (s)", "s", round(baton.ready(state=state), 2), rpc_cold, "lower")
    # The same without the file on the workers: the head streams each its layers.
    row("ready, cold, workers without the file (s)", "s", round(baton.ready(local_file=False), 2), rpc_cold, "lower")
    # Warm: RPC's -c cache filled (by the run before); baton's workers with the state
    # the cold start left.
    rpc.ready(cache=True)
    try:
        row("ready, warm (s)", "s", round(baton.ready(state=state), 2), round(rpc.ready(cache=True), 2), "lower")
    finally:
        for d in state:
            shutil.rmtree(d, ignore_errors=True)


def ratio(r):
    if r["rpc"] in (None, 0) or r["baton"] in (None, 0):
        return None
    return r["baton"] / r["rpc"]


def commit():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def merge(profile, rows, out_dir):
    """Rows of the newest CSV of this profile with `rows` in place of the ones they re-measure."""
    files = sorted(out_dir.glob(f"*-{profile}.csv"))
    if not files:
        return rows
    key = lambda r: (r["model"], str(r["nodes"]), r["metric"])
    new = {key(r): r for r in rows}
    with open(files[-1]) as f:
        old = [{**r, "baton": num(r["baton"]), "rpc": num(r["rpc"])} for r in csv.DictReader(f)]
    merged = [new.pop(key(r), r) for r in old]
    return merged + list(new.values())


def num(text):
    return None if text in ("", None) else float(text)


def write(profile, rows, opts, started, out_dir):
    stamp = datetime.date.today().isoformat()
    base = out_dir / f"{stamp}-{profile}"
    if opts.only:
        rows = merge(profile, rows, out_dir)
    fields = ["profile", "model", "nodes", "metric", "unit", "baton", "rpc", "ratio", "better", "libllama", "note"]
    with open(f"{base}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "ratio": None if ratio(r) is None else round(ratio(r), 3)})
    p = PROFILES[profile]
    shaping = "no shaping" if p["latency_ms"] is None else (
        f"{p['latency_ms']} ms added each way (nominal {p['nominal_ms']} ms), {p['rate_kbs'] / 1000:g} MB/s each way")
    lines = [
        f"# baton vs llama.cpp RPC: {profile}",
        "",
        f"commit {commit()}, {started}, {os.cpu_count()} cores, {time.monotonic() - opts.t0:.0f} s for the run.",
        f"Link: toxiproxy, {shaping}, on every link between nodes (RPC: host to each rpc-server; baton: head to",
        "each worker and worker to worker). Each node one process with 1 thread; the RPC host and the baton head",
        f"compute nothing. Generation {opts.tg} tokens, prompt {opts.pp} tokens, {opts.reps} repetition(s);",
        "bytes per token from toxiproxy's byte counters, all links together. ratio = baton / RPC",
        "(for times and bytes lower is better, so a ratio below 1 is baton ahead).",
        *([f"Rows re-measured by this run: {', '.join(opts.only)} (`--only`); the others are from the run before."]
          if opts.only else []),
        "",
        "| model | nodes | metric | baton | llama.cpp RPC | ratio | libllama 1 process |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        rt = ratio(r)
        lines.append(f"| {r['model']} | {r['nodes']} | {r['metric']} | {r['baton']} | "
                     f"{'' if r['rpc'] is None else r['rpc']} | {'' if rt is None else f'{rt:.3g}'} | "
                     f"{r.get('libllama', '') or r.get('note', '')} |")
    targets = compass(profile, rows)
    if targets:
        lines += ["", "## Targets", "", "| target | measured | pass |", "|---|---|---|"] + targets
    Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {base}.md and {base}.csv")


def compass(profile, rows):
    out = []

    def check(name, metric, want, cmp):
        for r in rows:
            if r["metric"].startswith(metric) and ratio(r) is not None:
                rt = ratio(r)
                ok = rt >= want if cmp == ">=" else rt <= want
                out.append(f"| {name} ({r['model']}, {r['nodes']} nodes) | {rt:.3g} | {'yes' if ok else 'no'} |")

    if profile == "wifi":
        check("generation >= 2x RPC", "generation tok/s (tg", 2.0, ">=")
        for r in rows:
            if r["metric"] == "code edit: generation tok/s, n-gram speculation" and r["note"]:
                m = re.search(r"baton ([0-9.]+)x without.*baton with / RPC without ([0-9.]+)x", r["note"])
                if m:
                    own, rpc = float(m.group(1)), float(m.group(2))
                    out.append(f"| code edit, speculation >= 2x baton without ({r['model']}, {r['nodes']} nodes) | "
                               f"{own:.3g} | {'yes' if own >= 2 else 'no'} |")
                    out.append(f"| code edit, speculation >= 3x RPC ({r['model']}, {r['nodes']} nodes) | "
                               f"{rpc:.3g} | {'yes' if rpc >= 3 else 'no'} |")
        check("cold time-to-ready <= 0.1x RPC", "ready, cold (", 0.1, "<=")
    if profile == "loopback":
        check("generation >= 1.2x RPC", "generation tok/s (tg", 1.2, ">=")
    return out


def plot(out_dir):
    """Plots from the newest CSV of each profile in out_dir."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for profile in PROFILES:
        files = sorted(out_dir.glob(f"*-{profile}.csv"))
        if files:
            with open(files[-1]) as f:
                rows += list(csv.DictReader(f))
    if not rows:
        return
    profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
    configs = sorted({(r["model"], r["nodes"]) for r in rows})
    metrics = [("generation", "generation"), ("prompt", "prompt"), ("ready, cold (", "ready cold"),
               ("ready, warm", "ready warm")]

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4), sharey=False)
    width = 0.8 / max(1, len(configs))
    for ax, (prefix, title) in zip(axes, metrics):
        for i, (model, nodes) in enumerate(configs):
            ys = []
            for p in profiles:
                r = next((r for r in rows if r["profile"] == p and r["model"] == model and r["nodes"] == nodes
                          and r["metric"].startswith(prefix) and r["ratio"]), None)
                ys.append(float(r["ratio"]) if r else 0)
            ax.bar([x + i * width for x in range(len(profiles))], ys, width, label=f"{model}, {nodes} nodes")
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(profiles))], profiles)
        ax.set_title(f"{title}: baton / RPC" + (" (lower is better)" if "ready" in prefix else ""))
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "ratios.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, nodes in configs:
        for system, style in (("baton", "-o"), ("rpc", "--s")):
            pts = []
            for p in profiles:
                r = next((r for r in rows if r["profile"] == p and r["model"] == model and r["nodes"] == nodes
                          and r["metric"].startswith("generation")), None)
                if r and r[system]:
                    pts.append((PROFILES[p]["nominal_ms"], float(r[system])))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{'baton' if system == 'baton' else 'llama.cpp RPC'} {model} {nodes}n")
    ax.set_xscale("symlog", linthresh=0.25)
    ax.set_xlabel("link latency each way, ms (loopback, lan, wifi, wan)")
    ax.set_ylabel("generation tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "tokens-vs-latency.png", dpi=110)
    plt.close(fig)
    log(f"wrote {out_dir / 'ratios.png'} and {out_dir / 'tokens-vs-latency.png'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", choices=list(PROFILES), help="a link profile (repeatable)")
    ap.add_argument("--all", action="store_true", help="every profile")
    ap.add_argument("--smoke", action="store_true", help="one short scenario on loopback (what CI runs)")
    ap.add_argument("--models", default="qwen2,gemma3")
    ap.add_argument("--nodes", default="2,3")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams for baton (0: skip)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--spec", type=int, default=1, help="the speculative-decoding scenario (qwen2 only; 0: skip)")
    ap.add_argument("--only", action="append", choices=["ready", "speed", "bytes", "streams", "spec"],
                    help="measure only these scenarios, replacing their rows in the profile's newest results")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plots from the CSVs in --out")
    opts = ap.parse_args()
    opts.t0 = time.monotonic()
    opts.bytes_tokens = (8, 24)
    if opts.plot_only:
        plot(opts.out)
        return
    if opts.smoke:
        opts.profile, opts.models, opts.nodes = ["loopback"], "gemma3", "2"
        opts.tg, opts.pp, opts.streams, opts.spec = 16, 32, 2, 0
        opts.out = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    profiles = list(PROFILES) if opts.all else (opts.profile or ["loopback"])
    opts.out.mkdir(parents=True, exist_ok=True)
    for profile in profiles:
        t0 = time.monotonic()
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        opts.t0 = t0
        rows = []
        for model in opts.models.split(","):
            for n in (int(x) for x in opts.nodes.split(",")):
                rows += measure(opts, profile, model, n)
        write(profile, rows, opts, started, opts.out)
        print(Path(f"{opts.out}/{datetime.date.today().isoformat()}-{profile}.md").read_text())
    if not opts.smoke:
        plot(opts.out)
    else:
        bad = [r for r in rows if r["baton"] in (None, 0) or (r["rpc"] == 0)]
        if bad:
            sys.exit(f"smoke: empty measurements: {bad}")
        print("smoke: 1 passed, 0 failed")


if __name__ == "__main__":
    main()
