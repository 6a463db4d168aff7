"""Policy losses (Eq. 4/5/9/11, GSPO) against loop-based reference computations, and the normaliser contract."""

import math

import pytest
import torch

from da3po_megatron.algorithms import ALGORITHM_REGISTRY, policy_loss

LENGTHS = [5, 1, 7, 3, 7, 4]
T = 8


def _batch(seed: int, noise: float, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = torch.zeros(B, T)
    for b, n in enumerate(LENGTHS):
        mask[b, T - n - 1 : T - 1] = 1.0  # left and right padding both present
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T if per_token_adv else 1, generator=g, dtype=torch.float64).squeeze(-1)
    # padding garbage must not leak into loss or gradient
    lp = torch.where(mask > 0, lp, torch.full_like(lp, -1e4))
    old = torch.where(mask > 0, old, torch.full_like(old, float("-inf")))
    if per_token_adv:
        adv = torch.where(mask > 0, adv, torch.full_like(adv, float("nan")))
    return lp, old, adv, mask


def _reference(lp, old, adv, mask, eps_low, eps_high, ratio_level, agg):
    """Straightforward loops over responses and tokens (scalar autograd ops)."""
    per_seq_terms = []
    for b in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if mask[b, t] > 0]
        if not toks:
            continue
        row = adv[b]
        a = (lambda t, row=row: row[t]) if adv.dim() == 2 else (lambda t, row=row: row)
        if ratio_level == "token":
            terms = []
            for t in toks:
                r = torch.exp(lp[b, t] - old[b, t])
                terms.append(-torch.min(r * a(t), torch.clamp(r, 1 - eps_low, 1 + eps_high) * a(t)))
        else:
            s = torch.exp(sum(lp[b, t] - old[b, t] for t in toks) / len(toks))
            a_seq = sum(a(t) for t in toks) / len(toks)
            term = -torch.min(s * a_seq, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a_seq)
            terms = [term] * len(toks)  # every token of the response carries the sequence loss
        per_seq_terms.append(terms)
    if agg == "token-mean":
        return sum(sum(ts) for ts in per_seq_terms) / sum(len(ts) for ts in per_seq_terms)
    return sum(sum(ts) / len(ts) for ts in per_seq_terms) / len(per_seq_terms)


@pytest.mark.parametrize("preset", sorted(ALGORITHM_REGISTRY))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_preset_loss_and_gradient_match_loop_reference(preset, per_token_adv):
    cfg = vars(ALGORITHM_REGISTRY[preset])
    lo, hi = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    noise = 2.0 * hi if cfg["ratio_level"] == "sequence" else 0.3  # so that some ratios clip on each side
    lp, old, adv, mask = _batch(seed=1, noise=noise, per_token_adv=per_token_adv)

    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        x, old, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi,
        ratio_level=cfg["ratio_level"], loss_agg_mode=cfg["loss_agg_mode"],
    )
    loss.backward()

    y = lp.clone().requires_grad_(True)
    ref = _reference(y, old, adv, mask, lo, hi, cfg["ratio_level"], cfg["loss_agg_mode"])
    ref.backward()

    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert (x.grad[mask == 0] == 0).all()
    assert x.grad.abs().sum() > 0
    assert metrics["clipfrac"].item() > 0, "the inputs must exercise the clip for this test to mean anything"
    assert metrics["num_tokens"].item() == sum(LENGTHS) and metrics["num_seqs"].item() == len(LENGTHS)


def test_grpo_and_dapo_aggregations_differ_on_unequal_lengths():
    lp, old, adv, mask = _batch(seed=2, noise=0.1)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    tok, _ = policy_loss(lp, old, adv, mask, loss_agg_mode="token-mean", **kw)
    seq, _ = policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-mean", **kw)
    assert abs(tok.item() - seq.item()) > 1e-3


