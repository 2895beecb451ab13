"""torch.distributed.checkpoint with flexshard: same-world round trips and
saving at 4 ranks, loading at 1, 2 and 3 with other placements."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from ckpt_util import PLACEMENTS, assert_rel_close, reference, train, wrapped
from harness import expect_all_ranks_raise, run_world

SAVE_STEPS = 3  # steps trained at 4 ranks before the checkpoint


def local_state(model, opt) -> dict:
    """fqn -> (bound placement, shape, local param, {state name: local tensor})."""
    from flexshard.runtime.state import get_state

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


# fs.save_checkpoint / fs.load_checkpoint: atomic saves, resume, errors.


def _train_and_save(root, placement_name, steps):
    import torch.distributed as dist

    model, opt = wrapped(placement_name)
    train(model, opt, range(steps), dist.get_rank())
    return fs.save_checkpoint(root, model, opt, step=steps)


def _resume(root, placement_name, more_steps):
    import torch.distributed as dist

    model, opt = wrapped(placement_name, seed=1)
    step = fs.load_checkpoint(root, model, opt)
    train(model, opt, range(step, step + more_steps), dist.get_rank())
    return step, local_state(model, opt)


def test_resume_on_another_world_size(tmp_path):
    path = run_world(2, _train_and_save, str(tmp_path), "shard0", 2)[0]
    assert path == str(tmp_path / "step_00000002")
    out = run_world(3, _resume, str(tmp_path), "uneven", 1)
    assert [r[0] for r in out] == [2, 2, 2]
    params, _ = assemble([r[1] for r in out])
    ref_params, _ = reference([2, 2, 3])
    for k in ref_params:
        assert_rel_close(params[k], ref_params[k], 1e-5, k)


class SimulatedCrash(RuntimeError):
    pass


def _crash_then_resume(root):
    """Save step 1; crash while saving step 2 (before DCP's metadata is
    written); load: step 1 comes back. Then save steps 2 and 3 with keep=2."""
    import os
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    rank = dist.get_rank()
    model, opt = wrapped("shard0")
    train(model, opt, [0], rank)
    fs.save_checkpoint(root, model, opt, step=1)
    at_step1 = local_state(model, opt)
    train(model, opt, [1], rank)
    crashed = False
    with mock.patch.object(FileSystemWriter, "finish", side_effect=SimulatedCrash("power cut")):
        try:
            fs.save_checkpoint(root, model, opt, step=2)
        except CheckpointException as e:  # DCP re-raises rank 0's failure on every rank
            crashed = isinstance(e.failures[0][0], SimulatedCrash)
    left = sorted(os.listdir(root))
    fresh, fresh_opt = wrapped("shard0", seed=1)
    step = fs.load_checkpoint(root, fresh, fresh_opt)
    loaded = local_state(fresh, fresh_opt)
    fs.save_checkpoint(root, model, opt, step=2, keep=2)
    fs.save_checkpoint(root, model, opt, step=3, keep=2)
    return crashed, left, step, at_step1, loaded, sorted(os.listdir(root))


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    out = run_world(2, _crash_then_resume, str(tmp_path))
    for crashed, left, step, *_ in out:
        assert crashed
        assert left == [".tmp-step_00000002", "step_00000001"]
        assert step == 1
    assert_equal_state(assemble([r[3] for r in out]), assemble([r[4] for r in out]))
    assert out[0][5] == ["step_00000002", "step_00000003"]


def _load_into(root, model_kw=None, with_optimizer=True):
    model, opt = wrapped("shard0", **(model_kw or {}))
    return fs.load_checkpoint(root, model, opt if with_optimizer else None)


def _save_model_only(root):
    model, _ = wrapped("shard0")
    fs.save_checkpoint(root, model, step=5)


def test_missing_checkpoint_errors(tmp_path):
    expect_all_ranks_raise(2, _load_into, FileNotFoundError, r"no checkpoint at .*not a directory",
                           str(tmp_path / "nope"))
    expect_all_ranks_raise(2, _load_into, FileNotFoundError, r"no checkpoint in .*step_\*",
                           str(tmp_path))


def test_partial_checkpoint_error(tmp_path):
    run_world(2, _train_and_save, str(tmp_path), "shard0", 1)
    (tmp_path / "step_00000001" / ".metadata").unlink()
    expect_all_ranks_raise(2, _load_into, ValueError,
                           r"incomplete: \.metadata is missing from \['step_00000001'\]",
                           str(tmp_path))


def test_checkpoint_of_another_model_names_the_key(tmp_path):
    run_world(2, _save_model_only, str(tmp_path))
    assert run_world(2, _load_into, str(tmp_path), None, False) == [5, 5]
    expect_all_ranks_raise(2, _load_into, ValueError,
                           r"'model\.pos' has shape \(11, 30\) but the model's is \(11, 33\)",
                           str(tmp_path), {"dim": 33}, False)
    expect_all_ranks_raise(2, _load_into, ValueError,
                           r"holds the model under 'model\.' but not this optimizer's state: it "
                           r"needs e\.g\. \['optim\.state\.pos\.step'\]",
                           str(tmp_path))


def test_unwritable_directory(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    expect_all_ranks_raise(2, _save_model_only, ValueError,
                           r"cannot write checkpoints to .*a_file/ckpt.*NotADirectoryError",
                           str(tmp_path / "a_file" / "ckpt"))


def test_single_process_without_process_group(tmp_path):
    model, opt = wrapped("shard0")  # no process group: world size 1, plain tensors
    train(model, opt, [0, 1], 0)
    fs.save_checkpoint(str(tmp_path), model, opt, step=2)
    fresh, fresh_opt = wrapped("shard0", seed=1)
    assert fs.load_checkpoint(str(tmp_path / "step_00000002"), fresh, fresh_opt) == 2
    for (k, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), k
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"]), k


@pytest.mark.parametrize("call, error, match", [
    (lambda m, o, d: fs.save_checkpoint(123, m), TypeError,
     r"directory must be a str or os\.PathLike, got 123"),
    (lambda m, o, d: fs.save_checkpoint(d, m, "adam"), TypeError,
     r"optimizer must be a torch\.optim\.Optimizer or None, got str"),
    (lambda m, o, d: fs.save_checkpoint(d, m, o, step=-1), ValueError,
     r"step must be an int >= 0, got -1"),
    (lambda m, o, d: fs.save_checkpoint(d, m, o, step=1, keep=0), ValueError,
     r"keep must be None or an int >= 1, got 0"),
    (lambda m, o, d: fs.load_checkpoint(None, m, o), TypeError,
     r"path must be a str or os\.PathLike, got None"),
])
def test_checkpoint_argument_errors(tmp_path, call, error, match):
    model, opt = wrapped("shard0")
    with pytest.raises(error, match=match):
        call(model, opt, str(tmp_path))


def _permuted_mesh_round_trip(path, dim):
    """Saved from a model on DeviceMesh("cpu", [1, 0]) (mesh positions the reverse of
    the ranks' order, which the gathers follow), loaded on the default mesh: the
    values saved. `dim` sizes the model's rows: even (divisible by 2) or odd."""
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    model = fs.flex_shard(nn.Sequential(nn.Linear(7, dim), nn.Linear(dim, 5)),
                          mesh=DeviceMesh("cpu", [1, 0]), placement=fs.Shard(0))
    saved = fs.full_state_dict(model)
    fs.save_checkpoint(path, model, None, step=1)
    torch.manual_seed(1)
    other = fs.flex_shard(nn.Sequential(nn.Linear(7, dim), nn.Linear(dim, 5)),
                          placement=fs.Shard(0))
    fs.load_checkpoint(path, other)
    return saved, fs.full_state_dict(other)


@pytest.mark.parametrize("dim", [12, 13], ids=["even", "odd"])
def test_a_permuted_mesh_saves_its_pieces_where_they_lie(tmp_path, dim):
    """Shard(0) pieces follow the shard group's rank order; a DTensor on that mesh
    would place them by mesh position: before, the even model loaded with its halves
    swapped and the odd one failed in DCP ("mismatch sizes")."""
    for saved, loaded in run_world(2, _permuted_mesh_round_trip, str(tmp_path / "c"), dim):
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k
