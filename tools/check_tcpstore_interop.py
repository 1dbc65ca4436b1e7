"""Checks that ferrograd's rendezvous speaks PyTorch's TCPStore protocol, both ways.

Not part of `cargo test` (it needs PyTorch). Build the example first, then run:

    cargo build -p ferrograd --example share_nccl_id
    python tools/check_tcpstore_interop.py target/debug/examples/share_nccl_id

1. PyTorch hosts the store (libuv and legacy backends): two ranks of the example join it as
   an agent store and share a 128-byte id, which Python then reads under the same key.
2. The example's rank 0 hosts the store: PyTorch's TCPStore client (validate, ping, set,
   get, add, check) talks to it and acts as rank 1 of the rendezvous.
3. `torchrun --no-python` starts two ranks of the example, which meet at torchrun's agent
   store.
Each step prints what it saw and the script exits non-zero at the first failure.
"""

import datetime
import os
import socket
import subprocess
import sys
import time

from torch.distributed import TCPStore

TIMEOUT = datetime.timedelta(seconds=30)
ID_KEY = "ferrograd/0/1/bcast/1/nccl_unique_id"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port, agent):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if agent:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def pytorch_hosts(example, libuv):
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, use_libuv=libuv,
                     wait_for_workers=False, timeout=TIMEOUT)
    ranks = [subprocess.Popen([example], env=rank_env(r, 2, port, True)) for r in range(2)]
    codes = [p.wait(timeout=60) for p in ranks]
    assert codes == [0, 0], f"ranks exited with {codes}"
    got = store.get(ID_KEY)
    assert len(got) == 128, f"Python read {len(got)} bytes"
    print(f"ok: PyTorch store (libuv={libuv}) hosted the rendezvous; Python read the 128-byte id")


def ferrograd_hosts(example):
    port = free_port()
    rank0 = subprocess.Popen([example], env=rank_env(0, 2, port, False))
    time.sleep(0.5)
    s = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    s.set("py/x", b"hello")
    assert s.get("py/x") == b"hello"
    assert (s.add("py/c", 2), s.add("py/c", 3)) == (2, 5)
    assert s.check(["py/x"]) and not s.check(["py/missing"])
    # Rank 1 of the rendezvous, as the Rust ranks do it.
    s.add("ferrograd/0/joins/1", 1)
    assert s.get("ferrograd/0/1/join/0") == b"2"
    s.set("ferrograd/0/1/join/1", b"2")
    assert len(s.get(ID_KEY)) == 128
    s.set("ferrograd/0/1/left/1", b"1")
    assert rank0.wait(timeout=60) == 0
    print("ok: PyTorch's TCPStore client worked against ferrograd's store and joined as rank 1")


def under_torchrun(example):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--no-python",
                          example], capture_output=True, text=True, timeout=120)
    sums = {line.split("checksum ")[1].split()[0]
            for line in out.stdout.splitlines() if "checksum" in line}
    assert out.returncode == 0 and len(sums) == 1, out.stdout + out.stderr
    print("ok: torchrun --no-python: both ranks got the same id through the agent store")


def main():
    example = os.path.abspath(sys.argv[1])
    pytorch_hosts(example, libuv=True)
    pytorch_hosts(example, libuv=False)
    ferrograd_hosts(example)
    under_torchrun(example)


if __name__ == "__main__":
    main()
