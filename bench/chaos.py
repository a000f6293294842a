"""Chaos mode of bench/soak (`bench/soak --chaos`): `baton serve` over worker processes
on loopback while the script kills (SIGKILL, then a restart on the same address) and
stops (SIGSTOP, then SIGCONT) workers at random, one at a time, under mixed concurrent
requests. Standard library only.

Layouts: `pp`, three workers each holding a pipeline stage (`--workers W1,W2,W3
--no-head-stage`); `tp`, four workers in tensor-parallel groups of two (`--tp 2`), so
a disrupted worker is a group member. The head itself is never disrupted (its own
loss is not recovered, docs/cluster.md).

Checks:
- same tokens: every request is one of a reference set run alone, one at a time, on the
  whole ring before the chaos starts; a completed answer must have the reference's
  text, completion_tokens and finish_reason (greedy requests, and seeded sampled ones,
  whose draws the recovery replays); the text of a failed or cancelled stream must be a
  prefix of the reference's;
- a clear end: each request completes, or gets an HTTP error with an OpenAI error body,
  or a stream `error` event; a request still open after --request-deadline seconds is a
  hang, a stream that ends without `[DONE]` or an error event is a silent truncation,
  a connection closed without an answer is an unclear end;
- at the end, idle, over the whole ring again: no file descriptors more than at the
  start in the head and in each worker never killed (/proc/PID/fd), the slot sweep of
  the plain soak (exact KV cells per stage, /stats), and anonymous memory (RssAnon; the
  model's mapped file pages come and go with the plan) grown by at most
  --max-anon-growth-mib in each of those processes;
- no process but the killed ones died, no panic in any log.
"""
import datetime
import http.client
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# Filled by run(): the bench/soak module (its Client, sweep, wait_idle, ...).
soak = None


def log(msg):
    soak.log(msg)


def proc_status(pid, key):
    """A field of /proc/PID/status in KiB (VmRSS, RssAnon), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def fd_count(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def gguf_block_count(path):
    """`<architecture>.block_count` from a GGUF file's header (the layers to split)."""
    import struct
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(read("Q")).decode(errors="replace")

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                item, n = read("I"), read("Q")
                if item in sizes:
                    f.seek(sizes[item] * n, 1)
                else:
                    for _ in range(n):
                        value(item)
                return None
            return struct.unpack("<" + {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                                        11: "q", 12: "d"}[kind], f.read(sizes[kind]))[0]

        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path} is not a GGUF file")
        read("I")
        read("Q")
        kv = {}
        for _ in range(read("Q")):
            key = string()
            kv[key] = value(read("I"))
            arch = kv.get("general.architecture")
            if arch and f"{arch}.block_count" in kv:
                return kv[f"{arch}.block_count"]
    raise SystemExit(f"{path} has no block_count")


