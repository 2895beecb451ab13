"""HSDP checkpoints: saved under a (2, 2) mesh, loaded into a 1-D world of 2
ranks (and of 3) with another placement, saved there and loaded back under (2, 2);
model and optimizer state, against a single process whose world size changes
mid-run (ckpt_util.reference)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from ckpt_util import LR, PLACEMENTS, assert_rel_close, reference, train
from harness import run_world
from reference import make_model
from test_dcp_reshard import assemble, assert_equal_state, local_state
from test_hsdp import hsdp_mesh, mixed

pytestmark = pytest.mark.world


def hsdp_wrapped(placement, seed: int = 0):
    model = fs.flex_shard(make_model(seed), hsdp_mesh((2, 2)), placement=placement)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _value_kinds(model) -> dict:
    """fqn -> how model.state_dict() describes the param on the 2-D mesh."""
    from torch.distributed.tensor import DTensor

    out = {}
    for fqn, value in model.state_dict().items():
        if isinstance(value, DTensor):
            out[fqn] = ("DTensor", value.device_mesh.ndim, tuple(map(repr, value.placements)))
        else:  # state_dict() gives LivePieces, a ShardedPieces
            out[fqn] = (type(value).__mro__[1].__name__, tuple(value.shape))
    return out


def _save_hsdp(root, steps):
    """Under (2, 2) with Owned, Shard(0) and RaggedShard params: train, save."""
    model, opt = hsdp_wrapped(mixed)
    train(model, opt, range(steps), dist.get_rank())
    fs.save_checkpoint(root, model, opt, step=steps)
    return local_state(model, opt), _value_kinds(model)


def _load_flat_and_save(src, dst, placement_name):
    """A 1-D world, another placement: load, train one step, save (when `dst`)."""
    model = fs.flex_shard(make_model(1), placement=PLACEMENTS[placement_name])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = fs.load_checkpoint(src, model, opt)
    loaded = local_state(model, opt)
    train(model, opt, [step], dist.get_rank())
    if dst is not None:
        fs.save_checkpoint(dst, model, opt, step=step + 1)
    return loaded, local_state(model, opt)


def _load_hsdp_and_step(src):
    """Back under (2, 2) with Owned params: load, train one step."""
    model, opt = hsdp_wrapped(fs.Owned(), seed=1)
    step = fs.load_checkpoint(src, model, opt)
    train(model, opt, [step], dist.get_rank())
    return step, local_state(model, opt)


def _assert_each_chunk_once(path) -> None:
    """Replicas hold the same chunks; DCP writes each once (its dedup by index)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata) and k.startswith("model.")}
    assert tensors, "no model tensors in the checkpoint"
    for key, meta in tensors.items():
        offsets = [tuple(c.offsets) for c in meta.chunks]
        assert len(offsets) == len(set(offsets)), f"{key}: chunks saved twice: {offsets}"
        assert sum(c.sizes.numel() for c in meta.chunks) == meta.size.numel(), key


def test_hsdp_to_one_dimensional_and_back(tmp_path):
    first, second = str(tmp_path / "hsdp"), str(tmp_path / "flat")
    saved = run_world(4, _save_hsdp, first, 2)
    kinds = saved[0][1]
    # Shard(0) pieces are DTensor chunks: replicated on dim 0, sharded on dim 1.
    assert kinds["layers.0.down.weight"] == ("DTensor", 2, ("Replicate()", "Shard(dim=0)"))
    assert kinds["layers.0.qkv.weight"] == ("ShardedPieces", (90, 30))  # Owned
    _assert_each_chunk_once(first + "/step_00000002")
    at_save = assemble([r[0] for r in saved[:2]])  # shard group 0: ranks 0 and 1
    assert_equal_state(assemble([r[0] for r in saved[2:]]), at_save)  # its replica
    for world, placement in ((3, "uneven"), (2, "ragged")):  # the 2-rank world saves
        flat = run_world(world, _load_flat_and_save, first + "/step_00000002",
                         second if world == 2 else None, placement)
        assert_equal_state(at_save, assemble([r[0] for r in flat]))
        ref_params, _ = reference([4, 4, world])
        params, _ = assemble([r[1] for r in flat])
        for k in ref_params:
            assert_rel_close(params[k], ref_params[k], 1e-5, f"after a step at {world}: {k}")
    back = run_world(4, _load_hsdp_and_step, second)
    assert [r[0] for r in back] == [3] * 4
    ref_params, _ = reference([4, 4, 2, 4])
    params, _ = assemble([r[1] for r in back[:2]])
    for k in ref_params:
        assert_rel_close(params[k], ref_params[k], 1e-5, f"back under (2, 2): {k}")
    assert_equal_state(assemble([r[1] for r in back[2:]]), assemble([r[1] for r in back[:2]]))
