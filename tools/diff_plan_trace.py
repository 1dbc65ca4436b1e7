#!/usr/bin/env python3
"""Where a plan and a real run part ways: compares the allocator events of two memory
snapshots (`ferrograd plan --memory-trace A` and `ferrograd train --memory-trace B` with the
same flags), from the first training step on, and prints the first difference in the
sequence of allocations and frees, then in the segments reserved.

    python3 tools/diff_plan_trace.py PLAN_DIR/memory_snapshot.pickle RUN_DIR/memory_snapshot.pickle
"""
import pickle
import sys


def events(path):
    """(action, size, name) of each alloc/free/segment event from step 0's forward on."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    out, started = [], False
    for e in snap["device_traces"][0]:
        name = e["frames"][0]["name"] if e.get("frames") else ""
        started = started or "forward step 0" in name
        if started and e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free"):
            out.append((e["action"], e["size"], name))
    return out


def first_difference(a, b, keep):
    """Walks both sequences of the actions in `keep`; prints where they first differ."""
    a = [e for e in a if e[0] in keep]
    b = [e for e in b if e[0] in keep]
    for i, (x, y) in enumerate(zip(a, b)):
        if x[:2] != y[:2]:
            for j in range(max(0, i - 3), i):
                print(f"  #{j}: plan {a[j]} | run {b[j]}")
            print(f"  #{i} differs:\n    plan {x}\n    run  {y}")
            return
    print(f"  the first {min(len(a), len(b))} events agree (plan {len(a)}, run {len(b)})")


def main():
    plan, run = events(sys.argv[1]), events(sys.argv[2])
    print("allocations and frees:")
    first_difference(plan, run, {"alloc", "free_completed"})
    # Blocks of the large pool only (over 1 MiB): the small pool's segments are separate.
    large = lambda seq: [e for e in seq if e[1] > (1 << 20)]
    print("allocations and frees over 1 MiB:")
    first_difference(large(plan), large(run), {"alloc", "free_completed"})
    print("segments:")
    first_difference(plan, run, {"segment_alloc", "segment_free"})
    for name, seq in (("plan", plan), ("run", run)):
        segs = [e for e in seq if e[0].startswith("segment")]
        print(f"  {name}: " + "; ".join(f"{a} {s} {n}" for a, s, n in segs[:12]))


if __name__ == "__main__":
    main()
