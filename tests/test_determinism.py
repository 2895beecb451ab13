"""Two runs with the same seed give bitwise identical losses and parameters
(world size 2, fp32 and bf16 mixed precision), and match the reference."""

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import run_world
from models import TinyGPT, batch, loss_fn
from reference import reference_run

pytestmark = pytest.mark.world

STEPS = 4
LR = 1e-2
RTOL = 1e-5
POLICIES = {
    "fp32": fs.MixedPrecisionPolicy(),
    "bf16": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def _train(seed: int, policy: str):
    """Losses (this rank's, per step) and the full parameters after STEPS steps."""
    torch.manual_seed(seed)
    model = fs.flex_shard(TinyGPT(), mp_policy=POLICIES[policy])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), fs.full_state_dict(model)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_same_seed_gives_bitwise_identical_runs(policy):
    first, second = run_world(2, _train, 0, policy), run_world(2, _train, 0, policy)
    for (loss_a, params_a), (loss_b, params_b) in zip(first, second):
        assert torch.equal(loss_a, loss_b)
        assert _bitwise_equal(params_a, params_b)
    assert _bitwise_equal(first[0][1], first[1][1])  # every rank holds the same full params
    other = run_world(2, _train, 1, policy)  # the comparison can tell runs apart
    assert not torch.equal(other[0][0], first[0][0])
    assert not _bitwise_equal(other[0][1], first[0][1])


def test_deterministic_run_matches_reference():
    results = run_world(2, _train, 0, "fp32")
    ref_losses, reference, _ = reference_run(2, STEPS, lr=LR)
    mean_losses = (results[0][0] + results[1][0]) / 2  # equal batches: the global mean
    assert mean_losses.tolist() == pytest.approx(ref_losses, rel=RTOL)
    params = results[0][1]
    for k, want in reference.items():
        torch.testing.assert_close(params[k], want, rtol=RTOL, atol=RTOL * want.abs().max().item())
