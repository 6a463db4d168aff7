"""A 2-rank policy world whose probed rendezvous port is taken before rank 0 binds it (tests/test_rendezvous.py).

usage: python tests/_rendezvous_job.py HF_DIR OUT_JSON

Rank 0 is a real :class:`PolicyWorker` in this process, rank 1 another in a spawned child, rendezvousing the way a Ray
``PolicyGroup`` does (``rendezvous_address()`` on rank 0, then ``init(..., master_addr, master_port)`` on every rank).
``free_port`` -- the probe -- is patched to answer a port that a socket of this process already listens on, as another
job on the host would take it between the probe and the bind (the fresh-clone CI failure of 2026-12-05:
``EADDRINUSE`` on the policy group's TCPStore). Writes ``{"ok": true}`` or ``{"error": ...}``; exit 0 / 1.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import sys


def _config(hf: str):
    from da3po_megatron.config import standalone_policy_config

    return standalone_policy_config(hf, ["model.params_dtype=float32", "parallel.data_parallel_size=2",
                                         "actor.loss_backend=torch"])


def _rank1(hf: str, addr: str, port: int, q) -> None:
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.megatron.policy import PolicyWorker

    try:
        PolicyWorker().init(_config(hf), gpt_arch(hf), rank=1, world_size=2, master_addr=addr, master_port=port)
        import torch.distributed as dist

        dist.barrier()
        q.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put(f"rank 1: {type(e).__name__}: {e}")


def main(hf: str, out: str) -> int:
    import da3po_megatron.megatron.policy as policy
    import da3po_megatron.megatron.runtime as runtime
    from da3po_megatron.bridge.hf_config import gpt_arch

    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for mod in (policy, runtime):  # the probe answers a port that is no longer free
        if hasattr(mod, "free_port"):
            mod.free_port = lambda *a, **k: port  # noqa: ARG005
    result: dict = {"taken_port": port}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = None
    try:
        w = policy.PolicyWorker()
        addr, master_port = w.rendezvous_address()
        result["rendezvous_port"] = master_port
        child = ctx.Process(target=_rank1, args=(hf, addr, master_port, q))
        child.start()
        w.init(_config(hf), gpt_arch(hf), rank=0, world_size=2, master_addr=addr, master_port=master_port)
        import torch.distributed as dist

        dist.barrier()
        answer = q.get(timeout=120)
        if answer != "ok":
            raise RuntimeError(answer)
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - the test reads it
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if child is not None:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
        taken.close()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