def test_on_policy_loss_is_minus_mean_advantage_and_ratio_is_one():
    lp, _, adv, mask = _batch(seed=3, noise=0.0)
    loss, m = policy_loss(lp, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    want = -(adv.unsqueeze(1) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["approx_kl"].item() == 0.0 and m["clipfrac"].item() == 0.0


def test_clip_metrics_count_the_binding_side_only():
    r = torch.tensor([[0.5, 1.5, 1.0, 0.7, 1.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    # token 0: A<0, r<0.8 -> low binds; token 1: A>0, r>1.28 -> high binds;
    # tokens 3-5: clip range exceeded but on the side where min() keeps the unclipped term -> not counted
    mask = torch.ones_like(r)
    old = torch.zeros_like(r)
    _, m = policy_loss(r.log(), old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 6)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 6)
    assert m["clipfrac"].item() == pytest.approx(2 / 6)
    k3 = sum((x - 1) - math.log(x) for x in r[0].tolist()) / 6
    assert m["approx_kl"].item() == pytest.approx(k3, rel=1e-12)
    assert m["ratio_min"].item() == pytest.approx(0.5) and m["ratio_max"].item() == pytest.approx(1.5)


@pytest.mark.parametrize(
    "ratio_level,agg", [("token", "token-mean"), ("token", "seq-mean-token-mean"), ("sequence", "seq-mean-token-mean")]
)
def test_microbatch_split_with_global_normaliser_equals_whole_batch(ratio_level, agg):
    lp, old, adv, mask = _batch(seed=4, noise=0.3)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, ratio_level=ratio_level, loss_agg_mode=agg)
    whole_x = lp.clone().requires_grad_(True)
    whole, _ = policy_loss(whole_x, old, adv, mask, **kw)
    whole.backward()

    split_x = lp.clone().requires_grad_(True)
    n_tok, n_seq = int(mask.sum()), int((mask.sum(1) > 0).sum())
    total = torch.zeros((), dtype=torch.float64)
    for idx in ([0, 1], [2], [3, 4, 5]):  # uneven micro-batches (or DP ranks)
        part, _ = policy_loss(
            split_x[idx], old[idx], adv[idx], mask[idx], global_num_tokens=n_tok, global_num_seqs=n_seq, **kw
        )
        part.backward()  # gradients accumulate as in a real micro-batch loop
        total = total + part.detach()
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(split_x.grad, whole_x.grad, rtol=1e-10, atol=1e-14)


def test_local_normaliser_without_global_counts_differs_from_whole_batch():
    # documents WHY the global normaliser exists: local token-means do not add up to the batch loss
    lp, old, adv, mask = _batch(seed=5, noise=0.3)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    whole, _ = policy_loss(lp, old, adv, mask, **kw)
    halves = [policy_loss(lp[i], old[i], adv[i], mask[i], **kw)[0] for i in ([0, 1], [2, 3, 4, 5])]
    assert abs(sum(h.item() for h in halves) / 2 - whole.item()) > 1e-4


def test_empty_mask_gives_zero_loss_not_nan():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0 and m["ratio_mean"].item() == 1.0


def test_policy_loss_rejects_mismatched_shapes_and_modes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3), clip_ratio_low=0.2, clip_ratio_high=0.2,
                    loss_agg_mode="seq-mean-token-sum")
    with pytest.raises(ValueError, match="must all be"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 4), clip_ratio_low=0.2, clip_ratio_high=0.2)


def test_presets_encode_the_four_algorithms():
    reg = {k: vars(v) for k, v in ALGORITHM_REGISTRY.items()}
    assert reg["grpo"]["clip_ratio_low"] == reg["grpo"]["clip_ratio_high"]
    assert reg["dapo"]["clip_ratio_high"] > reg["dapo"]["clip_ratio_low"]
    assert reg["gspo"]["ratio_level"] == "sequence"
    da3po, dapo = dict(reg["da3po"]), dict(reg["dapo"])
    for d in (da3po, dapo):
        d.pop("name"), d.pop("note")
    assert da3po.pop("daa") and not dapo.pop("daa") and da3po == dapo  # DA3PO = DAPO + DAA
