"""The bad-input matrix: misuse of flex_shard, BucketSpec, placements and
MixedPrecisionPolicy raises ValueError/TypeError (NotImplementedError for the
valid but unsupported) before any collective, on every rank, with a message
that names the parameter, bucket or field and says how to fix it."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import TinyGPT
from training_helpers import NoCollectives

ROOT = ["tok.*", "pos", "norm.*", "head.*"]


def _model():
    torch.manual_seed(0)
    return TinyGPT()


def _wrap(**kwargs):
    return lambda comm: fs.flex_shard(_model(), comm=comm, **kwargs)


def _tied_head_alone(comm):
    torch.manual_seed(0)
    fs.flex_shard(TinyGPT(tied=True), comm=comm,
                  buckets=[fs.BucketSpec(["layers.*", *ROOT]), fs.BucketSpec("head.*")])


def _twice(comm):
    model = fs.flex_shard(_model())  # a valid first wrap, with its collectives
    fs.flex_shard(model, comm=comm)


def _submodule_first(comm):
    model = _model()
    fs.flex_shard(model.layers[0])  # a valid first wrap, with its collectives
    fs.flex_shard(model, comm=comm)


def _child_of_a_wrapped_model(comm):
    model = fs.flex_shard(_model())  # a valid first wrap, with its collectives
    fs.flex_shard(model.layers[0], comm=comm)


class _JunkFormat(fs.WirePolicy):
    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return "int8"


class _BlocksOf(fs.WirePolicy):
    """BlockQuantized for the head, whatever its placement cuts."""

    def __init__(self, block_rows: int = 1, out_dtype=torch.float32) -> None:
        self.block_rows, self.out_dtype = block_rows, out_dtype

    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        if fqn == "head.weight":
            return fs.BlockQuantized(torch.int8, self.out_dtype, self.block_rows)
        return None


def _blocks(policy, **kwargs):
    return _wrap(mp_policy=fs.MixedPrecisionPolicy(gather_format=policy), **kwargs)


def _two_devices(comm):
    model = _model()
    model.head.to("meta")
    fs.flex_shard(model, comm=comm)


def _zero_dim(comm):
    """A callable's own Shard for a 0-dim param (a bucket-wide one makes it Owned)."""
    fs.flex_shard(nn.ParameterDict({"scale": nn.Parameter(torch.tensor(1.0))}),
                  placement=lambda fqn, p: fs.Shard(0), comm=comm)


def _grad_sync_flag(comm):
    fs.flex_shard(_model(), comm=comm).set_requires_gradient_sync(1)


