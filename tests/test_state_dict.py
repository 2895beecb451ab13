"""module.state_dict() / load_state_dict() of a wrapped model: values with the
full shape, in-place loads, DCP's get/set_model_state_dict with full tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import flexshard as fs
from ckpt_util import FlatRange, OnOneRank, wrapped
from flexshard.checkpoint.pieces import piece_boxes
from harness import expect_all_ranks_raise, run_world
from reference import make_model

# Pure box math (no process group).


def _covered(placement, shape, rank, world) -> torch.Tensor:
    """The full tensor's flat indices in the piece's order, rebuilt from its boxes."""
    full = torch.arange(math.prod(shape)).view(shape)
    out = torch.full((math.prod(placement.local_shape(torch.Size(shape), rank, world)),), -1)
    for box in piece_boxes(placement, shape, rank, world):
        block = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        out[box.start:box.start + block.numel()] = block.reshape(-1)
    return out


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Shard(1), fs.Shard(-1), fs.Owned(),
                                       fs.RaggedShard(), fs.RaggedShard((0, 1)), FlatRange(),
                                       OnOneRank(1)], ids=repr)
@pytest.mark.parametrize("shape", [(37, 30), (5, 3), (3, 7, 4), (2, 1, 5)])
def test_boxes_cover_exactly_the_piece(placement, shape):
    for world in (1, 2, 3, 4):
        bound = placement.bind(torch.Size(shape), 4, world, (0,) * world)
        for rank in range(world):
            piece = bound.shard(torch.arange(math.prod(shape)).view(shape), rank, world)
            assert torch.equal(_covered(bound, shape, rank, world), piece.reshape(-1))


def test_box_counts():
    assert len(piece_boxes(fs.Shard(1), (37, 30), 1, 4)) == 1  # a strided view: one box
    assert piece_boxes(OnOneRank(0), (37, 30), 1, 2) == ()  # an empty piece: no box
    boxes = piece_boxes(FlatRange(), (5, 3), 1, 2)  # flat [8, 15): row 2 from col 2, rows 3-4
    assert [(b.offsets, b.sizes, b.start) for b in boxes] == [((2, 2), (1, 1), 0),
                                                             ((3, 0), (2, 3), 1)]


@dataclass(frozen=True)
class Liar(fs.Placement):
    """local_shape() promises more than shard() gives."""

    def check(self, shape, world_size): pass
    def bind(self, shape, itemsize, world_size, rank_bytes): return self
    def local_shape(self, shape, rank, world_size): return torch.Size(shape)
    def shard(self, full, rank, world_size): return full.narrow(0, 0, 1)
    def unshard(self, pieces, shape): return pieces[0]
    def rank_major(self, shape): return True


def test_boxes_of_an_inconsistent_placement():
    with pytest.raises(ValueError, match=r"Liar\(\)\.shard\(\) returned a piece of 3 elements .* "
                                         r"local_shape says \(4, 3\)"):
        piece_boxes(Liar(), (4, 3), 0, 2)


# Values that module.state_dict() returns.


def _values(placement_name):
    from torch.distributed.tensor import DTensor

    model, _ = wrapped(placement_name, tied=True)
    sd = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in sd.items():
        local = v.to_local() if isinstance(v, DTensor) else v.local
        kind = "DTensor" if isinstance(v, DTensor) else type(v).__mro__[1].__name__  # LivePieces
        out[k] = (kind, tuple(v.shape), local.data_ptr() == params[k].data_ptr())
    try:
        sd["pos"] + 1
    except NotImplementedError as e:
        out["error"] = str(e)
    out["layer"] = {k: tuple(v.shape) for k, v in model.layers[1].state_dict().items()}
    return out


def test_state_dict_values_carry_the_full_shape():
    reference = make_model(tied=True)
    full = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    layer = {k: tuple(v.shape) for k, v in reference.layers[1].state_dict().items()}
    for vals in run_world(2, _values, "shard0"):
        assert vals.pop("layer") == layer  # a submodule's state dict too
        assert {k: v[1] for k, v in vals.items() if k != "error"} == full
        assert all(t == "DTensor" and same for t, _, same in
                   (vals[k] for k in full)), "Shard(0) pieces are DTensors viewing the params"
    for vals in run_world(2, _values, "uneven"):
        assert vals.pop("layer") == layer
        assert {k: v[1] for k, v in vals.items() if k != "error"} == full
        assert all(t == "ShardedPieces" and same for t, _, same in (vals[k] for k in full))
        assert "head.weight" in vals and "tok.weight" in vals  # tied: both names
        assert "call fs.full_state_dict(model) on every rank" in vals["error"]


def _trainable_keys(placement_name) -> tuple:
    """state_dict(keep_vars=True) with the first block frozen: the keys whose values
    require grad, and under keep_vars=False (detached values) none."""
    model, _ = wrapped(placement_name)
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    return ({k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad},
            {k for k, v in model.state_dict().items() if v.requires_grad})


@pytest.mark.parametrize("placement", ["shard0", "uneven"])
def test_keep_vars_tells_which_params_train(placement):
    """As torch's and FSDP2's state_dict(keep_vars=True) do (it used to say none)."""
    reference = make_model()
    for p in reference.layers[0].parameters():
        p.requires_grad_(False)
    want = {k for k, v in reference.state_dict(keep_vars=True).items() if v.requires_grad}
    assert want and "layers.0.qkv.weight" not in want and "layers.1.qkv.weight" in want
    for kept, detached in run_world(2, _trainable_keys, placement):
        assert kept == want and detached == set()


def _load_full_in_place(placement_name):
    model, _ = wrapped(placement_name, seed=1)
    ptrs = {k: p.data_ptr() for k, p in model.named_parameters()}
    reference = make_model(0).state_dict()
    result = model.load_state_dict(reference)
    assert ptrs == {k: p.data_ptr() for k, p in model.named_parameters()}, "params were rebound"
    mine = fs.full_state_dict(model)
    again = model.load_state_dict(model.state_dict())  # its own sharded values: a no-op copy
    return (str(result), str(again),
            all(torch.equal(mine[k], reference[k]) for k in reference),
            all(torch.equal(v, mine[k]) for k, v in fs.full_state_dict(model).items()))


@pytest.mark.parametrize("placement", ["shard1", "uneven"])
def test_load_state_dict_full_tensors_in_place(placement):
    for result, again, equal, unchanged in run_world(2, _load_full_in_place, placement):
        assert result == again == "<All keys matched successfully>"
        assert equal and unchanged


def _load_bad(case):
    model, _ = wrapped("uneven")
    sd = make_model(0).state_dict()
    if case == "shape":
        sd["layers.1.up.weight"] = sd["layers.1.up.weight"][:, :29]
        model.load_state_dict(sd)
    else:
        model.load_state_dict(sd, assign=True)


def test_load_state_dict_errors():
    expect_all_ranks_raise(2, _load_bad, ValueError,
                           r"'layers\.1\.up\.weight' has shape \(50, 29\) but the parameter is "
                           r"\(50, 30\)", "shape")
    expect_all_ranks_raise(2, _load_bad, NotImplementedError,
                           r"assign=True.* views into their bucket's storage", "assign")


def _state_dict_in_forward():
    model, _ = wrapped("shard0")
    model.layers[0].register_forward_hook(lambda *args: model.state_dict())
    x, _ = torch.zeros(2, 11, dtype=torch.long), None
    model(x)


def test_state_dict_during_forward_is_refused():
    expect_all_ranks_raise(2, _state_dict_in_forward, RuntimeError,
                           r"bucket '.*' is unsharded: state dicts are only available outside "
                           r"forward and backward")


# DCP's get/set_model_state_dict with full tensors.


def _dsd_full(placement_name):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    model, _ = wrapped(placement_name)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    kinds = sorted({"ShardedPieces" if isinstance(v, fs.ShardedPieces) else type(v).__name__
                    for v in full.values()})
    reference = make_model(0).state_dict()
    loaded = []
    for broadcast in (False, True):  # every rank passes the full tensors, or rank 0 only
        fresh, _ = wrapped(placement_name, seed=1)
        given = reference if dist.get_rank() == 0 or not broadcast else {}
        set_model_state_dict(fresh, given, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=broadcast))
        mine = fs.full_state_dict(fresh)
        loaded.append(all(torch.equal(mine[k], reference[k]) for k in reference))
    return (dist.get_rank(), kinds,
            kinds != ["Tensor"] or all(torch.equal(full[k], reference[k]) for k in reference),
            loaded == [True, True])


def test_dsd_full_state_dict():
    for rank, kinds, got_full, loaded in run_world(2, _dsd_full, "shard1"):
        assert kinds == (["Tensor"] if rank == 0 else [])  # cpu_offload: rank 0 only
        assert got_full and loaded
    # Uneven pieces: DSD gathers only DTensors, so it hands back ShardedPieces
    # (use fs.full_state_dict); loading full tensors works for every placement.
    for rank, kinds, _, loaded in run_world(2, _dsd_full, "uneven"):
        assert kinds == (["ShardedPieces"] if rank == 0 else [])
        assert loaded


def _load_other_layout():
    uneven, _ = wrapped("uneven")
    model, _ = wrapped("shard0")
    model.load_state_dict(uneven.state_dict())


def test_load_sharded_values_of_another_layout():
    expect_all_ranks_raise(2, _load_other_layout, ValueError,
                           r"'pos' holds the pieces of another layout; load a sharded checkpoint "
                           r"with torch\.distributed\.checkpoint\.load")


def test_load_a_non_tensor_value():
    model = fs.flex_shard(make_model())  # no process group: world size 1
    sd = model.state_dict()
    sd["pos"] = 3
    with pytest.raises(TypeError, match=r"load_state_dict: 'pos' is a int, expected a tensor of "
                                        r"shape \(11, 30\)"):
        model.load_state_dict(sd)
