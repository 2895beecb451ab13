"""fs.load_checkpoint of a checkpoint that does not match the model (keys
missing or unexpected, shapes, dtypes) raises on every rank before anything
is loaded, naming the keys; strict=False loads the keys both hold."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from ckpt_util import train, wrapped
from harness import expect_all_ranks_raise, run_world

BLOCK = ["norm1.weight", "norm1.bias", "qkv.weight", "proj.weight", "proj.bias", "norm2.weight",
         "norm2.bias", "up.weight", "up.bias", "down.weight", "down.bias"]
FIX = (r"\. Nothing was loaded\. Load the checkpoint of this model, or pass strict=False to "
       r"load only the keys both hold \(as load_state_dict\(strict=False\)\)")


def _save_three_blocks(root: str, with_optimizer: bool = True) -> dict:
    """A trained 3-block TinyGPT saved at step 4; its full params and this rank's
    AdamW state by FQN."""
    model, opt = wrapped("shard0", layers=3)
    train(model, opt, [0], dist.get_rank())
    fs.save_checkpoint(root, model, opt if with_optimizer else None, step=4)
    names = {id(p): k for k, p in model.named_parameters()}
    return fs.full_state_dict(model), {names[id(p)]: {k: v.clone() for k, v in s.items()}
                                       for p, s in opt.state.items()}


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory):
    root = tmp_path_factory.mktemp("three_blocks")
    saved = run_world(2, _save_three_blocks, str(root))
    return str(root), saved[0][0], [s[1] for s in saved]


def _load(root: str, strict: bool = True, with_optimizer: bool = False, **kw):
    """Load into TinyGPT(seed 1, **kw); (step, full params before, after, this rank's
    AdamW state by FQN, the warnings raised)."""
    model, opt = wrapped("shard0", seed=1, **kw)
    before = fs.full_state_dict(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = fs.load_checkpoint(root, model, opt if with_optimizer else None, strict=strict)
    names = {id(p): k for k, p in model.named_parameters()}
    state = {names[id(p)]: s for p, s in opt.state.items()}
    return step, before, fs.full_state_dict(model), state, [str(w.message) for w in caught]


def _fewer(n: int) -> str:
    return (f"\\[{', '.join(repr(f'layers.{n}.{k}') for k in BLOCK[:5])}\\] "
            .replace(".", "\\.") + "and 6 more")


def test_a_model_with_fewer_blocks_is_refused(three_blocks):
    root, _, _ = three_blocks
    expect_all_ranks_raise(2, _load, ValueError,
                           r"checkpoint '.*step_00000004' does not match the model \(its keys "
                           r"under 'model\.'\): it holds 11 keys the model does not have: "
                           + _fewer(2) + FIX, root, layers=2)


def test_a_model_with_more_blocks_is_refused_naming_the_missing_keys(three_blocks):
    root, _, _ = three_blocks
    expect_all_ranks_raise(2, _load, ValueError,
                           r"does not match the model \(its keys under 'model\.'\): 11 of the "
                           r"model's keys are not in it: " + _fewer(3) + FIX, root, layers=4)


def test_shapes_are_refused(three_blocks):
    root, _, _ = three_blocks
    for strict in (True, False):  # strict=False loads the keys both hold; their shapes must match
        expect_all_ranks_raise(
            2, _load, ValueError,
            r"checkpoint '.*step_00000004': 'model\.layers\.0\.up\.weight' has shape \(50, 30\) "
            r"but the model's is \(52, 30\); load it into the same model \(9 keys differ: "
            r"\[\"'model\.layers\.0\.up\.weight' has shape .* and 6 more\)\. Nothing was loaded$",
            root, strict, layers=3, hidden=52)


def test_dtypes_are_refused(three_blocks):
    root, _, _ = three_blocks
    expect_all_ranks_raise(
        2, _load, ValueError,
        r"checkpoint '.*step_00000004': 'model\.pos' has dtype torch\.float32 but the model's is "
        r"torch\.bfloat16; load it into the same model, or pass strict=False to load it cast to "
        r"the model's dtypes \(38 keys differ: .* and 35 more\)\. Nothing was loaded$",
        root, layers=3, dtype=torch.bfloat16)


def test_an_optimizer_without_state_for_missing_keys_is_refused(three_blocks):
    root, _, _ = three_blocks
    expect_all_ranks_raise(2, _load, ValueError,
                           r"load_checkpoint\(strict=False\): checkpoint '.*' lacks "
                           + _fewer(3) + r" of the model, so it holds no optimizer state for "
                           r"them; load the model alone \(load_checkpoint\(path, model, "
                           r"strict=False\)\) and start a new optimizer",
                           root, False, True, layers=4)


def test_the_model_is_untouched_after_a_refusal(three_blocks):
    root, _, _ = three_blocks
    out = run_world(2, _load_catching, root)
    assert out == [True, True]


def _load_catching(root: str) -> bool:
    model, _ = wrapped("shard0", seed=1, layers=4)
    before = fs.full_state_dict(model)
    try:
        fs.load_checkpoint(root, model)
    except ValueError:
        after = fs.full_state_dict(model)
        return all(torch.equal(after[k], v) for k, v in before.items())
    return False


# strict=False: the intersection, with parity to the saved model.


def test_strict_false_loads_the_blocks_both_hold_with_the_optimizer(three_blocks):
    root, saved, saved_optim = three_blocks
    for rank, (step, before, after, optim, caught) in enumerate(
            run_world(2, _load, root, False, True, layers=2)):
        assert step == 4
        assert set(after) == {k for k in saved if not k.startswith("layers.2.")}
        for k, v in after.items():
            assert torch.equal(v, saved[k]), k
        for fqn, state in optim.items():  # the same Shard(0) pieces: this rank's AdamW state
            for name, value in state.items():
                assert torch.equal(value, saved_optim[rank][fqn][name]), (fqn, name)
        assert caught == [
            f"load_checkpoint(strict=False) loaded 27 of the model's 27 keys from "
            f"'{root}/step_00000004'; not in the checkpoint (left as they were): []; in the "
            f"checkpoint but not the model (not loaded): "
            f"{['layers.2.' + k for k in BLOCK[:5]]} and 6 more; cast to the model's dtype: []"]


def test_strict_false_leaves_the_keys_the_checkpoint_lacks(three_blocks):
    root, saved, _ = three_blocks
    for step, before, after, _, caught in run_world(2, _load, root, False, layers=4):
        assert step == 4
        for k, v in after.items():
            assert torch.equal(v, before[k] if k.startswith("layers.3.") else saved[k]), k
        assert caught[0].startswith("load_checkpoint(strict=False) loaded 38 of the model's 49 "
                                    f"keys from '{root}/step_00000004'; not in the checkpoint "
                                    f"(left as they were): {['layers.3.' + k for k in BLOCK[:5]]}"
                                    " and 6 more; in the checkpoint but not the model (not "
                                    "loaded): []")


def test_strict_false_casts_to_the_models_dtypes(three_blocks):
    root, saved, _ = three_blocks
    for _, _, after, _, caught in run_world(2, _load, root, False, layers=3,
                                            dtype=torch.bfloat16):
        for k, v in after.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, saved[k].bfloat16()), k
        assert "cast to the model's dtype: ['pos', 'tok.weight', " in caught[0]


def test_strict_must_be_a_bool(tmp_path):
    model, _ = wrapped("shard0")
    with pytest.raises(TypeError, match=r"load_checkpoint: strict must be True or False, got 0"):
        fs.load_checkpoint(str(tmp_path), model, strict=0)


# The frozen set changed since the save: params frozen then have no optimizer state.


def _two_linears():
    torch.manual_seed(0)
    model = fs.flex_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # state: momentum


def _save_frozen_then_load(root: str, freeze_at_load: bool) -> int:
    model, opt = _two_linears()
    model[0].requires_grad_(False)  # layer 0 frozen: SGD makes no momentum for it
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    fs.save_checkpoint(root, model, opt, step=1)
    model, opt = _two_linears()
    model[0].requires_grad_(not freeze_at_load)
    return fs.load_checkpoint(root, model, opt)


def test_optimizer_state_of_params_frozen_at_save_is_named(tmp_path):
    expect_all_ranks_raise(
        2, _save_frozen_then_load, ValueError,
        r"checkpoint '.*step_00000001' holds this optimizer's state under 'optim\.' for some "
        r"params but not for others: it lacks 2 keys, \['optim\.state\.0\.weight\."
        r"momentum_buffer', 'optim\.state\.0\.bias\.momentum_buffer'\]\. An optimizer has no "
        r"state for a param until the param's first step, so params frozen "
        r"\(requires_grad=False\) when it was saved have none\. Freeze the same params before "
        r"loading \(and unfreeze them after\), or load the model alone "
        r"\(load_checkpoint\(path, model\)\) and start the optimizer afresh$",
        str(tmp_path), False)
    assert run_world(2, _save_frozen_then_load, str(tmp_path / "fix"), True) == [1, 1]