# name -> (misuse taking a Comm, exception, message regex). Each runs single-process
# and, where it involves flex_shard, on both ranks of a 2-rank world.
WRAP_CASES = {
    "param in no bucket": (_wrap(buckets=[fs.BucketSpec("layers.*"), fs.BucketSpec(ROOT[1:])]),
                           ValueError, r"parameter 'tok\.weight' matches no BucketSpec; add a pattern"),
    "param in two buckets": (_wrap(buckets=[fs.BucketSpec("*", name="all"), fs.BucketSpec("layers.0.*")]),
                             ValueError, r"parameter 'layers\.0\.norm1\.weight' matches several "
                                         r"buckets \('all', 'layers\.0\.\*'\); make the patterns disjoint"),
    "bucket matching nothing": (_wrap(buckets=[fs.BucketSpec("*"), fs.BucketSpec("blocks.*", name="b")]),
                                ValueError, r"pattern 'blocks\.\*' of bucket 'b' matches no parameter"),
    # issue 45: the typo is named, not the parameter it leaves out (nor a catch-all)
    "pattern typo": (_wrap(buckets=[fs.BucketSpec("layer.0.*"), fs.BucketSpec(["layers.1.*", *ROOT])]),
                     ValueError, r"^pattern 'layer\.0\.\*' of bucket 'layer\.0\.\*' matches no "
                                 r"parameter \(nearest: 'layers\.0\.\*', .*\); fix the pattern or drop it"),
    "one pattern of several matching nothing": (
        _wrap(buckets=[fs.BucketSpec(["layers.*", "layers.0.norm1.weigth"], name="blocks"),
                       fs.BucketSpec(ROOT)]),
        ValueError, r"^pattern 'layers\.0\.norm1\.weigth' of bucket 'blocks' matches no parameter "
                    r"\(nearest: 'layers\.0\.norm1\.weight'"),
    "pattern matching only a tied name": (
        _tied_head_alone, ValueError, r"^pattern 'head\.\*' of bucket 'head\.\*' matches no parameter "
                                      r"but 'head\.weight', the second name of a parameter"),
    "duplicate bucket names": (_wrap(buckets=[fs.BucketSpec("layers.*", name="x"), fs.BucketSpec(ROOT, name="x")]),
                               ValueError, r"two buckets are named 'x'; give each BucketSpec a unique name"),
    "buckets is a string": (_wrap(buckets="layers.*"), TypeError,
                            r"buckets must be a list of fs\.BucketSpec, got 'layers\.\*'"),
    "buckets is empty": (_wrap(buckets=[]), ValueError, r"buckets is empty; pass buckets=None"),
    "bucket not a BucketSpec": (_wrap(buckets=[fs.BucketSpec(ROOT), "layers.*"]), TypeError,
                                r"buckets\[1\] is str, not a fs\.BucketSpec"),
    "Shard dim out of range": (_wrap(placement=fs.Shard(2)), ValueError,
                               r"parameter 'layers\.0\.norm1\.weight' in bucket 'layers\.0': Shard\(dim=2\) "
                               r"is out of range for shape \(30,\); use a dim in \[-1, 0\]"),
    "Shard of a 0-dim param": (_zero_dim, ValueError, r"parameter 'scale' in bucket 'root': .*a 0-dim "
                                                     r"tensor cannot be sharded"),
    "placement not a Placement": (_wrap(placement="shard"), TypeError,
                                  r"placement 'shard' is not a Placement or a callable"),
    "placement callable returns other": (_wrap(placement=lambda fqn, p: 0), TypeError,
                                         r"the placement callable of bucket 'layers\.0' returned 0 for "
                                         r"parameter 'layers\.0\.norm1\.weight'; it must return a Placement"),
    "mp_policy not a policy": (_wrap(mp_policy={"param_dtype": torch.bfloat16}), TypeError,
                               r"mp_policy must be a fs\.MixedPrecisionPolicy"),
    "reshard_after_forward not bool": (_wrap(reshard_after_forward="yes"), TypeError,
                                       r"reshard_after_forward must be a bool or an int, got 'yes'"),
    "mesh not a DeviceMesh": (_wrap(mesh="cpu"), TypeError, r"mesh must be a DeviceMesh or None, got str"),
    "flex_shard twice": (_twice, ValueError, r"FlexShardTinyGPT is already wrapped by flex_shard; call "
                                             r"flex_shard once"),
    "submodule wrapped first": (_submodule_first, ValueError,
                                r"submodule 'layers\.0' is already wrapped by flex_shard"),
    "child of a wrapped model": (_child_of_a_wrapped_model, ValueError,
                                 r"Block is module 'layers\.0' of a model already wrapped by "
                                 r"flex_shard \(its params are shards\); call flex_shard once"),
    "gather_format returns no WireFormat": (
        _wrap(mp_policy=fs.MixedPrecisionPolicy(gather_format=_JunkFormat())), TypeError,
        r"the gather_format .*_JunkFormat.* returned 'int8' for parameter '[\w.]+'; its format\(\) "
        r"must return a fs\.WireFormat"),
    # head.weight is (37, 30): 37 rows do not fall in blocks of 2, columns are not rows
    "BlockQuantized rows not in blocks": (
        _blocks(_BlocksOf(block_rows=2)), ValueError,
        r"parameter 'head\.weight': BlockQuantized\(.*block_rows=2\) scales blocks of 2 whole "
        r"row\(s\), but Shard\(dim=0\) over \d rank\(s\) does not cut the \(37, 30\) tensor"),
    "BlockQuantized on columns": (
        _blocks(_BlocksOf(), placement=lambda fqn, p: fs.Shard(1) if fqn == "head.weight"
                else fs.Shard(0)), ValueError,
        r"parameter 'head\.weight': .* but Shard\(dim=1\) over \d rank\(s\) does not cut"),
    "BlockQuantized decoding to another dtype": (
        _blocks(_BlocksOf(out_dtype=torch.bfloat16)), ValueError,
        r"returned BlockQuantized\(.*\) for parameter 'head\.weight', whose gathers decode to "
        r"torch\.float32: give it out_dtype=torch\.float32"),
    "not a Module": (lambda comm: fs.flex_shard(lambda x: x, comm=comm), TypeError,
                     r"flex_shard expects an nn\.Module, got function"),
    "no parameters": (lambda comm: fs.flex_shard(nn.ReLU(), comm=comm), ValueError,
                      r"the module has no parameters to shard"),
    "params on two devices": (_two_devices, ValueError, r"parameters live on several devices .*'head\.weight'"),
    # its forward renormalises rows of the weight in place: lost on a gathered copy
    "embedding max_norm": (
        lambda comm: fs.flex_shard(nn.Sequential(nn.Embedding(11, 6, max_norm=1.0),
                                                 nn.Linear(6, 3)), comm=comm), ValueError,
        r"module '0' \(Embedding\) has max_norm=1\.0: .* Build it with max_norm=None"),
    "sparse embedding": (
        lambda comm: fs.flex_shard(nn.Sequential(nn.Linear(3, 5), nn.EmbeddingBag(11, 6, sparse=True)),
                                   comm=comm), ValueError,
        r"module '1' \(EmbeddingBag\) has sparse=True: .* build it with sparse=False"),
}

