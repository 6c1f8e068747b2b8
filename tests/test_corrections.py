"""Off-policy rejection (learner.corrections): which tokens and sequences each rule keeps, that dropped tokens leave
the loss's token count (not only its numerator), IcePop as token rejection plus the TIS cap, and the mismatch KL
as an unbiased estimate of KL(pi_rollout || pi_old)."""

import dataclasses
import math

import pytest
import torch

from learner.batch import build_batch
from learner.corrections import REJECTIONS, geometric_band, mismatch_kl, reject, token_band
from learner.losses import LossScale, policy_loss
from orchestrator.config import load_config


def _scale(mask):
    return LossScale(num_seqs=mask.shape[0], num_tokens=int(mask.sum()), max_len=mask.shape[1])


def _logs(ratios):
    return torch.log(torch.tensor(ratios, dtype=torch.float32))


def test_token_band_keeps_the_tokens_whose_ratio_is_inside_and_never_padding():
    rollout = torch.zeros(2, 4)
    old = _logs([[1.0, 0.4, 2.5, 1.9], [0.55, 1.0, 9.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    keep = token_band(old, rollout, mask, 0.5, 2.0)
    assert keep.tolist() == [[True, False, False, True], [True, True, False, False]]


def test_geometric_band_keeps_or_drops_whole_sequences_by_their_geometric_mean():
    """A long sequence drifting a little per token and a short one with one large ratio: the length-normalized
    mean decides, and every token of a sequence shares the verdict."""
    rollout = torch.zeros(3, 4)
    old = _logs([[1.2, 1.2, 1.2, 1.2],  # geometric mean 1.2: outside [0.9, 1.1]
                 [3.0, 1.0, 1.0, 1.0],  # only 3 tokens real: (3 * 1 * 1)^(1/3) = 1.44: outside
                 [1.05, 0.95, 1.05, 1.0]])  # ~1.012: inside
    mask = torch.tensor([[1.0] * 4, [1.0, 1.0, 1.0, 0.0], [1.0] * 4])
    keep = geometric_band(old, rollout, mask, 0.9, 1.1)
    assert keep.tolist() == [[False] * 4, [False] * 4, [True] * 4]
    assert set(REJECTIONS) == {"token", "geometric"}


def test_rejected_tokens_leave_the_loss_denominator():
    """The driver's rejection zeroes the dropped tokens in the actor's response mask, so the global token count the
    loss divides by holds only the kept ones: the loss is the mean over kept tokens (a rejection that zeroed only the
    weights would divide by all four and shrink the loss, the mistake slime fixed in its MIS)."""
    batch = build_batch([[1, 2]], [[3, 4, 5, 6]], [[0.0, 0.0, 0.0, 0.0]], pad_id=0)
    batch.old_logprobs = _logs([[1.0, 3.0, 1.0, 0.1]])
    mask, metrics = reject("token", batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, 0.5, 2.0)
    kept = dataclasses.replace(batch, response_mask=mask).with_scale()
    assert kept.scale.num_tokens == 2 and metrics["off_policy/rejected_token_frac"] == pytest.approx(0.5)
    assert metrics["off_policy/rejected_seq_frac"] == 0.0
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    logp = batch.old_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, batch.old_logprobs, adv, mask, kept.scale, tis_cap=2.0,
                          rollout_logp=batch.rollout_logprobs)
    assert loss.item() == pytest.approx((-1.0 * 1.0 + 1.0 * 1.0) / 2)  # tokens 0 and 2: -A r * w, r = 1, w = 1


def test_icepop_is_token_rejection_with_the_cap_at_the_bands_top():
    """IcePop (Ring-1T): weight M(k) = k inside [a, b], 0 outside, k = pi_old / pi_rollout. Token rejection with the
    band [a, b] and algorithm.tis_cap = b gives that weight on every token."""
    a, b = 0.5, 5.0
    k = torch.tensor([[0.3, 0.8, 1.0, 4.0, 6.0]])
    old, rollout = torch.log(k), torch.zeros_like(k)
    logp = old.clone().requires_grad_(True)
    mask, _ = reject("token", old, rollout, torch.ones_like(k), a, b)
    adv = torch.ones_like(k)
    loss, _ = policy_loss(logp, old, adv, mask, _scale(mask), tis_cap=b, rollout_logp=rollout)
    loss.backward()
    m_k = torch.where((k >= a) & (k <= b), k, torch.zeros_like(k))
    assert torch.allclose(logp.grad, -m_k / 3)  # d(-r A M(k))/dlogp at r = 1, mean over the 3 kept tokens


def test_mismatch_kl_estimates_the_kl_from_the_rollouts_samples():
    """Tokens drawn from pi_rollout (q), the learner's pi_old (p) another distribution: the k3 mean converges to
    KL(q || p), and is 0 when the two agree."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.3, 0.3, 0.4])
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=g)
    rollout, old = q.log()[tokens][None], p.log()[tokens][None]
    exact = float((q * (q / p).log()).sum())
    assert mismatch_kl(old, rollout, torch.ones_like(old)).item() == pytest.approx(exact, rel=0.02)
    assert mismatch_kl(rollout, rollout, torch.ones_like(old)).item() == 0.0
    assert not math.isclose(exact, 0.0)


def test_a_rejection_adds_the_learners_logprob_pass_and_its_band_must_surround_one():
    from orchestrator.loops.policy import separate_logprob_pass

    assert not separate_logprob_pass(load_config(None, []))
    assert separate_logprob_pass(load_config(None, ["algorithm.rejection=geometric"]))
    with pytest.raises(Exception, match=r"rejection_band must be \[low, high\] with 0 <= low < 1 < high"):
        load_config(None, ["algorithm.rejection_band=[1.2, 2.0]"])
