"""tools/gpu/gpu_check.sh -- the one prepared run for a session lent a GPU machine -- works end to end, at tiny sizes.

A device session has minutes, not hours: a typo found there costs the whole budget. This runs the script on CPU with
`GPU_CHECK_SMALL=1` (same steps, tiny shapes; the kernel-test step is skipped here because the suite runs those tests
anyway) and checks the summary, the exit status and the files it leaves for the device tool to bring back (at most 8).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_CHECK_SMALL="1")
    e.update(env)
    e.pop("MASTER_PORT", None)
    e.pop("MASTER_ADDR", None)
    return subprocess.run(["bash", "tools/gpu/gpu_check.sh", "run"], cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=900)


def _summary(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    return {ln.split()[0]: ln.split()[1] for ln in lines}


@pytest.mark.gpu_prep  # make test-gpu-prep, not make test (the suite's budget); the other tests here stay in it
def test_gpu_check_runs_every_step_at_tiny_sizes_and_leaves_at_most_8_files(tmp_path):
    # skipped here to save process starts in CI: bench_loss_16k is bench_loss_8k's command at another size,
    # convert_verify is `da3po convert hf-to-megatron --verify`, which tests/test_convert.py runs, and the kernel
    # steps are pytest runs of kernel test files the suite runs anyway (their CUDA cases skip here)
    # colocated: tools/gpu/check_colocated_gpu.py --small (44 s on 2 cores) is not run by the suite: run it by hand
    # (docs/colocation.md); its placement half is tests/test_colocated_engine_tp.py, its bucket half test_ipc_layouts
    r = _run(tmp_path, GPU_CHECK_SKIP="kernel_cuda,kernel_tests,bench_loss_16k,convert_verify,colocated")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    assert _summary(tmp_path) == {"kernel_cuda": "SKIP", "kernel_tests": "SKIP", "bench_loss_8k": "PASS",
                                  "bench_loss_16k": "SKIP", "train_step": "PASS", "resume": "PASS", "te_spec": "SKIP",
                                  "moe_step": "PASS", "colocated": "SKIP",
                                  "convert_verify": "SKIP", "ipc_sync": "PASS", "collective_cuda": "PASS"}
    assert list(_summary(tmp_path)) == [name for part in _plan()[1:] for name in list(part["steps"])[1:]]
    assert "te_spec                SKIP no CUDA" in (tmp_path / "out" / "summary.txt").read_text()
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8, files
    assert {"env.txt", "summary.txt", "bench_loss_8k.json", "bench_loss_8k.txt", "train_step.txt"} <= set(files)
    assert "torch" in (tmp_path / "out" / "env.txt").read_text()
    assert "| reference" in (tmp_path / "out" / "bench_loss_8k.txt").read_text()
    train = (tmp_path / "out" / "train_step.txt").read_text()
    assert '"loss_backend": "kernel"' in train and '"loss_backend": "fused_linear"' in train
    assert '"loss_backend_ran": "kernel:chunked"' in train  # what the step reports it ran (--expect-loss-backend)
    assert '"check": "resume", "ok": true' in train and '"optimizer": "torch.optim.adamw.AdamW"' in train
    assert "| ipc_sync |" in train and "| pack |" in train  # the weight-sync IPC leg, appended to the same file
    assert '"check": "collective_cuda"' in train and "wrong tensors: 0" in train  # the collective receive step
    assert '"check": "moe_step"' in train and '"train_router_agreement": 1.0' in train  # MoE with R3 (issue 46)


def _plan() -> list[dict]:
    """``tools/gpu/gpu_check.sh plan``: per command its timeout_s, the sum and each step's limit; then start, budget."""
    out = subprocess.run(["bash", "tools/gpu/gpu_check.sh", "plan"], cwd=REPO, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    parts = [None]
    for line in lines[:2]:
        m = re.fullmatch(r"part (\d) timeout_s=(\d+) sum=(\d+) steps: (.*)", line)
        assert m, line
        steps = dict((k, int(v)) for k, v in (s.split("=") for s in m[4].split()))
        parts.append({"timeout_s": int(m[2]), "sum": int(m[3]), "steps": steps})
    m = re.fullmatch(r"all start=(\d+) budget=(\d+)", lines[2])
    parts[0] = {"start": int(m[1]), "budget": int(m[2])}
    return parts


def test_the_step_budgets_add_up_to_what_the_header_recommends_within_15_minutes_of_device_time():
    """The device run the header recommends fits: each command's step limits (LIMIT in the script, printed by
    ``plan``) add up to the sum the header states and to less than that command's timeout_s, the machine's start plus
    the two timeouts is the 15 minutes of device time, and command 1 runs the weight-sync checks first, then the fused
    kernel, the train step and the resume. On 27dab78 the limits added up to ~1,520 s against its own 420 s (and the
    600 s command limit), the weight-sync steps last."""
    text = (REPO / "tools" / "gpu" / "gpu_check.sh").read_text()
    header = " ".join(line.lstrip("# ") for line in text.split("set -uo pipefail")[0].splitlines())
    plan = _plan()
    run_line = r'gpu_check\.sh run (\d)", carry=\[".devwhl"\], timeout_s=(\d+)'
    recommended = {int(p): int(t) for p, t in re.findall(run_line, header)}
    assert recommended == {1: plan[1]["timeout_s"], 2: plan[2]["timeout_s"]}
    m = re.search(r"15 min = (\d+) s in all = the machine's start \(allow (\d+) s\) \+ command 1 \((\d+) s\) \+ "
                  r"command 2 \((\d+) s\)", header)
    assert m and [int(x) for x in m.groups()] == [plan[0]["budget"], plan[0]["start"], recommended[1], recommended[2]]
    assert plan[0]["start"] + recommended[1] + recommended[2] <= plan[0]["budget"] == 15 * 60
    for p in (1, 2):
        stated = re.search(rf"Command {p} [^:]*: (.*?) = (\d+) s\.", header)
        terms = [(k, int(v)) for k, v in re.findall(r"([a-z_0-9]+) (\d+)", stated[1])]
        steps = plan[p]["steps"]
        assert terms == list(steps.items()), (p, terms, steps)  # the header's numbers are the script's
        assert int(stated[2]) == plan[p]["sum"] == sum(steps.values()) < plan[p]["timeout_s"]
        print(f"command {p}: steps {plan[p]['sum']} s of timeout_s={plan[p]['timeout_s']}")
    order = list(plan[1]["steps"])
    assert order == ["prelude", "ipc_sync", "collective_cuda", "kernel_cuda", "bench_loss_8k", "train_step", "resume",
                     "colocated"]


def test_a_failing_step_is_recorded_and_the_script_exits_non_zero(tmp_path):
    # a Python that does not exist: every step that runs fails, and says so in the summary
    r = _run(tmp_path, GPU_CHECK_SKIP="kernel_tests,bench_loss_16k", PYTHON="/nonexistent/python")
    assert r.returncode != 0
    s = _summary(tmp_path)
    assert s["bench_loss_8k"] == "FAIL" and s["bench_loss_16k"] == "SKIP"


def _colocated_tool():
    import importlib.util

    path = REPO / "tools" / "gpu" / "check_colocated_gpu.py"
    spec = importlib.util.spec_from_file_location("check_colocated_gpu", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # (its dataclass looks its module up)
    spec.loader.exec_module(tool)
    return tool


def test_the_colocated_check_trains_as_the_recipe_where_the_machine_allows_and_says_what_it_cannot():
    """tools/gpu/check_colocated_gpu.py (step ``colocated``; issue 57, P5): NCCL when each rank has a GPU, else gloo
    with megatron-core's coalesced DP collectives issued one at a time (gloo's coalesced all-gather has no CUDA
    path: the read expected a segfault at the first optimizer step), bf16 with fp32 master shards always, TE's
    FusedAdam exactly when TE imports on CUDA -- and a line saying so when it does not (the device image has no TE).
    At b6cc7ac the tool trained over gloo with coalescing, in float32, with whatever optimizer, and said nothing."""
    tool = _colocated_tool()
    plan = tool.train_plan
    two = plan(True, 8, None)
    assert (two.backend, two.rank_devices, two.one_by_one, two.params_dtype, two.optimizer, two.said) == (
        "nccl", (0, 1), False, "bfloat16", "TE FusedAdam", ())
    one = plan(True, 1, None)
    assert (one.backend, one.rank_devices, one.one_by_one, one.optimizer) == ("gloo", (0, 0), True, "TE FusedAdam")
    assert len(one.said) == 1 and "NCCL refuses two ranks on one device" in one.said[0]
    image = plan(True, 1, "`import transformer_engine` failed: ModuleNotFoundError: No module named 'x'")
    assert image.optimizer == "torch AdamW" and image.params_dtype == "bfloat16"
    assert any("Transformer-Engine not importable (`import transformer_engine` failed" in s and "NOT covered" in s
               for s in image.said)
    cpu = plan(False, 0, None)
    assert (cpu.backend, cpu.one_by_one, cpu.params_dtype, cpu.optimizer) == ("gloo", True, "bfloat16", "torch AdamW")
    assert "(no CUDA)" in cpu.said[-1]
    assert set(one.overrides()) == {"actor.offload=all", "model.params_dtype=bfloat16"}

    # a rank's report against the plan: what the --small run reports passes its plan; fp32, another backend, the
    # wrong optimizer or a coalescing manager never used does not
    report = {"backend": "gloo", "params_dtype": "bfloat16", "master_dtype": "float32", "torch_optimizer": True,
              "coalesced_one_by_one": 4}
    assert tool.trained_as_planned(cpu, report)
    assert not tool.trained_as_planned(one, report)  # TE's FusedAdam planned, torch's AdamW ran
    assert tool.trained_as_planned(one, {**report, "torch_optimizer": False})
    for bad in ({"params_dtype": "float32"}, {"master_dtype": "bfloat16"}, {"backend": "nccl"},
                {"coalesced_one_by_one": 0}):
        assert not tool.trained_as_planned(cpu, {**report, **bad}), bad
    assert tool.trained_as_planned(two, {**report, "backend": "nccl", "torch_optimizer": False,
                                         "coalesced_one_by_one": None})


def test_one_by_one_replaces_megatrons_coalescing_manager_counts_its_uses_and_refuses_asynchronous_blocks():
    tool = _colocated_tool()
    from megatron.core.distributed import param_and_grad_buffer as pgb

    real = pgb._coalescing_manager
    try:
        count = tool.install_one_by_one()
        assert pgb._coalescing_manager is not real and count == [0]
        with pgb._coalescing_manager(None, async_ops=False) as cm:
            pass
        cm.wait()
        assert count == [1]
        with pytest.raises(RuntimeError, match="asynchronous coalesced collective"):
            with pgb._coalescing_manager(None, async_ops=True):
                pass
    finally:
        pgb._coalescing_manager = real