CONFIG_CASES = {
    "empty patterns": (lambda: fs.BucketSpec([]), ValueError,
                       r"BucketSpec \[\]: patterns is empty; give at least one fnmatch pattern"),
    "pattern not a string": (lambda: fs.BucketSpec(["layers.*", 3]), TypeError,
                             r"pattern 3 is not a non-empty string"),
    "BucketSpec placement": (lambda: fs.BucketSpec("layers.*", placement=3), TypeError,
                             r"BucketSpec 'layers\.\*': placement 3 is not a Placement"),
    "BucketSpec mp_policy": (lambda: fs.BucketSpec("layers.*", mp_policy=torch.bfloat16), TypeError,
                             r"BucketSpec 'layers\.\*': mp_policy must be a fs\.MixedPrecisionPolicy"),
    "BucketSpec reshard": (lambda: fs.BucketSpec("layers.*", reshard_after_forward=1.5), TypeError,
                           r"BucketSpec 'layers\.\*': reshard_after_forward must be a bool, an int "
                           r"or None \(inherit\), got 1\.5"),
    "BucketSpec reshard 0": (lambda: fs.BucketSpec("layers.*", reshard_after_forward=0), ValueError,
                             r"BucketSpec 'layers\.\*': reshard_after_forward=0: an int is the "
                             r"number of ranks to reshard to after forward and must be >= 1"),
    "BucketSpec name": (lambda: fs.BucketSpec("layers.*", name=3), TypeError,
                        r"BucketSpec 'layers\.\*': name 3 is not a non-empty string"),
    "non-floating MP dtype": (lambda: fs.MixedPrecisionPolicy(param_dtype=torch.int32), ValueError,
                              r"MixedPrecisionPolicy\.param_dtype=torch\.int32 is not a floating-point dtype"),
    "MP dtype not a dtype": (lambda: fs.MixedPrecisionPolicy(reduce_dtype="bf16"), TypeError,
                             r"MixedPrecisionPolicy\.reduce_dtype must be a torch\.dtype or None, got 'bf16'"),
    "MP cast flag not bool": (lambda: fs.MixedPrecisionPolicy(cast_forward_inputs="yes"), TypeError,
                              r"MixedPrecisionPolicy\.cast_forward_inputs must be a bool"),
    "Shard dim not an int": (lambda: fs.Shard("0"), TypeError, r"Shard\(dim='0'\): dim must be an int"),
    "incomplete Placement": (lambda: type("Half", (fs.Placement,), {"check": lambda *a: None})(), TypeError,
                             r"Can't instantiate abstract class Half"),
    "gradient sync flag": (lambda: _grad_sync_flag(None), TypeError,
                           r"set_requires_gradient_sync expects a bool, got 1"),
}


@pytest.mark.parametrize("name", sorted(WRAP_CASES))
def test_wrap_misuse_raises(name):
    misuse, exc, match = WRAP_CASES[name]
    with pytest.raises(exc, match=match):
        misuse(NoCollectives())


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_config_misuse_raises(name):
    misuse, exc, match = CONFIG_CASES[name]
    with pytest.raises(exc, match=match):
        misuse()


# ---- on every rank of a world, before any collective


def _every_wrap_case():
    """Run each misuse on this rank; returns {name: (type name, message)}."""
    caught = {}
    for name, (misuse, exc, _) in WRAP_CASES.items():
        try:
            misuse(NoCollectives())
        except Exception as e:  # noqa: BLE001 - reported to the test
            caught[name] = (type(e).__name__, str(e))
        else:
            caught[name] = ("nothing", "")
    return caught


@pytest.mark.world
def test_wrap_misuse_raises_on_every_rank_before_any_collective():
    for caught in run_world(2, _every_wrap_case):
        for name, (misuse, exc, match) in WRAP_CASES.items():
            got, message = caught[name]
            assert got == exc.__name__ and re.search(match, message), (name, got, message)


def _three_dim_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1, 1), mesh_dim_names=("a", "b", "c"))
    fs.flex_shard(_model(), mesh, comm=NoCollectives())


def _dtensor_param():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.detach(), mesh, [Shard(0)]))
    fs.flex_shard(model, mesh, comm=NoCollectives())


@pytest.mark.world
def _mesh_without_this_rank():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0])  # every rank builds it; rank 1 is outside it
    try:
        fs.flex_shard(_model(), mesh=mesh)
    except ValueError as e:
        return str(e)
    return None


def test_a_mesh_without_this_rank_is_refused_there():
    """The ranks inside the mesh cannot know; the one outside says so, not IndexError."""
    inside, outside = run_world(2, _mesh_without_this_rank)
    assert inside is None
    assert re.search(r"this rank \(1\) is not in flex_shard's mesh of ranks \[0\]: build the "
                     r"mesh from every rank", outside), outside


def test_mesh_neither_one_nor_two_dimensional():
    expect_all_ranks_raise(2, _three_dim_mesh, ValueError,
                           r"mesh must be 1-D \(shard\) or 2-D \(HSDP: replicate, shard\), got a "
                           r"3-D mesh of shape \(2, 1, 1\); pass a slice such as mesh\['dp'\]")


@pytest.mark.world
def test_dtensor_parameters():
    expect_all_ranks_raise(2, _dtensor_param, ValueError,
                           r"flex_shard's mesh \(2,\) \(\) includes mesh dim 0, on which DTensor "
                           r"parameter 'head\.weight' is already sharded \(Shard\(dim=0\)\)")
