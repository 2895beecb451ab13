"""torch.distributed.checkpoint with flexshard: same-world round trips and
saving at 4 ranks, loading at 1, 2 and 3 with other placements."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from ckpt_util import PLACEMENTS, assert_rel_close, reference, train, wrapped
from harness import run_world

SAVE_STEPS = 3  # steps trained at 4 ranks before the checkpoint


def local_state(model, opt) -> dict:
    """fqn -> (bound placement, shape, local param, {state name: local tensor})."""
    from flexshard.state import get_state

    out = {}
    for bucket in get_state(model).buckets:
        for slot, p in zip(bucket.slots, bucket.params):
            st = {k: v.clone() for k, v in opt.state[p].items()}
            out[slot.fqn] = (slot.placement, slot.shape, p.detach().clone(), st)
    return out


def assemble(per_rank: list) -> tuple:
    """Full params and optimizer state from every rank's local_state."""
    params, optim = {}, {}
    for fqn, (placement, shape, _, st) in per_rank[0].items():
        params[fqn] = placement.unshard([r[fqn][2] for r in per_rank], shape)
        optim[fqn] = {k: (v if k == "step" else
                          placement.unshard([r[fqn][3][k] for r in per_rank], shape))
                      for k, v in st.items()}
    return params, optim


def _save_dcp(path, placement_name, steps):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = wrapped(placement_name)
    train(model, opt, range(steps), dist.get_rank())
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return local_state(model, opt)


def _load_dcp(path, placement_name, continue_steps):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = wrapped(placement_name, seed=1)  # other weights: the load must overwrite all
    model_sd, optim_sd = get_state_dict(model, opt)
    ptrs = {k: v.data_ptr() for k, v in model.named_parameters()}
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert ptrs == {k: v.data_ptr() for k, v in model.named_parameters()}, "params were rebound"
    loaded = local_state(model, opt)
    train(model, opt, continue_steps, dist.get_rank())
    return loaded, local_state(model, opt)


def assert_equal_state(a: tuple, b: tuple) -> None:
    params_a, optim_a = a
    params_b, optim_b = b
    assert params_a.keys() == params_b.keys()
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), k
        assert optim_a[k].keys() == optim_b[k].keys(), k
        for name in optim_a[k]:
            assert torch.equal(optim_a[k][name], optim_b[k][name]), f"{k}.{name}"


@pytest.mark.parametrize("placement", ["shard0", "uneven"])
def test_round_trip_same_world(tmp_path, placement):
    saved = assemble(run_world(2, _save_dcp, str(tmp_path), placement, 2))
    loaded = assemble([r[0] for r in run_world(2, _load_dcp, str(tmp_path), placement, [])])
    assert_equal_state(saved, loaded)


def _load_matrix(root, saves, loads, continue_step):
    """For each saved checkpoint and each load placement: load, record the
    loaded state, train one more step, record again."""
    return {(s, p): _load_dcp(f"{root}/{s}", p, [continue_step]) for s in saves for p in loads}


def test_reshard_matrix(tmp_path):
    saves, loads = ["shard0", "uneven"], list(PLACEMENTS)
    saved = {s: assemble(run_world(4, _save_dcp, str(tmp_path / s), s, SAVE_STEPS))
             for s in saves}
    for world in (1, 2, 3):
        ref_params, _ = reference([4] * SAVE_STEPS + [world])
        out = run_world(world, _load_matrix, str(tmp_path), saves, loads, SAVE_STEPS)
        for key in out[0]:
            loaded = assemble([r[key][0] for r in out])
            assert_equal_state(saved[key[0]], loaded)
            params, _ = assemble([r[key][1] for r in out])
            for k in ref_params:
                assert_rel_close(params[k], ref_params[k], 1e-5, f"{key} at {world} ranks: {k}")
