"""Trainer middle steps without Ray/vLLM/Megatron: groups, advantages + DAA, batch assembly, statistics, checkpoints."""

from dataclasses import dataclass

import pytest
import torch

from da3po_megatron.algorithms import DynamicSamplingBuffer, apply_daa, group_advantages
from da3po_megatron.data.datasets import Example
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.resume.checkpoint import CheckpointManager


@dataclass
class FakeCompletion:  # the rollout Completion fields the trainer reads (plain data, not an engine mock)
    prompt_token_ids: list
    token_ids: list
    text: str
    logprobs: list
    finish_reason: str = "stop"


def _groups(accs, lengths=None, G=4):
    exs = [Example(uid=f"u{i}", prompt=[{"role": "user", "content": "q"}], answer="1", source="s",
                   meta={"bucket": i % 2}) for i in range(len(accs))]
    comps, flat = [], []
    for i, acc in enumerate(accs):
        lens = lengths[i] if lengths else [3] * G
        comps.append([FakeCompletion([7, 8], list(range(n)), "x", [-0.5] * n, "length" if n >= 10 else "stop")
                      for n in lens])
        flat += acc
    return B.make_groups(exs, comps, flat, max_response_length=10, overlong_buffer=4)


def test_groups_carry_p_hat_and_overlong_shaped_rewards():
    gs = _groups([[1, -1, -1, -1]], lengths=[[3, 6, 8, 12]])
    g = gs[0]
    assert g.p_hat == 0.25
    # L_max=10, L_cache=4: R_len = 0 for |o| <= 6, ((10-4) - |o|)/4 in (6, 10], -1 beyond (Eq. 8)
    assert g.rewards == [1.0, -1.0, -1.0 + (6 - 8) / 4, -2.0]


def test_advantages_match_eq3_and_daa_amplifies_only_correct_hard_responses():
    gs = _groups([[1, -1, -1, -1], [1, 1, 1, -1]])
    stats = B.compute_advantages(gs, eps=1e-6, daa=True, lambda_=2.0, tau=0.5)
    rewards = torch.tensor([r for g in gs for r in g.rewards], dtype=torch.float64)
    correct = torch.tensor([a > 0 for g in gs for a in g.acc])
    p_hat = torch.tensor([0.25] * 4 + [0.75] * 4)
    expected = apply_daa(group_advantages(rewards, 4, eps=1e-6), correct, p_hat, 2.0, 0.5)
    got = torch.tensor([a for g in gs for a in g.advantages], dtype=torch.float64)
    assert torch.allclose(got, expected)
    # only the single correct response of the hard group (p_hat 0.25 < tau) is amplified
    plain = group_advantages(rewards, 4, eps=1e-6)
    changed = (got != plain).nonzero().flatten().tolist()
    assert changed == [0] and got[0] == pytest.approx(2 * plain[0].item())
    assert stats["daa/activation_frac"] == pytest.approx(1 / 8)


def test_daa_off_leaves_eq3_advantages():
    gs = _groups([[1, -1, -1, -1]])
    B.compute_advantages(gs, eps=1e-6, daa=False, lambda_=2.0, tau=0.5)
    plain = group_advantages(torch.tensor(gs[0].rewards, dtype=torch.float64), 4, eps=1e-6)
    assert gs[0].advantages == pytest.approx(plain.tolist())


def test_policy_batch_is_group_major_with_rollout_logprobs():
    gs = _groups([[1, -1, -1, -1], [1, 1, -1, -1]])
    B.compute_advantages(gs, eps=1e-6, daa=True, lambda_=2.0, tau=0.5)
    pb = B.policy_batch(gs)
    assert len(pb) == 8 and pb.prompt_ids[0].tolist() == [7, 8]  # int32 / float32 arrays (issue 36)
    assert pb.advantages.tolist() == [a for g in gs for a in g.advantages]
    assert pb.old_logprobs[0].tolist() == [-0.5] * 3


def test_stats_count_uniform_groups_and_buckets():
    gs = _groups([[1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, -1, -1]])
    s = B.group_stats(gs, 10, "gen")
    assert s["gen/p_hat_all_correct_frac"] == pytest.approx(1 / 3)
    assert s["gen/p_hat_all_wrong_frac"] == pytest.approx(1 / 3)
    assert s["gen/acc_bucket/0"] == pytest.approx((4 + 1) / 8)
    assert sum(v for k, v in s.items() if "p_hat_hist" in k) == pytest.approx(1.0)
    assert sum(v for k, v in s.items() if "/group_frac_bucket/" in k) == pytest.approx(1.0)  # shares of the groups


def test_dynamic_sampling_with_trainer_groups_keeps_informative_ones():
    gs = _groups([[1, 1, 1, 1], [1, -1, -1, -1], [-1, -1, -1, -1], [1, 1, -1, -1]])
    buf = DynamicSamplingBuffer(2, "drop", 4)
    buf.add(gs, [g.p_hat for g in gs])
    assert buf.is_full and [g.example.uid for g in buf.take()] == ["u1", "u3"]


def test_checkpoint_manager_is_atomic_and_keeps_last_k(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2)
    assert m.latest() is None

    def save_policy(p):
        p.mkdir()
        (p / "w").write_text("x")

    for step in (1, 2, 3):
        m.save(step, save_policy, {"step": step})
    assert m.latest().name == "step_000003"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert m.load_trainer_state(m.latest())["step"] == 3

    def crash(p):
        p.mkdir()
        raise KeyboardInterrupt  # killed while writing step 4

    with pytest.raises(KeyboardInterrupt):
        m.save(4, crash, {"step": 4})
    assert m.latest().name == "step_000003"  # the half-written step 4 is invisible


def test_theory_stats_kept_over_all_ratio_is_the_inverse_survival_fraction():
    """What `theory_stats` documents: uniform groups have zero advantage, so kept/all = N_all / N_kept per label and
    bin -- here an unsolved prompt (p_hat = 0) makes the incorrect ratio of the p_hat < 0.5 bin exceed alpha-."""
    accs = [[1, -1, -1, -1], [1, 1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1], [1, -1, -1, -1]]
    gs = _groups(accs)
    kept = [g for g in gs if 0 < g.p_hat < 1]
    out = B.theory_stats(gs, kept, eps=1e-6)
    low = [g for g in gs if g.p_hat < 0.5]  # bin 0.0-0.5: the two p_hat = 0.25 groups and the two all-wrong ones
    low_kept = [g for g in kept if g.p_hat < 0.5]
    n_all = sum(a < 0 for g in low for a in g.acc)
    n_kept = sum(a < 0 for g in low_kept for a in g.acc)
    ratio = out["theory/0.0-0.5/adv_incorrect_kept"] / out["theory/0.0-0.5/adv_incorrect_all"]
    assert ratio == pytest.approx(n_all / n_kept) and n_all / n_kept == 14 / 6
    assert ratio > out["theory/0.0-0.5/alpha_minus"]
    correct = out["theory/0.0-0.5/adv_correct_kept"] / out["theory/0.0-0.5/adv_correct_all"]
    assert correct == pytest.approx(1.0)  # every correct response of this bin sits in a kept group
