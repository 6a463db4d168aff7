"""The policy world's rendezvous cannot lose its port to another process (issue 55).

A fresh-clone CI run died once with ``EADDRINUSE`` on the policy group's TCPStore: the driver probed a free port, let
it go, and rank 0 bound it later; another test's process took it in between. Rank 0 now binds its store on a port the
OS picks before anyone is told the port (``megatron/runtime.py: bind_rendezvous``). The job makes the probe answer a
port that is already taken -- the race, made certain -- and starts a real 2-rank policy world (megatron-core on gloo)
the way a Ray ``PolicyGroup`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("_rendezvous_job.py")


def test_a_two_rank_policy_world_starts_when_its_probed_port_was_taken_before_the_bind(tmp_path):
    from da3po_megatron.tiny import build_model

    hf = build_model(tmp_path / "hf", family="qwen3", seed=0)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(JOB), str(hf), str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.exists(), p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res.get("ok"), f"{res.get('error')}\n{p.stderr[-2000:]}"
    assert res["rendezvous_port"] != res["taken_port"]


def test_a_collective_sender_binds_its_store_before_it_hands_out_the_port():
    import socket

    import da3po_megatron.rollout.collective as collective
    from da3po_megatron.rollout.collective_send import CollectiveSender

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real, collective.free_port = collective.free_port, lambda *a, **k: port  # noqa: ARG005
        try:
            sender = CollectiveSender("race", 2, "gloo", 10.0, host="127.0.0.1")
        finally:
            collective.free_port = real
        assert sender.port != port and sender.store.port == sender.port


def test_no_process_world_is_told_a_probed_port():
    """The same race in the tests and tools that start worlds of their own (a fresh-clone CI run of bd24311 lost
    ``test_update_guard``'s 2-rank world to ``EADDRINUSE``: the test probed ``free_port()`` and its rank 0 bound it
    later). A world is told a port only after a process bound it: ``runtime.bind_rendezvous`` in the parent or rank
    0, ``join_rendezvous`` in the others, or ``torchrun --standalone``. So no source file hands a probed port to a
    rendezvous: no tcp:// ``init_method``, and ``free_port`` is called only by ``init_parallel``'s environment
    fallback (a caller that sets neither store nor port)."""
    import re

    root = Path(__file__).resolve().parents[1]
    allowed = {"da3po_megatron/megatron/runtime.py", "tests/test_rendezvous.py", "tests/_rendezvous_job.py"}
    found = []
    for folder in ("da3po_megatron", "tests", "tools"):
        for f in (root / folder).rglob("*.py"):
            rel = f.relative_to(root).as_posix()
            if rel in allowed:
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"init_method\s*=\s*f?[\"']tcp://", code) or re.search(r"\bfree_port\(\)", code):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "a probed port handed to a rendezvous (bind first: runtime.bind_rendezvous):\n" + "\n".join(found)