def even_split(n_layer, parts):
    """`--split` giving each of `parts` nodes a share of `n_layer` layers (the planner
    would otherwise leave a worker out of a small model, and the chaos would miss it)."""
    return ",".join(str(n_layer // parts + (i < n_layer % parts)) for i in range(parts))


# ---------------------------------------------------------------------------------------
# Processes


class Worker:
    """One `baton worker` on 127.0.0.1; its address stays the same across restarts."""

    def __init__(self, name, args, env, logdir):
        self.name, self.args, self.env, self.logdir = name, args, env, logdir
        self.addr = "127.0.0.1:0"
        self.generation = 0
        self.proc = None
        self.first_pid = None
        self.killed = False
        self.stopped = False
        self.start()
        self.first_pid = self.proc.pid

    def start(self):
        self.generation += 1
        log_path = Path(self.logdir) / f"{self.name}.{self.generation}.log"
        self.log_file = open(log_path, "wb")
        command = [str(soak.BATON), "worker", "--listen", self.addr, "--models", str(Path(self.args.model).parent),
                   "--threads", "1"]
        deadline = time.monotonic() + 30
        while True:
            self.proc = subprocess.Popen(command, cwd=soak.ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=self.log_file)
            line = self.proc.stdout.readline().decode().strip()
            if line.startswith("listening on "):
                break
            # The old socket's port may not be free yet for a moment after a kill.
            self.proc.wait()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start again on {self.addr}: {line!r}; see {log_path}")
            time.sleep(0.5)
        self.addr = line.removeprefix("listening on ")
        # Drain stdout so that the worker never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def logs(self):
        return "\n".join(p.read_text(errors="replace") for p in sorted(Path(self.logdir).glob(f"{self.name}.*.log")))

    def close(self):
        if self.proc.poll() is None:
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.log_file.close()


class Head:
    """`baton serve --workers ...` on 127.0.0.1, port 0."""

    def __init__(self, args, workers, env, logdir):
        self.log_path = Path(logdir) / "serve.log"
        self.log_file = open(self.log_path, "wb")
        self.command = [str(soak.BATON), "serve", "--model", args.model, "--workers",
                        ",".join(w.addr for w in workers), "--no-head-stage", "--host", "127.0.0.1", "--port", "0",
                        "--parallel", str(args.parallel), "--ctx-size", str(args.ctx_size), "-t", "1"]
        n_layer = gguf_block_count(soak.ROOT / args.model)
        if args.layout == "tp":
            self.command += ["--tp", "2", "--split", even_split(n_layer, len(workers) // 2)]
        else:
            self.command += ["--split", even_split(n_layer, len(workers))]
        self.command += args.serve_arg
        log("starting " + " ".join(self.command[1:]))
        self.proc = subprocess.Popen(self.command, cwd=soak.ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self.log_file)
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"baton serve printed {line!r}; see {self.log_path}")
        self.url = line.removeprefix("listening on ")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """SIGTERM; the exit code (or a note that it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = f"killed after 20 s ({self.proc.wait()})"
        self.log_file.close()
        return code


# ---------------------------------------------------------------------------------------
# Requests


def make_reference_specs(args, slot_ctx, model_id):
    """The distinct requests of the run: chat and completions, greedy and seeded, some
    sharing a prefix (so that recovery rebuilds cached prefixes too)."""
    rng = random.Random(f"chaos:{args.seed}")
    specs = []
    for i in range(args.distinct):
        chat = i % 2 == 0
        max_tokens = rng.randint(8, args.max_tokens)
        prefix = rng.choice(soak.PREFIXES[:2]) if rng.random() < 0.4 else None
        ask = rng.choice(soak.ASKS).format(soak.words(rng, rng.randint(3, 40)))
        body = {"max_tokens": max_tokens}
        if rng.random() < 0.6:
            body["temperature"] = 0
        else:
            body["temperature"] = round(rng.uniform(0.5, 1.1), 2)
            body["seed"] = rng.randint(0, 2**31)
            if rng.random() < 0.5:
                body["top_k"] = 40
        if chat:
            messages = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": ask}]
            body["messages"] = messages
        else:
            body["prompt"] = f"{prefix} {ask}" if prefix else ask
        specs.append({"ref": i, "path": "/v1/chat/completions" if chat else "/v1/completions", "chat": chat,
                      "body": body, "greedy": body["temperature"] == 0, "max_tokens": max_tokens})
    return specs


class Outcome:
    """What one request got."""

    def __init__(self, spec, stream, cancel_after):
        self.spec, self.stream, self.cancel_after = spec, stream, cancel_after
        self.kind = None  # ok, cancelled, http_error, stream_error, hang, truncated, unclear
        self.text = ""
        self.completion_tokens = None
        self.finish_reason = None
        self.status = None
        self.detail = None
        self.seconds = None
        self.started = None


def send(client, spec, stream, cancel_after, deadline):
    """Sends one request; an Outcome. A watchdog closes the socket at `deadline` seconds."""
    out = Outcome(spec, stream, cancel_after)
    body = dict(spec["body"])
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    out.started = time.monotonic()
    conn = client.connect(timeout=deadline)
    fired = threading.Event()

    def watchdog():
        fired.set()
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass

    timer = threading.Timer(deadline, watchdog)
    timer.start()
    try:
        conn.request("POST", spec["path"], json.dumps(body), client.headers)
        response = conn.getresponse()
        out.status = response.status
        if response.status != 200:
            raw = response.read()
            try:
                error = json.loads(raw)["error"]
                clear = isinstance(error.get("message"), str) and error["message"] != ""
            except (ValueError, KeyError, TypeError, AttributeError):
                clear = False
            out.kind = "http_error" if clear else "unclear"
            out.detail = raw[:300].decode(errors="replace")
        elif stream:
            read_stream(response, conn, out)
        else:
            answer = json.loads(response.read())
            choice = answer["choices"][0]
            out.text = choice["message"]["content"] if spec["chat"] else choice["text"]
            out.finish_reason = choice["finish_reason"]
            out.completion_tokens = answer["usage"]["completion_tokens"]
            out.kind = "ok"
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
        if out.kind is None:
            out.kind = "hang" if fired.is_set() else "unclear"
            out.detail = f"{type(e).__name__}: {e}"
    finally:
        timer.cancel()
        conn.close()
        out.seconds = time.monotonic() - out.started
    if fired.is_set() and out.kind not in ("ok", "cancelled"):
        out.kind = "hang"
    return out


def read_stream(response, conn, out):
    tokens = 0
    for raw in response:
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.kind = "ok" if out.finish_reason else "truncated"
            if out.kind == "truncated":
                out.detail = "[DONE] without a finish_reason"
            return
        event = json.loads(data)
        if "error" in event:
            out.kind = "stream_error"
            out.detail = json.dumps(event)[:300]
            return
        if event.get("usage"):
            out.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content") if out.spec["chat"] else choice.get("text")
            if piece:
                out.text += piece
                tokens += 1
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
        if out.cancel_after is not None and tokens >= out.cancel_after and not out.finish_reason:
            response.close()
            conn.close()
            out.kind = "cancelled"
            return
    out.kind = "truncated"
    out.detail = f"the stream ended after {tokens} text chunks without [DONE] or an error event"


def compare(out, ref):
    """A problem string when `out` contradicts the reference answer, else None."""
    if out.kind == "ok":
        if out.text != ref.text or out.completion_tokens != ref.completion_tokens \
                or out.finish_reason != ref.finish_reason:
            return (f"changed: {out.completion_tokens} tokens {out.finish_reason} {out.text[:80]!r} vs reference "
                    f"{ref.completion_tokens} tokens {ref.finish_reason} {ref.text[:80]!r}")
    elif out.kind in ("cancelled", "stream_error", "truncated", "hang") and out.text:
        if not ref.text.startswith(out.text):
            return f"changed before the end: {out.text[:80]!r} is not a prefix of the reference {ref.text[:80]!r}"
    return None


# ---------------------------------------------------------------------------------------
# Chaos


class Chaos(threading.Thread):
    """Disrupts one worker at a time until `until` (a monotonic time): kill and restart,
    or stop and continue, then a pause."""

    def __init__(self, workers, rng, until, args, head_pid):
        super().__init__(daemon=True)
        self.workers, self.rng, self.until, self.args = workers, rng, until, args
        self.head_pid = head_pid
        self.head_anon = []  # (seconds since start, the head's RssAnon in KiB) after each disruption
        self.events = []  # (seconds since start, what)
        self.t0 = time.monotonic()
        self.error = None

    def note(self, what):
        self.events.append((time.monotonic() - self.t0, what))
        log(f"chaos: {what}")
        if what.startswith(("restarted", "SIGCONT")):
            self.head_anon.append((time.monotonic() - self.t0, proc_status(self.head_pid, "RssAnon")))

    def wait(self, seconds):
        time.sleep(max(0.0, min(seconds, self.until - time.monotonic())))

    def run(self):
        try:
            self.wait(self.rng.uniform(3, 8))
            while time.monotonic() < self.until:
                worker = self.rng.choice(self.workers)
                # The first worker is only ever stopped: it lives through every ring
                # formed, and its descriptors and memory are compared at the end.
                if self.rng.random() < 0.5 and worker is not self.workers[0]:
                    down = self.rng.uniform(1, 8)
                    os.kill(worker.pid, signal.SIGKILL)
                    worker.proc.wait()
                    worker.killed = True
                    self.note(f"SIGKILL {worker.name} (pid {worker.pid}); restart in {down:.1f} s")
                    time.sleep(down)
                    worker.start()
                    self.note(f"restarted {worker.name} on {worker.addr} (pid {worker.pid})")
                else:
                    down = self.rng.uniform(0.5, 6)
                    os.kill(worker.pid, signal.SIGSTOP)
                    worker.stopped = True
                    self.note(f"SIGSTOP {worker.name} (pid {worker.pid}) for {down:.1f} s")
                    time.sleep(down)
                    os.kill(worker.pid, signal.SIGCONT)
                    worker.stopped = False
                    self.note(f"SIGCONT {worker.name}")
                self.wait(self.rng.uniform(self.args.chaos_pause / 2, self.args.chaos_pause * 1.5))
        except Exception as e:  # noqa: BLE001 - reported as a failure of the run
            self.error = f"{type(e).__name__}: {e}"
            log(f"chaos thread failed: {self.error}")


def load(client, specs, clients, until, args, rng_seed):
    """`clients` threads sending requests from `specs` until `until`; the Outcomes."""
    outcomes, lock = [], threading.Lock()

    def client_thread(k):
        rng = random.Random(f"{rng_seed}:{k}")
        while time.monotonic() < until:
            spec = rng.choice(specs)
            stream = rng.random() < 0.5
            cancel_after = rng.randint(1, max(1, spec["max_tokens"] - 1)) if stream and rng.random() < 0.1 else None
            out = send(client, spec, stream, cancel_after, args.request_deadline)
            with lock:
                outcomes.append(out)
            if out.kind in ("http_error",) and out.status == 503:
                time.sleep(0.5)  # no ring now: do not spin

    threads = [threading.Thread(target=client_thread, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    last = time.monotonic()
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.monotonic() - last >= 20:
            last = time.monotonic()
            with lock:
                kinds = {}
                for o in outcomes:
                    kinds[o.kind] = kinds.get(o.kind, 0) + 1
            log(f"{sum(kinds.values())} requests: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())))
    for t in threads:
        t.join()
    return outcomes


def concurrent_once(client, specs, args):
    """Each spec once, --clients at a time (whole answers); the Outcomes."""
    pending, outcomes, lock = list(specs), [], threading.Lock()

    def client_thread():
        while True:
            with lock:
                if not pending:
                    return
                spec = pending.pop()
            out = send(client, spec, False, None, args.request_deadline)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def wait_whole(client, n_stages, timeout):
    """Waits for /health ok, nothing lost, nothing running and `n_stages` stages (any
    number when None); (whether it came, the last answer)."""
    deadline = time.monotonic() + timeout
    health = None
    while time.monotonic() < deadline:
        try:
            status, health = client.get("/health")
        except OSError as e:
            status, health = None, str(e)
        if status == 200 and isinstance(health, dict) and not health.get("lost") and not health.get("active") \
                and not health.get("queued") and (n_stages is None or len(health.get("stages", [])) == n_stages):
            return True, health
        time.sleep(1.0)
    return False, health


def settle(measure, pids, start, timeout=15):
    """Polls `measure` until no pid is above its start value (or the timeout); the last values."""
    deadline = time.monotonic() + timeout
    while True:
        now = {pid: measure(pid) for pid in pids}
        if all(now[p] is not None and start.get(p) is not None and now[p] <= start[p] for p in pids) \
                or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def run(args, soak_module):
    """The chaos soak; returns the exit code."""
    global soak
    soak = soak_module
    started = time.monotonic()
    budget_end = started + args.minutes * 60
    if not soak.BATON.exists():
        raise SystemExit(f"{soak.BATON} is missing: build it with `cargo build --release`")
    logdir = tempfile.mkdtemp(prefix="baton-chaos-")
    env = dict(os.environ, BATON_TOKEN=secrets.token_hex(32), BATON_LOG="info")
    if args.malloc_arena_max:
        # glibc gives threads heaps of their own (up to 8 per core); every ring formed
        # starts new threads, and memory freed in one heap stays mapped, so the head's
        # anonymous memory grows by 18-32 MiB a ring here without a leak. One heap
        # makes growth mean a leak.
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    n_workers = 4 if args.layout == "tp" else 3
    failures, notes = [], []
    workers, head = [], None
    result = {}
    try:
        workers = [Worker(f"w{i + 1}", args, env, logdir) for i in range(n_workers)]
        head = Head(args, workers, env, logdir)
        client = soak.Client(head.url, None, args.request_deadline)
        ok, health = wait_whole(client, None, args.start_timeout)
        if not ok:
            raise SystemExit(f"the ring did not form: {health}; logs in {logdir}")
        n_stages = len(health["stages"])
        _, models = client.get("/v1/models")
        model_id = models["data"][0]["id"]
        _, stats = client.get("/stats", timeout=30)
        slot_ctx = stats["slot_ctx"]
        specs = make_reference_specs(args, slot_ctx, model_id)

        log(f"reference: {len(specs)} requests, one at a time, on the whole ring ({health['stages']})")
        refs = {}
        for spec in specs:
            ref = send(client, spec, False, None, args.request_deadline)
            if ref.kind != "ok":
                raise SystemExit(f"reference request {spec['ref']} failed: {ref.kind} {ref.status} {ref.detail}")
            refs[spec["ref"]] = ref
        # The same requests again, all at once: answers must not depend on their
        # neighbours in a batch, and the head's buffers reach their working size before
        # the start is measured.
        log("warm-up: the reference requests again, concurrently")
        warm = concurrent_once(client, specs, args)
        warm_changed = [(o, compare(o, refs[o.spec["ref"]])) for o in warm]
        warm_changed = [(o, p) for o, p in warm_changed if p or o.kind != "ok"]
        if warm_changed:
            failures.append(f"{len(warm_changed)} requests run concurrently before the chaos differ from their "
                            f"solo run (or failed): {warm_changed[0][1] or warm_changed[0][0].kind}")
        ref_seconds = time.monotonic() - started
        soak.wait_idle(client)
        time.sleep(1.0)
        _, stats_start = client.get("/stats", timeout=30)
        pids_start = {"head": head.pid, **{w.name: w.pid for w in workers}}
        fds_start = {pid: fd_count(pid) for pid in pids_start.values()}
        anon_start = {pid: proc_status(pid, "RssAnon") for pid in pids_start.values()}
        rss_start = {pid: proc_status(pid, "VmRSS") for pid in pids_start.values()}

        # The load and the chaos end together, leaving time for the checks at the end.
        until = budget_end - args.reserve
        if until - time.monotonic() < 30:
            raise SystemExit(f"--minutes {args.minutes} leaves {until - time.monotonic():.0f} s of chaos after the "
                             f"start-up ({ref_seconds:.0f} s) and the {args.reserve} s kept for the end")
        load_seconds = until - time.monotonic()
        log(f"chaos for {load_seconds:.0f} s: {args.clients} clients, layout {args.layout}")
        chaos = Chaos(workers, random.Random(f"chaos-actor:{args.seed}"), until, args, head.pid)
        chaos.start()
        outcomes = load(client, specs, args.clients, until, args, args.seed)
        chaos.join()
        if chaos.error:
            failures.append(f"the chaos thread failed: {chaos.error}")
        for w in workers:
            if w.stopped:
                os.kill(w.pid, signal.SIGCONT)
                w.stopped = False

        # Every request: a reference answer, or a clear end with nothing changed before it.
        kinds, problems = {}, []
        for out in outcomes:
            kinds[out.kind] = kinds.get(out.kind, 0) + 1
            problem = compare(out, refs[out.spec["ref"]])
            if problem:
                problems.append((out, problem))
        changed = [(o, p) for o, p in problems]
        unclear = [o for o in outcomes if o.kind in ("hang", "truncated", "unclear")]
        if changed:
            failures.append(f"{len(changed)} requests got changed tokens")
        if unclear:
            failures.append(f"{len(unclear)} requests ended without a clear answer or error "
                            f"({', '.join(sorted({o.kind for o in unclear}))})")
        if not outcomes:
            failures.append("no request was sent")

        log("chaos over; waiting for the whole ring, idle")
        whole, health_end = wait_whole(client, n_stages, max(30, budget_end - time.monotonic() - 40))
        if not whole:
            failures.append(f"the ring was not whole and idle again at the end: {health_end}")
        survivors = {"head": head.pid, **{w.name: w.pid for w in workers if w.alive() and not w.killed}}
        survivor_pids = list(survivors.values())
        sweep = None
        if whole:
            sweep = soak.sweep(client, args.parallel, slot_ctx, model_id)
            soak.wait_idle(client)
            if "error" in sweep:
                failures.append(f"slot sweep: {sweep['error']}")
            else:
                if any(v != sweep["expected_sweep"] for v in sweep["after_sweep"]):
                    failures.append(f"after the slot sweep the stages hold {sweep['after_sweep']} KV cells, expected "
                                    f"{sweep['expected_sweep']} each")
                if any(v != sweep["expected_cancel"] for v in sweep["after_cancel"]):
                    failures.append(f"after one cancelled stream the stages hold {sweep['after_cancel']} KV cells, "
                                    f"expected {sweep['expected_cancel']} each")
        fds_end = settle(fd_count, survivor_pids, fds_start)
        anon_end = {pid: proc_status(pid, "RssAnon") for pid in survivor_pids}
        rss_end = {pid: proc_status(pid, "VmRSS") for pid in survivor_pids}
        rows = []
        for name, pid in survivors.items():
            a, b = fds_start.get(pid), fds_end.get(pid)
            growth = (anon_end[pid] - anon_start[pid]) / 1024 if anon_end.get(pid) and anon_start.get(pid) else None
            rows.append((name, pid, a, b, rss_start.get(pid), rss_end.get(pid), anon_start.get(pid),
                         anon_end.get(pid), growth))
            if a is None or b is None or b > a:
                failures.append(f"{name} holds {b} file descriptors at the end, {a} at the start")
            if growth is None or growth > args.max_anon_growth_mib:
                failures.append(f"{name}'s anonymous memory grew {growth} MiB (limit {args.max_anon_growth_mib})")
        _, stats_end = client.get("/stats", timeout=30)
        dead = [w.name for w in workers if not w.alive()] + ([] if head.alive() else ["head"])
        if dead:
            failures.append(f"not running at the end: {', '.join(dead)}")
        head_code = head.stop()
        if head_code != 0:
            failures.append(f"the head exited with {head_code} on SIGTERM")
        panics = [w.name for w in workers if "panicked" in w.logs()]
        head_log = re.sub(r"\x1b\[[0-9;]*m", "", head.log_path.read_text(errors="replace"))
        if "panicked" in head_log:
            panics.append("head")
        if panics:
            failures.append(f"panics logged by {', '.join(panics)}")
        result = {"outcomes": outcomes, "kinds": kinds, "problems": problems, "unclear": unclear,
                  "events": chaos.events, "head_anon": chaos.head_anon, "warm": warm, "rows": rows, "sweep": sweep, "health_start": health,
                  "health_end": health_end, "stats_start": stats_start, "stats_end": stats_end,
                  "load_seconds": load_seconds, "refs": refs, "specs": specs, "head": head, "logdir": logdir,
                  "head_code": head_code, "slot_ctx": slot_ctx,
                  "warns": [line for line in head_log.splitlines() if " WARN " in line or " ERROR " in line]}
    finally:
        if head and head.alive():
            head.proc.kill()
        for w in workers:
            w.close()
    text = report(args, result, failures, time.monotonic() - started)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else soak.RESULTS / f"{now:%Y-%m-%d}-soak.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = merge_section(out.read_text() if out.exists() else "", f"chaos {args.layout} {args.minutes:g} min", text)
    out.write_text(text)
    print(text)
    log(f"wrote {out}; logs in {logdir}")
    return 1 if failures else 0


def anon_summary(samples):
    """`samples` of (seconds, KiB) as MiB: all of them when few, else a summary."""
    values = [kib for _, kib in samples if kib is not None]
    if not values:
        return "not measured"
    if len(samples) <= 12:
        return ", ".join(f"{t:.0f} s {soak.mib(kib)}" for t, kib in samples)
    return (f"{len(values)} readings, min {soak.mib(min(values))}, max {soak.mib(max(values))}, the last "
            f"{soak.mib(values[-1])} MiB")


def merge_section(previous, key, text):
    """The day's results file with this run's section (`<!-- key -->` up to the next
    marker) put in place of the last run of the same key, or added at the end."""
    marker = f"<!-- {key} -->"
    parts = re.split(r"(?m)^(<!-- .* -->)$", previous)
    # parts: [before the first marker, marker, section, marker, section, ...]
    kept = [parts[0].rstrip("\n")] if parts[0].strip() else []
    for i in range(1, len(parts), 2):
        if parts[i] != marker:
            kept.append(parts[i] + "\n" + parts[i + 1].strip("\n"))
    kept.append(marker + "\n" + text.rstrip("\n"))
    return "\n\n".join(kept) + "\n"


def report(args, r, failures, seconds):
    now = datetime.datetime.now(datetime.timezone.utc)
    md = [f"# Chaos soak: layout {args.layout}, {args.minutes} min", "",
          f"commit {soak.git_commit()}, {now:%Y-%m-%dT%H:%MZ}, {os.cpu_count()} cores, model "
          f"{Path(args.model).name}, seed {args.seed}, {seconds:.0f} s in all, "
          + (f"MALLOC_ARENA_MAX={args.malloc_arena_max}." if args.malloc_arena_max else "glibc's malloc arenas.")]
    if r:
        md.append(f"Server: `baton {' '.join(r['head'].command[1:])}` over "
                  f"{4 if args.layout == 'tp' else 3} `baton worker --threads 1` processes on 127.0.0.1; stages at "
                  f"the start: {r['health_start'].get('stages')}.")
        md.append(f"{args.clients} clients for {r['load_seconds']:.0f} s, each sending one of {len(r['specs'])} "
                  f"reference requests ({sum(s['greedy'] for s in r['specs'])} greedy, the rest seeded; max_tokens "
                  f"8..{args.max_tokens}), streamed or whole, 10% of streams hung up early; a worker disrupted "
                  f"every ~{args.chaos_pause:.0f} s; request deadline {args.request_deadline:.0f} s.")
    md += ["", "**PASS**" if not failures else "**FAIL**: " + "; ".join(failures), ""]
    if not r:
        return "\n".join(md) + "\n"
    kills = sum("SIGKILL" in e for _, e in r["events"])
    stops = sum("SIGSTOP" in e for _, e in r["events"])
    n = len(r["outcomes"])
    kinds = r["kinds"]
    md += ["| check | result |", "|---|---|",
           f"| disruptions | {kills} SIGKILL + restart, {stops} SIGSTOP + SIGCONT |",
           f"| requests | {n}: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + " |",
           f"| completed with the reference's tokens | {kinds.get('ok', 0) - sum(o.kind == 'ok' for o, _ in r['problems'])}"
           f" of {kinds.get('ok', 0)} |",
           f"| changed tokens (completed, or before an error or hang-up) | {len(r['problems'])} |",
           f"| hangs past the deadline / silent truncations / unclear ends | {kinds.get('hang', 0)} / "
           f"{kinds.get('truncated', 0)} / {kinds.get('unclear', 0)} |",
           f"| clear errors: HTTP / stream event | {kinds.get('http_error', 0)} / {kinds.get('stream_error', 0)} |"]
    s0, s1 = r["stats_start"], r["stats_end"]
    if isinstance(s1, dict) and "workers_lost" in s1:
        md.append(f"| engine: workers lost / returned, rings formed | {s1['workers_lost'] - s0['workers_lost']} / "
                  f"{s1['workers_returned'] - s0['workers_returned']}, "
                  f"{r['health_end'].get('rings_formed', '?') if isinstance(r['health_end'], dict) else '?'} |")
        md.append(f"| engine: requests finished / cancelled / failed | "
                  f"{s1['requests_finished'] - s0['requests_finished']} / "
                  f"{s1['requests_cancelled'] - s0['requests_cancelled']} / "
                  f"{s1['requests_failed'] - s0['requests_failed']} |")
    lat = sorted(o.seconds for o in r["outcomes"] if o.kind == "ok")
    if lat:
        md.append(f"| latency of completed requests, p50 / p95 / max | {soak.percentile(lat, .5):.2f} / "
                  f"{soak.percentile(lat, .95):.2f} / {lat[-1]:.2f} s |")
    sweep = r["sweep"]
    if sweep and "error" not in sweep:
        md.append(f"| KV cells after the slot sweep / after one cancelled stream (per stage) | "
                  f"{sweep['after_sweep']} (expected {sweep['expected_sweep']}) / {sweep['after_cancel']} "
                  f"(expected {sweep['expected_cancel']}) |")
    md += ["", "## Processes at the start and at the end (idle, the ring whole)", "",
           "| process | pid | fds start | fds end | VmRSS start | VmRSS end | RssAnon start | RssAnon end | "
           "RssAnon growth |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, pid, a, b, rs, re_, an0, an1, growth in r["rows"]:
        md.append(f"| {name} | {pid} | {a} | {b} | {soak.mib(rs)} | {soak.mib(re_)} | {soak.mib(an0)} | "
                  f"{soak.mib(an1)} | " + (f"{growth:+.1f} MiB" if growth is not None else "?") + " |")
    md += ["", f"MiB. Workers killed during the run are new processes and are left out; limit on RssAnon growth "
           f"{args.max_anon_growth_mib} MiB. Start: after the reference requests, run alone and then "
           f"{args.clients} at a time ({sum(o.kind == 'ok' for o in r['warm'])} of {len(r['warm'])} concurrent "
           f"answers equal to the solo ones). The head's RssAnon after each disruption ended: "
           + anon_summary(r["head_anon"]) + "."]
    if r["problems"] or r["unclear"]:
        md += ["", "## Requests that failed a check", "", "| # | request | stream | kind | status | seconds | detail |",
               "|---:|---|---|---|---:|---:|---|"]
        bad = [(o, p) for o, p in r["problems"]] + [(o, o.detail) for o in r["unclear"]]
        for o, p in bad[:30]:
            spec = o.spec
            md.append(f"| {spec['ref']} | {spec['path']} {json.dumps(spec['body'])[:120]} | {o.stream} | {o.kind} | "
                      f"{o.status} | {o.seconds:.1f} | {str(p).replace('|', '/')[:300]} |")
    md += ["", "## Disruptions", ""]
    md += [f"- {t:.1f} s: {e}" for t, e in r["events"][:24]]
    if len(r["events"]) > 24:
        md.append(f"- ... {len(r['events']) - 24} more, the last at {r['events'][-1][0]:.1f} s")
    errors = [o for o in r["outcomes"] if o.kind in ("http_error", "stream_error")]
    if errors:
        seen = {}
        for o in errors:
            key = re.sub(r"\d+", "N", str(o.detail))[:160]
            seen.setdefault(key, [0, o])[0] += 1
        md += ["", "## Clear errors the clients got", "", "| count | kind | status | example |", "|---:|---|---:|---|"]
        for _, (count, o) in sorted(seen.items(), key=lambda kv: -kv[1][0])[:10]:
            md.append(f"| {count} | {o.kind} | {o.status} | {str(o.detail).replace('|', '/')[:240]} |")
    md += ["", f"Head log: {len(r['warns'])} WARN/ERROR lines; logs in {r['logdir']}."]
    return "\n".join(md) + "\n"
