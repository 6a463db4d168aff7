"""What the weight-sync tests compare engines against: a transformers model, perturbed, and its teacher-forced
log-probs of the tokens an engine sampled."""

from __future__ import annotations

import copy

import torch


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every parameter (reproducible by seed)."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


def max_logprob_diff(model: torch.nn.Module, groups) -> float:
    """Largest |engine log-prob - model log-prob| over every sampled token of ``groups`` (lists of Completions)."""
    worst = 0.0
    for group in groups:
        for c in group:
            ids = torch.tensor([list(c.prompt_token_ids) + list(c.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(c.prompt_token_ids)
            ref = logp[p - 1:-1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst
