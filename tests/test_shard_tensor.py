"""examples/shard_tensor.py at 4 ranks, (data 2) x (domain 2): PhysicsNeMo ShardTensor
splits the images by rows over the domain mesh (its convolutions exchange the halo
rows), flexshard shards the params over all 4 ranks. Matches one process trained on
the whole images with SGD, whose step pins the gradient's scale."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from example_loader import load_example, single_thread
from harness import run_world

pytestmark = pytest.mark.world

STEPS = 3


def _example():
    return load_example("shard_tensor")


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _train(reshard_after_forward):
    return _example().train(STEPS, reshard_after_forward=reshard_after_forward)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_matches_one_process(reshard_after_forward):
    ref_losses, ref_first, ref_final = single_thread(_example().reference, STEPS)
    results = run_world(4, _train, reshard_after_forward)
    holds = [line for *_, line in results]
    assert holds[0].startswith("rank 0: data 0, domain 0: image rows 0..15 (16 of 32), 837 of 3058")
    assert holds[3].startswith("rank 3: data 1, domain 1: image rows 16..31 (16 of 32), 692 of 3058")
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for rank, (losses, first, final, _) in enumerate(results):
        _close(torch.tensor(losses), torch.tensor(ref_losses), f"rank {rank} losses")
        assert first.keys() == ref_first.keys() == final.keys()
        for name in ref_first:  # after one SGD step: the first gradient, scale included
            _close(first[name], ref_first[name], f"rank {rank} {name} after step 1")
            _close(final[name], ref_final[name], f"rank {rank} {name} after step {STEPS}")


def _domain_grads():
    """One step of the plain model (no flexshard) on ShardTensor rows: each rank's
    weight gradients, and this replica's images."""
    ex = _example()
    with ex.physicsnemo_on_cpu():
        mesh = ex.make_mesh()
        model = ex.make_model()
        x, y = ex.batch(0)
        (model(ex.scatter_rows(x, mesh)) - ex.scatter_rows(y, mesh)).square().mean().backward()
        per_replica = ex.SAMPLES // mesh.data
        mine = slice(mesh.data_rank * per_replica, (mesh.data_rank + 1) * per_replica)
        return {k: p.grad for k, p in model.named_parameters()}, mine, dist.get_rank()


def test_shard_tensor_sums_weight_gradients_over_the_domain_mesh():
    """The convention flex_shard's default divide factor relies on: both domain ranks
    of a replica hold that replica's whole gradient (not a share of it)."""
    ex = _example()
    for grads, mine, rank in run_world(4, _domain_grads):
        model = ex.make_model()
        x, y = ex.batch(0)
        single_thread(lambda: (model(x[mine]) - y[mine]).square().mean().backward())
        for name, p in model.named_parameters():
            _close(grads[name], p.grad, f"rank {rank} {name}")


def _bf16_against_fsdp2():
    """flexshard over data x domain and FSDP2 over data (PhysicsNeMo's recipe), both with
    bf16 params and fp32 reduction, on the same ShardTensor batches: (losses, full params
    after the first and last SGD step) of each."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ex = _example()
    out = {}
    with ex.physicsnemo_on_cpu():
        mesh = ex.make_mesh()
        for library in ("flexshard", "fsdp2"):
            model = ex.make_model()
            if library == "flexshard":
                policy = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                model = fs.flex_shard(model, mesh.world, mp_policy=policy)
                full = lambda: fs.full_state_dict(model)  # noqa: E731
            else:
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                fully_shard(model, mesh=mesh.data_mesh, mp_policy=policy)
                full = lambda: {k: v.full_tensor() for k, v in model.state_dict().items()}  # noqa: E731
            opt = torch.optim.SGD(model.parameters(), lr=ex.LR)
            losses, snapshots = [], []
            for step in range(STEPS):
                x, y = ex.batch(step)
                pred = model(ex.scatter_rows(x, mesh))
                assert pred.dtype == torch.bfloat16, pred.dtype  # the input was cast
                loss = (pred.float() - ex.scatter_rows(y, mesh)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.full_tensor().item())
                if step in (0, STEPS - 1):
                    snapshots.append(full())
            out[library] = (losses, snapshots)
    return out


def test_bf16_params_with_shard_tensor_inputs_match_fsdp2_over_data():
    """flex_shard's pre-forward hook casts a ShardTensor input to the param dtype as
    FSDP2's does; training then matches FSDP2 with the same policy step for step."""
    for rank, out in enumerate(run_world(4, _bf16_against_fsdp2)):
        (losses, snaps), (ref_losses, ref_snaps) = out["flexshard"], out["fsdp2"]
        assert ref_losses[-1] < ref_losses[0]
        _close(torch.tensor(losses), torch.tensor(ref_losses), f"rank {rank} losses")
        for got, want in zip(snaps, ref_snaps):
            assert got.keys() == want.keys()
            for name in want:
                _close(got[name], want[name], f"rank {rank} {name}")
