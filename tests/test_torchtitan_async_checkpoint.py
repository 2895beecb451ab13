"""torchtitan's CheckpointManager with --checkpoint.async_mode on a flexshard-
parallelized llama debugmodel: the save taken at step K holds step K's params,
although training steps on (updating the params in place) while it is written."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from harness import run_world
from test_torchtitan import BATCH, SEQ, debugmodel, parallelize, titan_loss, tokens

SAVE_STEP = 2  # SGD steps before the save; one more runs while it is written
LR = 0.05  # plain SGD, so a step visibly moves every param


def _manager(model, folder: str, async_mode: str):
    """torchtitan's CheckpointManager as its Trainer builds it, model only."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1,
                                      async_mode=async_mode, keep_latest_k=0)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=None,
                             lr_schedulers=None, states={}, sd_adapter=None,
                             base_folder=folder)


def _step(model, opt, step: int, rank: int, world: int) -> None:
    titan_loss(model, tokens(step, rank), world * BATCH * SEQ).backward()
    opt.step()
    opt.zero_grad()


def _full(model) -> dict:
    return {k: v.clone() for k, v in fs.full_state_dict(model).items()}


def _save_async_then_load(folder: str, async_mode: str) -> tuple:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = parallelize(debugmodel(), world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    manager = _manager(model, folder, async_mode)
    for step in range(SAVE_STEP):
        _step(model, opt, step, rank, world)
    at_save = _full(model)
    assert manager.save(curr_step=SAVE_STEP)
    _step(model, opt, SAVE_STEP, rank, world)  # in place, while the write may still run
    manager.maybe_wait_for_saving()
    manager.close()
    moved = _full(model)

    fresh = parallelize(debugmodel(), world)  # at init, unlike the saved params
    loader = _manager(fresh, folder, "disabled")
    assert loader.load(step=SAVE_STEP)
    loader.close()
    loaded = _full(fresh)  # a collective: every rank gathers
    return (at_save, moved, loaded) if rank == 0 else None


def _reference(world: int) -> dict:
    """One process, every rank's batch, the same SGD steps up to the save."""
    model = debugmodel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(SAVE_STEP):
        rows = torch.cat([tokens(step, r) for r in range(world)])
        titan_loss(model, rows, world * BATCH * SEQ).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.world(2)
def test_async_checkpoint_holds_the_step_it_was_taken_at(tmp_path):
    """async_mode "async" (DCP async_save on the manager's own gloo group). Not
    "async_with_pinned_mem": its DefaultStager needs an accelerator (on CPU torch
    raises "Non-blocking copy requires that the current accelerator is available")."""
    at_save, moved, loaded = run_world(2, _save_async_then_load, str(tmp_path), "async",
                                       timeout=120)[0]
    ref = _reference(2)
    assert ref.keys() <= loaded.keys()
    for k, want in ref.items():
        torch.testing.assert_close(at_save[k], want, rtol=1e-5, atol=1e-6, msg=k)
        assert torch.equal(loaded[k], at_save[k]), f"{k}: the checkpoint is not step {SAVE_STEP}"
        assert not torch.equal(moved[k], at_save[k]), f"{k}: the next step changed nothing"



# Owned and RaggedShard params' state-dict values are flexshard's LivePieces (views of
# the sharded params, no DTensor): torchtitan's ModelWrapper compares their storage
# with its cached state dict's at every save.


def _pieces_round_trip(folder: str, placement) -> tuple:
    from models import TinyGPT, batch, loss_fn

    def model():
        torch.manual_seed(0)
        return fs.flex_shard(TinyGPT(), placement=placement)

    wrapped = model()
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    manager = _manager(wrapped, folder, "disabled")
    for step in range(2):
        loss_fn(wrapped(batch(step, 0)[0]), batch(step, 0)[1]).backward()
        opt.step()
        opt.zero_grad()
        assert manager.save(curr_step=step + 1)
    manager.close()
    fresh = model()
    loader = _manager(fresh, folder, "disabled")
    assert loader.load(step=2)
    loader.close()
    return _full(wrapped), _full(fresh)


@pytest.mark.world(2)
@pytest.mark.parametrize("placement", [fs.Owned(), fs.RaggedShard(units=(1, 2))],
                         ids=["owned", "ragged"])
def test_checkpoint_manager_saves_and_loads_pieces(tmp_path, placement):
    for saved, loaded in run_world(2, _pieces_round_trip, str(tmp_path), placement, timeout=120):
        assert saved.keys() == loaded.keys()
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k
