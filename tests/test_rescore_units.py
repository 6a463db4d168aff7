"""trainer/generation/rescore.py's pure functions (issue 47 point 8): the filter / DAA decision flips between a stale
and a current p_hat, their per-bucket counts, and the kept / dropped sample."""

from types import SimpleNamespace

from da3po_megatron.trainer.generation.rescore import decision_flips, flip_counts, pick_groups


def test_decision_flips_compare_the_filter_and_daa_decisions_of_two_p_hats():
    assert decision_flips(0.5, 0.5, 0.5) == (False, False)
    assert decision_flips(0.25, 0.0, 0.5) == (True, False)  # kept -> all wrong: dropped; both below tau
    assert decision_flips(0.375, 0.625, 0.5) == (False, True)  # still kept; DAA amplified before, not now
    assert decision_flips(1.0, 0.875, 0.5) == (True, False)  # all correct -> informative


def test_flip_counts_sum_per_bucket_and_overall():
    records = [(8, 0.25, 0.0, 2), (8, 0.25, 0.625, 1), (1, 1.0, 0.5, 0), (1, 0.75, 0.75, 3)]
    c = flip_counts(records, tau=0.5)
    assert c["rescore/groups"] == 4 and c["rescore/kept"] == 3 and c["rescore/dropped"] == 1
    assert c["rescore/kept_to_dropped"] == 1 and c["rescore/dropped_to_kept"] == 1 and c["rescore/daa_flips"] == 1
    assert c["rescore/bucket8/kept"] == 2 and c["rescore/bucket8/kept_to_dropped"] == 1
    assert c["rescore/bucket8/daa_flips"] == 1 and c["rescore/bucket8/p_diff_sum"] == 0.125
    assert c["rescore/bucket1/dropped_to_kept"] == 1 and c["rescore/age_sum"] == 6


def test_pick_groups_draws_up_to_m_of_each_kind_reproducibly():
    groups = [SimpleNamespace(p_hat=p) for p in (0.0, 0.5, 1.0, 0.25, 0.75, 0.0)]
    picked = pick_groups(groups, 2, seed=3)
    assert sum(0 < g.p_hat < 1 for g in picked) == 2 and sum(not 0 < g.p_hat < 1 for g in picked) == 2
    assert picked == pick_groups(groups, 2, seed=3)
    assert len(pick_groups(groups, 10, seed=0)) == 6


def test_the_study_pairs_policies_by_seed():
    import math

    from da3po_megatron.studies.compare import stats as study

    m, se, n = study.paired({0: 0.5, 1: 0.7, 2: 0.6, 9: 1.0}, {0: 0.4, 1: 0.5, 2: 0.6})  # seed 9 has no pair
    assert n == 3 and math.isclose(m, 0.1) and math.isclose(se, 0.1 / math.sqrt(3))  # sd of (0.1, 0.2, 0) = 0.1
    assert math.isnan(study.paired({0: 1.0}, {0: 0.0})[1])  # one seed: no standard error
