#!/usr/bin/env python3
"""Tensor parallelism against the pipeline on emulated links, and what `--tp auto` chose.

One stream, two `baton worker` processes with one thread each, the head computing
nothing; every link between nodes goes through a toxiproxy proxy with the profile's
latency and bandwidth each way (bench/suite.py's profiles and plumbing): head -> each
worker, worker -> worker (workers advertise their proxy), so the members' exchanges of
a tensor-parallel group cross it too, and so do the head's probes that `--tp auto`
weighs. Per profile:
  TP    --tp 2          one group of both workers (the whole model, 4 exchanges a layer)
  PP    --split 12,12   two pipeline stages
  auto  --tp auto       the planner's choice, with its reasons
against single-process libllama with 1 thread (`baton bench`'s own column, same run).
On loopback also the in-process rows: TP as 2 threads of one process, and libllama with
2 threads.

Usage (from the repository root, after `cargo build --release` and bench/peer/setup,
which installs toxiproxy): bench/tp/profiles.py [--profiles loopback,lan,wifi]
[--reps 3] [--out bench/results/DATE-tp-profiles.md]
"""
import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from suite import BATON, MODELS, PROFILES, ROOT, Procs, Toxiproxy, free_port, run, wait_port  # noqa: E402

# (pp, tg) per profile: each exchange of a group waits one link latency, 96 a token for
# qwen2, so a token takes about 1.5 s at wifi's 15 ms: fewer tokens there.
SIZES = {"loopback": (128, 64), "lan": (128, 64), "wifi": (16, 4), "wan": (8, 2)}
LAYOUTS = [
    ("TP, 1 group of 2 workers", ["--tp", "2"]),
    ("PP, 2 stages of 1 worker", ["--split", "12,12"]),
    ("--tp auto", ["--tp", "auto"]),
]


def load():
    return open("/proc/loadavg").read().split()[0]


def cluster(procs, profile, model):
    tox = Toxiproxy(procs, profile)
    dial = []
    for _ in range(2):
        port = free_port()
        proxy = tox.proxy(port)
        proc = procs.start([BATON, "worker", "--listen", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{proxy}",
                            "--models", model.parent, "--threads", 1])
        wait_port(port, proc, "baton worker")
        dial.append(f"127.0.0.1:{proxy}")
    return ",".join(dial)


def parse(out, pp, tg):
    """(baton pp, baton tg, libllama pp, libllama tg, plan) from `baton bench`'s table."""
    lines = out.splitlines()
    cell = lambda test, col: float(next(l for l in lines if l.startswith(f"| {test} ")).split("|")[col])
    plan = next((l[len("plan: "):] for l in lines if l.startswith("plan: ")), "")
    return cell(f"pp{pp}", 2), cell(f"tg{tg}", 2), cell(f"pp{pp}", 3), cell(f"tg{tg}", 3), plan


def bench_workers(args, profile, layout, model, pp, tg):
    procs = Procs()
    try:
        dial = cluster(procs, PROFILES[profile], model)
        out = run([BATON, "bench", "--model", model, "--workers", dial, "--no-head-stage", "--threads", 1, *layout,
                   "--pp", pp, "--tg", tg, "--reps", args.reps, "--llama-bench", "none"], args.timeout)
        return parse(out, pp, tg)
    finally:
        procs.stop()


def bench_local(args, flags, model, pp, tg):
    out = run([BATON, "bench", "--model", model, *flags, "--pp", pp, "--tg", tg, "--reps", args.reps,
               "--llama-bench", "none"], args.timeout)
    return parse(out, pp, tg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="loopback,lan,wifi")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.chdir(ROOT)
    model = ROOT / MODELS["qwen2"]
    started = datetime.datetime.now(datetime.timezone.utc)
    out = [f"# Tensor parallelism vs pipeline per link profile ({started:%Y-%m-%d})", "",
           f"qwen2.5-coder 0.5B Q4_K_M, one stream, 2 workers x 1 thread, head computing nothing; toxiproxy on "
           f"every link between nodes (head -> worker, worker -> worker, members' exchanges). "
           f"libllama: 1 process, 1 thread, in the same `baton bench` run. Median of {args.reps}; load = "
           f"1-minute load average when the row started (the machine has 2 cores).", ""]
    choices = []

    def flush():
        # Written after every row, so that a run stopped midway keeps what it measured.
        text = "\n".join(out + ["## What `--tp auto` chose", ""] + choices + [""])
        if args.out:
            args.out.write_text(text)
        return text

    for profile in args.profiles.split(","):
        pp, tg = SIZES[profile]
        p = PROFILES[profile]
        link = "no shaping" if p["latency_ms"] is None else f"+{p['latency_ms']} ms each way, {p['rate_kbs'] / 1000:g} MB/s"
        out += [f"## {profile} ({link}), pp{pp} / tg{tg}", "",
                "| layout | pp tok/s | tg tok/s | libllama 1t pp | libllama 1t tg | tg / libllama | load |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        rows = [(name, lambda layout=layout: bench_workers(args, profile, layout, model, pp, tg))
                for name, layout in LAYOUTS]
        if profile == "loopback":
            rows += [("TP, 2 threads in one process", lambda: bench_local(args, ["--stages", 1, "--tp", 2, "-t", 1],
                                                                          model, pp, tg)),
                     ("1 process, 2 threads (libllama column: 2 threads)",
                      lambda: bench_local(args, ["--stages", 1, "-t", 2], model, pp, tg))]
        for name, measure in rows:
            at = load()
            print(f"{profile}: {name} (load {at})", file=sys.stderr, flush=True)
            b_pp, b_tg, l_pp, l_tg, plan = measure()
            row = f"| {name} | {b_pp:.2f} | {b_tg:.2f} | {l_pp:.2f} | {l_tg:.2f} | {b_tg / l_tg:.2f} | {at} |"
            print(row, file=sys.stderr, flush=True)
            out.append(row)
            if name == "--tp auto":
                choices.append(f"- **{profile}**: {plan}")
            flush()
        out.append("")
    print(flush())


if __name__ == "__main__":
    main()
