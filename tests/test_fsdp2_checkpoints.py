"""fs.load_checkpoint reads the DCP checkpoints FSDP2 users write: DSD's
state dicts under the DCP tutorial's {"model", "optimizer"}, an {"app":
Stateful}, or the model's keys at the top level; anything else is refused
with the keys found and the keys needed."""

from __future__ import annotations

import torch

import flexshard as fs
from ckpt_util import LR, assert_rel_close, reference, train, wrapped
from harness import expect_all_ranks_raise, run_world
from reference import make_model
from test_dcp_reshard import assemble, local_state

STEPS = 2


class AppState:
    """The DCP tutorial's Stateful: model and optimizer through DSD."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict) -> None:
        raise AssertionError("only saved here")


def _fsdp2_save(path, layout):
    """Train TinyGPT under FSDP2 (one fully_shard per block, then the root) and save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, opt, range(STEPS), dist.get_rank())
    if layout == "tutorial":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    elif layout == "app":
        dcp.save({"app": AppState(model, opt)}, checkpoint_id=path)
    elif layout == "top":
        dcp.save(get_model_state_dict(model), checkpoint_id=path)
    else:
        dcp.save({"net": get_model_state_dict(model)}, checkpoint_id=path)


def _flexshard_load(path, with_optimizer):
    model, opt = wrapped("uneven", seed=1)  # other weights and placements than saved
    step = fs.load_checkpoint(path, model, opt if with_optimizer else None)
    return step, local_state(model, opt) if with_optimizer else fs.full_state_dict(model)


def test_fsdp2_layouts_load(tmp_path):
    ref_params, ref_optim = reference([2] * STEPS)  # one process on the same batches
    for layout, with_optimizer in (("tutorial", True), ("app", True), ("top", False)):
        path = str(tmp_path / layout / f"step-{STEPS}")
        run_world(2, _fsdp2_save, path, layout)
        for world in (1, 2):
            out = run_world(world, _flexshard_load, path, with_optimizer)
            assert [r[0] for r in out] == [STEPS] * world  # the step-N directory name
            if with_optimizer:
                params, optim = assemble([r[1] for r in out])
                for k in ref_params:
                    assert_rel_close(optim[k]["exp_avg"], ref_optim[k]["exp_avg"], 1e-5, k)
            else:
                params = out[0][1]
            for k in ref_params:
                assert_rel_close(params[k], ref_params[k], 1e-5, f"{layout} at {world}: {k}")


def test_other_layout_names_found_and_needed_keys(tmp_path):
    path = str(tmp_path / "net")
    run_world(2, _fsdp2_save, path, "net")
    expect_all_ranks_raise(2, _flexshard_load, ValueError,
                           r"looks for every parameter under one of 'model\.', 'app\.model\.' or "
                           r"the top level \(e\.g\. 'model\.pos'\), and it holds \d+ keys: "
                           r"\['net\.pos'\] and \d+ more", path, False)
