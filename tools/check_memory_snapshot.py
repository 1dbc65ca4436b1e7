"""Checks a ferrograd memory snapshot with PyTorch's own reader.

Runs `python -m torch.cuda._memory_viz` on the file with `stats`, `trace`, `trace_plot` and
`segment_plot`, and fails on any error (`segments` and `memory` are left out: they download
flamegraph.pl first). Also loads the pickle and
checks what the pytorch.org/memory_viz page needs: `segments` whose blocks tile each segment,
one trace list per device index that has segments, and a `category` on every entry with at
least one `unknown` (the page throws without one when categories are present).

Usage: python tools/check_memory_snapshot.py DIR/memory_snapshot.pickle
Needs PyTorch; ferrograd itself never does.
"""

import os
import pickle
import subprocess
import sys
import tempfile

COMMANDS = ["stats", "trace", "trace_plot", "segment_plot"]


def run_viz(command, path, out_dir):
    args = [sys.executable, "-m", "torch.cuda._memory_viz", command, path]
    if command.endswith("_plot"):
        args += ["-o", os.path.join(out_dir, command + ".html")]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0 or "Traceback" in done.stderr:
        raise SystemExit(f"_memory_viz {command} failed:\n{done.stdout}\n{done.stderr}")
    lines = done.stdout.splitlines()
    print(f"== _memory_viz {command}: ok, {len(lines)} lines of output")
    for line in lines[:8]:
        print("   " + line)


def check_structure(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    segments, traces = snap["segments"], snap["device_traces"]
    for s in segments:
        sizes = sum(b["size"] for b in s["blocks"])
        if sizes != s["total_size"]:
            raise SystemExit(f"segment {s['address']:#x}: blocks cover {sizes} of {s['total_size']} bytes")
        if s["device"] >= len(traces):
            raise SystemExit(f"segment on device {s['device']} but only {len(traces)} trace lists")
    entries = [e for t in traces for e in t]
    missing = [e for e in entries if "category" not in e]
    if missing:
        raise SystemExit(f"{len(missing)} trace entries without a category")
    if entries and not any(e["category"] == "unknown" for e in entries):
        raise SystemExit("no entry of category 'unknown': the memory_viz page would throw")
    actions = {}
    for e in entries:
        actions[e["action"]] = actions.get(e["action"], 0) + 1
    print(f"== structure: ok, {len(segments)} segments, {len(entries)} trace entries {actions}")


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    path = sys.argv[1]
    check_structure(path)
    with tempfile.TemporaryDirectory() as out_dir:
        for command in COMMANDS:
            run_viz(command, path, out_dir)
    print("all checks passed")


if __name__ == "__main__":
    main()
