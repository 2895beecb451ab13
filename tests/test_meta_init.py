"""Meta-device init: flex_shard on meta, to_empty, init_parameters, train."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import TinyGPT
from training_helpers import LR, check_against_reference, train

STEPS = 3
SEED = 7


def init_weights(module: nn.Module) -> None:
    """The model's init, one module at a time (random for Linear/Embedding/pos)."""
    if isinstance(module, TinyGPT):
        nn.init.normal_(module.pos, std=0.02)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def meta_model(**kw) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(**kw)


def reference_init(**kw) -> TinyGPT:
    """The unsharded model initialised by the same calls, in nn.Module.apply's order
    (children first)."""
    model = meta_model(**kw).to_empty(device="cpu")
    if kw.get("tied"):  # nn.Module.to_empty unties meta params; flex_shard's storage does not
        model.head.weight = model.tok.weight
    torch.manual_seed(SEED)
    model.apply(init_weights)
    return model


def sharded_meta_init(model_kw: dict) -> tuple:
    """Rank body: meta -> flex_shard -> to_empty -> init_parameters. Returns the
    full params, the bytes this rank allocated for storage, and the most param
    bytes the model registered at any point of the init."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(meta_model(**model_kw))
    on_meta = all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    storage = sum(b.storage.buffer.numel() for b in get_state(model).buckets)
    peak = []

    def init(module):
        # what the modules register (an ancestor's init sees its descendants' params as
        # full-shape stand-ins on the meta device, not Parameters: no memory)
        peak.append(sum(p.numel() * p.element_size() for p in model.parameters()
                        if isinstance(p, nn.Parameter)))
        init_weights(module)

    torch.manual_seed(SEED)
    model.init_parameters(init)
    devices = {p.device.type for p in model.parameters()}
    return fs.full_state_dict(model), storage, max(peak), on_meta, devices


@pytest.mark.parametrize("world,model_kw", [(2, {}), (3, {"tied": True})])
def test_meta_init_matches_unsharded_init(world, model_kw):
    reference = dict(reference_init(**model_kw).named_parameters(remove_duplicate=False))
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in reference.values()}.values())
    own = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
              for m in reference_init(**model_kw).modules())
    for full, storage, peak, on_meta, devices in run_world(world, sharded_meta_init, model_kw):
        assert full.keys() == reference.keys()
        for k, v in reference.items():
            assert torch.equal(full[k], v), k  # random inits included: same seed, same calls
        assert on_meta and devices == {"cpu"}
        # Only this rank's storage is allocated (about 1/world of the model, plus
        # padding), and at most one module's own params are ever full.
        assert storage < total * 0.5 + 4096
        assert peak <= storage + own


def train_after_meta_init() -> tuple:
    """Rank body: train after meta init; state dicts round-trip midway (the params
    are new objects after to_empty: the state-dict hooks must still know them)."""
    model = fs.flex_shard(meta_model())
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_parameters(init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = train(model, 1, opt=opt)
    model.load_state_dict(model.state_dict())
    opt.load_state_dict(opt.state_dict())
    losses += train(model, STEPS - 1, opt=opt, first_step=1)
    return losses, fs.full_state_dict(model)


def test_training_after_meta_init_parity():
    losses, full = run_world(2, train_after_meta_init)[0]
    check_against_reference(losses, full, 2, STEPS, model=reference_init())


def default_init_body() -> dict:
    """Rank body: modules that all have reset_parameters need no init_fn."""
    torch.manual_seed(SEED)
    expected = {k: v.clone() for k, v in nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7),
                                                       nn.Linear(7, 3)).state_dict().items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    fs.flex_shard(model).to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_parameters()
    full = fs.full_state_dict(model)
    return {k: torch.equal(full[k], v) for k, v in expected.items()}


def test_default_init_is_reset_parameters():
    for same in run_world(2, default_init_body):
        assert all(same.values()), same


def no_reset_parameters():
    fs.flex_shard(meta_model()).to_empty(device="cpu").init_parameters()


def init_on_meta():
    fs.flex_shard(meta_model()).init_parameters(init_weights)


def convert_dtype():
    fs.flex_shard(meta_model()).to_empty(device="cpu").half()


def test_meta_init_errors():
    expect_all_ranks_raise(2, no_reset_parameters, ValueError,
                           r"'pos' is registered on FlexShardTinyGPT '<root>', which has no "
                           r"reset_parameters\(\); pass init_parameters\(init_fn\)")
    expect_all_ranks_raise(2, init_on_meta, ValueError,
                           r"still on the meta device; call module.to_empty\(device=...\)")
    expect_all_ranks_raise(2, convert_dtype, NotImplementedError,
                           r"would change dtype from torch.float32 to torch.float16; .* "
                           r"convert the module before flex_shard")


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(9, 13), nn.Linear(13, 9)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _reaching_init(module: nn.Module) -> None:
    """A pair's init reaches into its children after their own ran: scales one
    (reading its values), zeroes a row of another, assigns a third anew."""
    if isinstance(module, nn.Linear):
        module.reset_parameters()
    elif isinstance(module, _Pair):
        module.fc2.weight.data.mul_(0.5)
        nn.init.zeros_(module.fc1.weight[0])
        module.fc2.bias = nn.Parameter(torch.randn(9))


def _pairs() -> nn.Module:
    return nn.Sequential(_Pair(), _Pair())


def reaching_init_on_meta() -> dict:
    with torch.device("meta"):
        model = fs.flex_shard(_pairs())
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_parameters(_reaching_init)
    return fs.full_state_dict(model)


@pytest.mark.parametrize("world", [2, 3])
def test_an_init_reaching_into_children_sees_and_keeps_their_full_values(world):
    """As model.apply(init_fn): children first, and a parent's init acts on its
    children's full params (their values so far), kept."""
    with torch.device("meta"):
        ref = _pairs()
    ref.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        ref.apply(_reaching_init)
    want = ref.state_dict()
    assert not want["0.fc1.weight"][0].any() and want["1.fc2.bias"].abs().sum() > 0
    for got in run_world(world, reaching_init_on_meta):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
