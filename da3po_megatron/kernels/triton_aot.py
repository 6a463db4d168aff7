"""Ahead-of-time compilation of the fused DAA-loss kernels for NVIDIA GPUs, on a machine without one.

The Triton interpreter (`TRITON_INTERPRET=1`, what CPU tests run) executes the kernel bodies with numpy and accepts
code that the real compiler rejects (loop-carried values changing type, int32 pointer overflow, unsupported casts).
`triton.compile` with an explicit `GPUTarget` runs the real pipeline -- Triton IR, TritonGPU IR, LLVM IR, PTX and
`ptxas` to a cubin -- and needs no driver or device, so every variant that `triton_loss.py` can launch is compiled here
for the architectures we ship for (A100 = sm_80, H100/H200 = sm_90). `ptxas -v` then reports registers per thread,
spills and shared memory: spills in the vocab loops would be the first thing to fix for bandwidth.

    python -m da3po_megatron.kernels.triton_aot            # table for sm_80 and sm_90 (a few seconds per variant)

The signatures below must match the launches in `triton_loss.py` (pointer dtypes from `common.prepare_inputs`: logits
in their own dtype, targets int64, every per-token vector float32). A test compiles all of them (tests/
test_kernel_compile.py); that the compiled code is also *correct* is checked on a GPU only
(tests/test_kernel_backends.py -k compiled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .common import LOG_RATIO_CLAMP, SHIFTED_LOGIT_FLOOR

ARCHS = (80, 90)
LOGITS_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Variant:
    """One specialisation of one kernel, as `triton_loss.py` would launch it."""

    kernel: str  # attribute of `_triton_kernels`
    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int


@dataclass
class CompileReport:
    variant: Variant
    arch: int
    ok: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared_bytes: int | None = None
    cubin_bytes: int = 0
    error: str = ""


def _warps(block_v: int) -> int:
    from .triton_loss import _num_warps

    return _num_warps(block_v)


def kernel_variants(block_vs: tuple[int, ...] = (4096, 128)) -> list[Variant]:
    """Every constexpr combination the autograd Functions launch, for each logits dtype and vocab block width.

    4096 is `default_block_v` for any V_local >= 2049 (Qwen3's 151,936 split over TP 1..8); 128 stands for tiny vocabs.
    """
    from .triton_loss import LOSS_BLOCK_N

    out: list[Variant] = []
    for dt in LOGITS_DTYPES:
        for bv in block_vs:
            for ent in (False, True):
                out.append(Variant(
                    "stats_kernel", f"stats {dt} BLOCK_V={bv} entropy={ent}",
                    {"logits_ptr": f"*{dt}", "stride_row": "i32", "targets_ptr": "*i64", "max_ptr": "*fp32",
                     "sumexp_ptr": "*fp32", "sumexpz_ptr": "*fp32", "tgt_ptr": "*fp32", "vocab_start": "i32",
                     "v_local": "i32", "BLOCK_V": "constexpr", "COMPUTE_ENTROPY": "constexpr",
                     "SHIFTED_LOGIT_FLOOR": "constexpr"},
                    {"BLOCK_V": bv, "COMPUTE_ENTROPY": ent, "SHIFTED_LOGIT_FLOOR": SHIFTED_LOGIT_FLOOR},
                    _warps(bv)))
                out.append(Variant(
                    "dlogits_kernel", f"dlogits {dt} BLOCK_V={bv} entropy_grad={ent}",
                    {"logits_ptr": f"*{dt}", "stride_row": "i32", "dlogits_ptr": f"*{dt}", "stride_drow": "i32",
                     "targets_ptr": "*i64", "lse_ptr": "*fp32", "g_ptr": "*fp32", "ent_ptr": "*fp32",
                     "gent_ptr": "*fp32", "vocab_start": "i32", "v_local": "i32", "BLOCK_V": "constexpr",
                     "HAS_ENT_GRAD": "constexpr", "SHIFTED_LOGIT_FLOOR": "constexpr"},
                    {"BLOCK_V": bv, "HAS_ENT_GRAD": ent, "SHIFTED_LOGIT_FLOOR": SHIFTED_LOGIT_FLOOR},
                    _warps(bv)))
    loss_sig = {name: "*fp32" for name in (
        "tgt_ptr", "lse_ptr", "old_ptr", "adv_ptr", "mask_ptr", "correct_ptr", "phat_ptr", "lambda_ptr", "logp_ptr",
        "loss_ptr", "coef_ptr", "clip_low_ptr", "clip_high_ptr")}
    loss_sig.update({"n": "i32", "low_bound": "fp32", "high_bound": "fp32", "daa_lambda": "fp32", "daa_tau": "fp32",
                     "LOG_RATIO_CLAMP": "constexpr", "BLOCK_N": "constexpr", "HAS_DAA": "constexpr",
                     "LAMBDA_PER_TOKEN": "constexpr"})
    for has_daa, per_token in ((False, False), (True, False), (True, True)):
        out.append(Variant(
            "loss_kernel", f"loss DAA={has_daa} lambda_per_token={per_token}", dict(loss_sig),
            {"LOG_RATIO_CLAMP": LOG_RATIO_CLAMP, "BLOCK_N": LOSS_BLOCK_N, "HAS_DAA": has_daa,
             "LAMBDA_PER_TOKEN": per_token},
            4))
    return out


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def _ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers / spills / static shared memory from `ptxas -v` on the PTX Triton produced."""
    try:  # Triton >= 3.5 picks a newer ptxas for sm_90+; use the same one it compiled with
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except ImportError:
        import triton

        ptxas = triton.knobs.nvidia.ptxas.path
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{log[-2000:]}")
    out: dict[str, int] = {}
    if m := _PTXAS_USAGE.search(log):
        out["registers"] = int(m.group(1))
    if m := _PTXAS_SPILL.search(log):
        out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
    if m := _PTXAS_SMEM.search(log):
        out["shared_bytes"] = int(m.group(1))
    return out


def compile_variant(v: Variant, arch: int) -> CompileReport:
    """Compile one variant to a cubin for sm_<arch> with Triton's real compiler (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from . import _triton_kernels as raw

    rep = CompileReport(v, arch, ok=False)
    try:
        fn = JITFunction(getattr(raw, v.kernel))  # a real JITFunction even if TRITON_INTERPRET is set
        src = ASTSource(fn, v.signature, constexprs=dict(v.constexprs))
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": v.num_warps})
        rep.cubin_bytes = len(k.asm["cubin"])
        usage = _ptxas_usage(k.asm["ptx"], arch)
        rep.registers = usage.get("registers")
        rep.spill_stores = usage.get("spill_stores")
        rep.spill_loads = usage.get("spill_loads")
        rep.shared_bytes = int(k.metadata.shared)
        rep.ok = True
    except Exception as e:  # noqa: BLE001 -- reported per variant, the caller decides
        rep.error = f"{type(e).__name__}: {e}"[:4000]
    return rep


def compile_all(archs: tuple[int, ...] = ARCHS, block_vs: tuple[int, ...] = (4096, 128)) -> list[CompileReport]:
    return [compile_variant(v, a) for a in archs for v in kernel_variants(block_vs)]


def format_reports(reports: list[CompileReport]) -> str:
    rows = ["| arch | kernel variant | warps | regs/thread | spill st/ld B | smem B | cubin B | status |",
            "|------|----------------|-------|-------------|---------------|--------|---------|--------|"]
    for r in reports:
        status = "ok" if r.ok else "FAILED: " + r.error.splitlines()[0][:120] if r.error else "FAILED"
        spill = f"{r.spill_stores}/{r.spill_loads}" if r.spill_stores is not None else "-"
        rows.append(f"| sm_{r.arch} | {r.variant.label} | {r.variant.num_warps} | {r.registers or '-'} | {spill} | "
                    f"{r.shared_bytes if r.shared_bytes is not None else '-'} | {r.cubin_bytes:,} | {status} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, action="append", help="compute capability x 10, repeatable (default 80 and 90)")
    p.add_argument("--block-v", type=int, action="append", help="vocab block widths (default 4096 and 128)")
    p.add_argument("--json", help="also write the reports to this JSON file")
    a = p.parse_args(argv)
    reports = compile_all(tuple(a.arch or ARCHS), tuple(a.block_v or (4096, 128)))
    print(f"Triton {triton.__version__}: AOT compile of the fused DAA-loss kernels (no GPU needed)")
    print(format_reports(reports))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in reports], f, indent=1)
    failed = [r for r in reports if not r.ok]
    for r in failed:
        print(f"\n--- sm_{r.arch} {r.variant.label}:\n{r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
