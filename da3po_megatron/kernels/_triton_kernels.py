"""Raw Triton kernel bodies of the fused DAA loss (undecorated; `triton_loss._kernels()` applies `triton.jit`).

They are decorated lazily so that `TRITON_INTERPRET=1` is honoured whenever it is set before the first call: Triton
3.x reads the variable when `@triton.jit` runs, not at launch. Three kernels:

* `stats_kernel`, one program per token row: online max / sum-exp / sum-exp*(z - max) over BLOCK_V-wide vocab blocks
  (masked tail: V_local need not be a multiple of BLOCK_V) and the gathered target logit of the local shard;
* `loss_kernel`, BLOCK_N tokens per program: log-prob, ratio, DAA (Eq. 14), clipped surrogate (Eq. 11), the
  gradient coefficient d loss_t / d logp_t and the clip flags;
* `dlogits_kernel`, one program per row: recomputes softmax blockwise from the saved logsumexp and writes
  dlogits = g (onehot - p) - gH p (log p + H) in the output's dtype (may alias the logits: read-then-write per block).

The row-per-program online-softmax layout follows Liger-Kernel's cross-entropy kernel; the statistics merge across TP
ranks follows Megatron-LM's vocab-parallel cross-entropy.
"""

import triton.language as tl


def stats_kernel(
    logits_ptr, stride_row, targets_ptr,  # in: logits [N, V_local] (row stride), targets [N]
    max_ptr, sumexp_ptr, sumexpz_ptr, tgt_ptr,  # out, float32 [N]: max, sum-exp, sum-exp * (z - max), target logit
    vocab_start, v_local,  # this shard's vocab columns
    BLOCK_V: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, SHIFTED_LOGIT_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    m = -float("inf")
    s = 0.0
    w = 0.0
    for off in range(0, v_local, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        valid = cols < v_local
        z = tl.load(row_ptr + cols, mask=valid, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if COMPUTE_ENTROPY:
            shift = tl.where(s > 0.0, m - m_new, 0.0) * s  # m = -inf before the first block, where s = 0
            zs = tl.where(valid, tl.maximum(z - m_new, SHIFTED_LOGIT_FLOOR), 0.0)  # floor: -inf logits
            w = scale * (w + shift) + tl.sum(e * zs, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    y = tl.load(targets_ptr + row) - vocab_start
    in_shard = (y >= 0) & (y < v_local)
    tgt = tl.load(row_ptr + y, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(tgt_ptr + row, tgt)
    if COMPUTE_ENTROPY:
        tl.store(sumexpz_ptr + row, w)


def loss_kernel(
    tgt_ptr, lse_ptr, old_ptr, adv_ptr, mask_ptr,  # in, float32 [N]: target logit, logsumexp, loss inputs
    correct_ptr, phat_ptr, lambda_ptr,  # in, float32 [N]: DAA inputs (read only with HAS_DAA / LAMBDA_PER_TOKEN)
    logp_ptr, loss_ptr, coef_ptr, clip_low_ptr, clip_high_ptr,  # out, float32 [N]
    n, low_bound, high_bound, daa_lambda, daa_tau,  # tokens; 1 - eps_low, 1 + eps_high; scalar lambda, tau
    LOG_RATIO_CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DAA: tl.constexpr, LAMBDA_PER_TOKEN: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < n
    tgt = tl.load(tgt_ptr + offs, mask=valid, other=0.0)
    lse = tl.load(lse_ptr + offs, mask=valid, other=0.0)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    mk = tl.load(mask_ptr + offs, mask=valid, other=0.0)
    if HAS_DAA:  # Eq. 14
        correct = tl.load(correct_ptr + offs, mask=valid, other=0.0)
        p_hat = tl.load(phat_ptr + offs, mask=valid, other=1.0)
        if LAMBDA_PER_TOKEN:
            lam = tl.load(lambda_ptr + offs, mask=valid, other=1.0)
        else:
            lam = daa_lambda
        adv = tl.where((correct > 0.5) & (p_hat < daa_tau), adv * lam, adv)
    counted = mk > 0.0
    adv = tl.where(counted, adv, 0.0)  # padding tokens contribute exactly 0, whatever their inputs
    logp = tgt - lse
    log_ratio = tl.where(counted, logp - old, 0.0)
    lr = tl.minimum(tl.maximum(log_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    ratio = tl.exp(lr)
    clipped = tl.minimum(tl.maximum(ratio, low_bound), high_bound)
    loss = tl.where(counted, -tl.minimum(ratio * adv, clipped * adv) * mk, 0.0)  # Eq. 11, per token
    clip_high = (adv > 0.0) & (ratio > high_bound)
    clip_low = (adv < 0.0) & (ratio < low_bound)
    flat = clip_high | clip_low | (log_ratio > LOG_RATIO_CLAMP) | (log_ratio < -LOG_RATIO_CLAMP)
    coef = tl.where(flat, 0.0, -adv * ratio * mk)  # d loss_t / d logp_t
    tl.store(logp_ptr + offs, logp, mask=valid)
    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(coef_ptr + offs, coef, mask=valid)
    tl.store(clip_low_ptr + offs, (clip_low & counted).to(tl.float32), mask=valid)
    tl.store(clip_high_ptr + offs, (clip_high & counted).to(tl.float32), mask=valid)


def dlogits_kernel(
    logits_ptr, stride_row, dlogits_ptr, stride_drow, targets_ptr,  # in: logits, out: dlogits (may alias); targets
    lse_ptr, g_ptr, ent_ptr, gent_ptr,  # in, float32 [N]: logsumexp, d/d logp, entropy, d/d entropy
    vocab_start, v_local,  # this shard's vocab columns
    BLOCK_V: tl.constexpr, HAS_ENT_GRAD: tl.constexpr, SHIFTED_LOGIT_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    drow_ptr = dlogits_ptr + row * stride_drow
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    if HAS_ENT_GRAD:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(gent_ptr + row)
    y = tl.load(targets_ptr + row) - vocab_start
    for off in range(0, v_local, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        valid = cols < v_local
        z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        logp = tl.maximum(z - lse, SHIFTED_LOGIT_FLOOR)
        p = tl.exp(logp)
        if HAS_ENT_GRAD:
            d = -p * (g + g_ent * (logp + ent))
        else:
            d = -p * g
        d = tl.where(cols == y, d + g, d)
        tl.store(drow_ptr + cols, d.to(dlogits_ptr.dtype.element_ty), mask=valid)
