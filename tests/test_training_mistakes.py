"""The training-loop mistakes FSDP2 users make (issue 35): each one either trains
as the user meant, checked at 2 ranks against the one-process run with SGD (a
wrong gradient scale shows, where Adam would hide it), or raises on every rank,
naming the parameter and the fix, before the step it would corrupt.
docs/troubleshooting.md lists them."""

from __future__ import annotations

import copy
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import TinyGPT, batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, check_against_reference

STEPS = 3
LR = 0.05
WORLD = 2


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def sgd_train(model, opt, steps: int = STEPS, step_fn=None, logits=None) -> list:
    """SGD steps on this rank's batches; the per-step losses averaged over ranks.
    `logits(model, x)`: how the loss gets logits (default: model(x))."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = loss_fn(model(x) if logits is None else logits(model, x), y)
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def reference(step_fn=None, model=None, steps: int = STEPS, logits=None,
              params_of=None) -> tuple:
    """The one-process SGD run on every rank's batch: (losses, params).
    `params_of(model)`: what SGD steps (default: model.parameters())."""
    model = model if model is not None else make_model()
    opt = sgd(model.parameters() if params_of is None else params_of(model))
    losses = []
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        x = torch.cat(xs)
        loss = loss_fn(model(x) if logits is None else logits(model, x), torch.cat(ys))
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_matches_reference(result, step_fn=None, model=None, logits=None) -> None:
    losses, full = result
    ref_losses, ref_params = reference(step_fn, model, logits=logits)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert full.keys() == ref_params.keys()
    for k, v in ref_params.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


# An optimizer built before flex_shard keeps working: the Parameter objects stay.


def optimizer_before_wrap():
    model = make_model()
    before = dict(model.named_parameters())
    opt = sgd(model.parameters())
    fs.flex_shard(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), "the Parameter objects changed"
    assert [p.shape for p in opt.param_groups[0]["params"]] == [p.shape for p in after.values()]
    return sgd_train(model, opt), fs.full_state_dict(model)


def test_optimizer_built_before_wrapping_trains():
    results = run_world(WORLD, optimizer_before_wrap)
    assert_matches_reference(results[0])
    assert results[1][1].keys() == results[0][1].keys()


# Under torchrun with no process group: flex_shard initialises the default one.


def torchrun(script: str, *args: str):
    """`script` (in tests/) under torchrun at WORLD ranks: the finished process."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", str(tests / script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_without_init_process_group(tmp_path):
    out = tmp_path / "rank0.pt"
    proc = torchrun("torchrun_no_init.py", str(out), str(LR), str(STEPS))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = torch.load(out)
    assert (seen["world"], seen["backend"]) == (2, "gloo")
    full_rows = seen["rows"][1]
    assert seen["rows"][0] == -(-full_rows // 2), seen["rows"]  # rank 0 holds its half
    assert_matches_reference((seen["losses"], seen["full"]))


# A parameter replaced, tied or added after wrapping raises at the assignment.


def replace_param():
    model = fs.flex_shard(make_model())
    model.layers[0].up.weight = nn.Parameter(torch.zeros(50, 30))


def tie_after_wrap():
    model = fs.flex_shard(make_model())
    model.head.weight = model.tok.weight


def add_adapter():
    model = fs.flex_shard(make_model())
    model.layers[1].lora = nn.Linear(30, 4, bias=False)


def test_param_replaced_or_added_after_wrapping_raises():
    expect_all_ranks_raise(WORLD, replace_param, ValueError,
                           r"parameter 'layers.0.up.weight' was replaced by another nn.Parameter "
                           r"after flex_shard.*model.load_state_dict\(\{'layers.0.up.weight'")
    expect_all_ranks_raise(WORLD, tie_after_wrap, ValueError,
                           r"parameter 'head.weight' was replaced .* tie parameters before")
    expect_all_ranks_raise(WORLD, add_adapter, ValueError,
                           r"module 'layers.1.lora' was registered after flex_shard with "
                           r"parameter\(s\) \['layers.1.lora.weight'\]")


def new_values_the_documented_way():
    """The fix the error names: load the new value; re-assigning the same sharded
    param and wrapping a block in a module that adds no params are allowed."""
    model = fs.flex_shard(make_model())
    missing, unexpected = model.load_state_dict({"layers.0.up.weight": replaced_up()},
                                                strict=False)
    assert not unexpected and "layers.0.up.weight" not in missing
    model.head.weight = model.head.weight
    model.layers[0] = nn.Sequential(model.layers[0])
    losses = sgd_train(model, sgd(model.parameters()))
    full = {k.replace("layers.0.0.", "layers.0."): v for k, v in fs.full_state_dict(model).items()}
    return losses, full


def replaced_up() -> torch.Tensor:
    return torch.linspace(-0.1, 0.1, 50 * 30).reshape(50, 30)


def reference_with_new_values() -> nn.Module:
    model = make_model()
    with torch.no_grad():
        model.layers[0].up.weight.copy_(replaced_up())
    return model


def test_new_values_loaded_after_wrapping_train():
    result = run_world(WORLD, new_values_the_documented_way)[0]
    assert_matches_reference(result, model=reference_with_new_values())


# requires_grad_(False) after wrapping: the param is frozen, the others train.


def freeze_after_wrap():
    model = fs.flex_shard(make_model())
    model.layers[0].up.weight.requires_grad_(False)
    model.pos.requires_grad_(False)
    result = sgd_train(model, sgd(model.parameters())), fs.full_state_dict(model)
    assert model.layers[0].up.weight.grad is None and model.pos.grad is None
    return result


def frozen_reference() -> nn.Module:
    model = make_model()
    model.layers[0].up.weight.requires_grad_(False)
    model.pos.requires_grad_(False)
    return model


def test_freezing_after_wrapping_trains():
    assert_matches_reference(run_world(WORLD, freeze_after_wrap)[0], model=frozen_reference())


def freeze_on_some_ranks(which: str):
    """After a step, rank 1 alone freezes a param ("param"), or rank 0 alone every param
    of a bucket ("bucket": it would skip the reduce-scatter the other waits in); then a
    rank-dependent rule on p.numel() ("numel": Owned, rank 1's pieces are empty); rank 1
    freezes a param of a model compiled whole ("compiled")."""
    placement = fs.Owned() if which == "numel" else fs.Shard(0)
    model = fs.flex_shard(make_model(), placement=placement)  # a bucket per block
    if which == "compiled":  # the whole step in one graph: the check runs before it
        fs.compile(model, backend="aot_eager")
    sgd_train(model, sgd(model.parameters()), steps=1)
    rank = dist.get_rank()
    with torch.no_grad():
        if which in ("param", "compiled") and rank == 1:
            model.layers[0].up.weight.requires_grad_(False)
        elif which == "bucket" and rank == 0:
            for p in model.layers[1].parameters():
                p.requires_grad_(False)
        elif which == "numel":
            for p in model.parameters():
                p.requires_grad_(p.numel() > 100)
    sgd_train(model, sgd(model.parameters()), steps=1)


@pytest.mark.parametrize("which", ["param", "bucket", "numel", "compiled"])
def test_ranks_freezing_different_params_raise(which):
    """Silently wrong before (the freezing rank added zeros to the averaged gradient),
    or hung (a bucket's reduce-scatter skipped by one rank): now every rank raises at
    the next forward, before any gather."""
    expect_all_ranks_raise(WORLD, freeze_on_some_ranks, ValueError,
                           r"the ranks disagree on which parameters train: rank \d freezes",
                           which, timeout=60)


def export_on_rank_0_alone(call: str, directory: str = ""):
    """A step, then `if rank == 0:` a call that gathers the model, while rank 1 trains on."""
    model = fs.flex_shard(make_model())
    opt = sgd(model.parameters())
    sgd_train(model, opt, steps=1)
    if dist.get_rank() == 0:
        {"full_state_dict": lambda: fs.full_state_dict(model),
         "full_grads": lambda: fs.full_grads(model),
         "save_checkpoint": lambda: fs.save_checkpoint(directory, model, opt, step=1),
         "full_optimizer_state_dict": lambda: fs.full_optimizer_state_dict(model, opt)}[call]()
    sgd_train(model, opt, steps=1)


@pytest.mark.parametrize("call", ["full_state_dict", "full_grads", "save_checkpoint",
                                  "full_optimizer_state_dict"])
def test_a_gathering_call_on_one_rank_alone_raises_on_every_rank(call, tmp_path):
    """It hung until the process group's timeout (rank 0's gathers paired with rank 1's
    forward and backward collectives): now rank 0's call meets rank 1's next forward at
    their one small agreement all-reduce, and both raise naming the two places."""
    expect_all_ranks_raise(WORLD, export_on_rank_0_alone, RuntimeError,
                           rf"rank \d is in (fs.{call}|the model's forward) while another rank "
                           rf"of the model is in (the model's forward|fs.{call})",
                           call, str(tmp_path), timeout=60)


def evaluate_on_rank_0_alone(then: str):
    """A step, then `if rank == 0:` a forward under no_grad (an evaluation, a sample),
    while rank 1 trains on or exports the model."""
    model = fs.flex_shard(make_model())
    opt = sgd(model.parameters())
    sgd_train(model, opt, steps=1)
    if dist.get_rank() == 0:
        with torch.no_grad():
            model(batch(0, 0)[0])
    if then == "trains":
        sgd_train(model, opt, steps=1)
    else:
        fs.full_state_dict(model)


@pytest.mark.parametrize("then", ["trains", "exports"])
def test_an_evaluation_on_one_rank_alone_raises_on_every_rank(then):
    """It hung until the process group's timeout: rank 0's gathers waited for a rank
    that never joined them. Now a forward without grad opens with the same agreement
    all-reduce as a training forward, and both ranks raise naming the two places."""
    expect_all_ranks_raise(WORLD, evaluate_on_rank_0_alone, RuntimeError,
                           r"rank \d is in (a forward without grad|the model's forward|"
                           r"fs.full_state_dict).* while another rank of the model is in .*"
                           r"Evaluate or generate on every rank", then, timeout=60)


def evaluate_on_rank_0_under_unshard() -> list:
    """Every rank holds the gathered params (model.unshard()); rank 0 alone evaluates."""
    model = fs.flex_shard(make_model())
    opt = sgd(model.parameters())
    losses = sgd_train(model, opt, steps=1)
    with torch.no_grad():
        model.unshard()
        if dist.get_rank() == 0:
            model(batch(0, 0)[0])
        model.reshard()
    return losses + sgd_train(model, opt, steps=1)


def test_an_evaluation_on_one_rank_under_unshard_gathers_nothing_and_runs():
    first, second = run_world(WORLD, evaluate_on_rank_0_under_unshard)
    assert first == second and len(first) == 2


def freeze_between_micro_batches():
    """Three no-sync micro-batches train layers.0.up.weight; it is frozen for the synced one."""
    model = fs.flex_shard(make_model())
    rank = dist.get_rank()
    for micro in range(3):
        model.layers[0].up.weight.requires_grad_(micro < 2)
        model.set_requires_gradient_sync(micro == 2)
        x, y = batch(micro, rank)
        loss_fn(model(x), y).backward()


def test_freezing_between_no_sync_micro_batches_raises():
    """PyTorch steps the param with the grads it accumulated; the reduce would drop them
    (a frozen param gets no .grad from autograd): every rank raises at the synced backward."""
    expect_all_ranks_raise(WORLD, freeze_between_micro_batches, ValueError,
                           r"parameters \['layers\.0\.up\.weight'\] .* were frozen .* between "
                           r"no-sync micro-batches", timeout=60)


# copy.deepcopy of a wrapped model (an EMA) raises; the recipe it names trains right.

DECAY = 0.5


def deepcopy_wrapped():
    copy.deepcopy(fs.flex_shard(make_model()))


def pickle_wrapped():
    torch.save(fs.flex_shard(make_model()), io.BytesIO())


def test_pickling_the_model_raises_naming_what_to_save():
    expect_all_ranks_raise(WORLD, pickle_wrapped, TypeError,
                           r"pickling a flex_shard-ed FlexShardTinyGPT \(torch.save\(model\)\) is "
                           r"not supported.*torch.save\(fs.full_state_dict\(model\), path\)")


def ema_recipe():
    model = make_model()
    ema = copy.deepcopy(model)
    fs.flex_shard(model)
    fs.flex_shard(ema)
    losses = sgd_train(model, sgd(model.parameters()), step_fn=None)
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - DECAY)
    return losses, fs.full_state_dict(ema)


def test_deepcopy_raises_and_the_ema_recipe_trains():
    expect_all_ranks_raise(WORLD, deepcopy_wrapped, TypeError,
                           r"copy.deepcopy of a flex_shard-ed FlexShardTinyGPT is not supported.*"
                           r"ema = copy.deepcopy\(model\); fs.flex_shard\(model\).*"
                           r"with torch\.no_grad\(\): torch\._foreach_lerp_\(")
    losses, ema = run_world(WORLD, ema_recipe)[0]
    start = make_model().state_dict()
    ref_losses, trained = reference()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    want = {k: torch.lerp(start[k], v, 1 - DECAY) for k, v in trained.items()}
    assert ema.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(ema[k], v, rtol=1e-5, atol=1e-6, msg=k)


# Param groups by a rule on the param: weight decay off for vectors (p.ndim) or
# for small params (by the full shape, from model.state_dict(): no collective).

DECAY_RULES = ("ndim", "full numel")
GROUP_PLACEMENTS = {"ragged 3:1": fs.RaggedShard(units=(3, 1)),  # uneven pieces
                    "shard1": lambda fqn, p: fs.Shard(1) if p.dim() > 1 else fs.Shard(0)}


def decay_groups(model, rule: str) -> list:
    if rule == "ndim":
        decays = {n: p.ndim >= 2 for n, p in model.named_parameters()}
    else:
        full = model.state_dict()  # full shapes; a piece's numel is this rank's
        decays = {n: full[n].numel() >= 256 for n, _ in model.named_parameters()}
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n, d in decays.items() if d], "weight_decay": 0.5},
            {"params": [params[n] for n, d in decays.items() if not d], "weight_decay": 0.0}]


def decay_grouped(rule: str, placement: str) -> tuple:
    model = fs.flex_shard(make_model(), placement=GROUP_PLACEMENTS[placement])
    losses = sgd_train(model, sgd(decay_groups(model, rule)))
    return losses, fs.full_state_dict(model)


@pytest.mark.parametrize("placement", sorted(GROUP_PLACEMENTS))
@pytest.mark.parametrize("rule", DECAY_RULES)
def test_param_groups_by_a_rule_on_the_param_train_as_one_process(rule, placement):
    groups = decay_groups(make_model(), rule)
    assert groups[0]["params"] and groups[1]["params"], "both groups must be used"
    ref_losses, ref_params = reference(params_of=lambda m: decay_groups(m, rule))
    for losses, full in run_world(WORLD, decay_grouped, rule, placement):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0)
        for k, v in ref_params.items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


# A bucket's module called twice in one forward: both calls' grads are summed.


class TwiceGPT(TinyGPT):
    """TinyGPT whose block 1 runs twice."""

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = self.layers[1](self.layers[0](x))
        x = self.layers[1](x)
        return self.head(self.norm(x))


def twice_model() -> TwiceGPT:
    torch.manual_seed(0)
    return TwiceGPT()


def twice_body():
    model = fs.flex_shard(twice_model())  # a bucket per block
    return sgd_train(model, sgd(model.parameters())), fs.full_state_dict(model)


def test_module_called_twice_in_one_forward_trains():
    assert_matches_reference(run_world(WORLD, twice_body)[0], model=twice_model())


# Gradient hooks on params see this rank's piece of the averaged gradient: an
# elementwise hook (here, doubling one param's grad) trains as unsharded; so does
# an optimizer step in a post-accumulate-grad hook, registered before or after.


def double(grad):
    return grad * 2


def hooks_body(before: bool):
    model = make_model()
    if not before:
        fs.flex_shard(model)
    model.layers[0].up.weight.register_hook(double)
    in_backward = list(model.layers[1].parameters())
    for p in in_backward:
        p.register_post_accumulate_grad_hook(step_in_backward(sgd([p])))
    if before:
        fs.flex_shard(model)
    rest = [p for p in model.parameters() if all(p is not q for q in in_backward)]
    return sgd_train(model, sgd(rest)), fs.full_state_dict(model)


def hooked_reference() -> nn.Module:
    model = make_model()
    model.layers[0].up.weight.register_hook(double)
    for p in model.layers[1].parameters():
        p.register_post_accumulate_grad_hook(step_in_backward(sgd([p])))
    return model


def step_in_backward(opt):
    def hook(param):
        opt.step()
        opt.zero_grad()
    return hook


@pytest.mark.parametrize("before", [False, True])
def test_grad_hooks_on_params(before):
    assert_matches_reference(run_world(WORLD, hooks_body, before)[0], model=hooked_reference())


# torch.nn.utils.clip_grad_norm_ and get_total_norm give the global norm.

MAX_NORM = 0.05  # below TinyGPT's grad norms: every step clips


def torch_clip(norm_type: float, foreach):
    def clip(model):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type,
                                              foreach=foreach)
        assert norm > MAX_NORM, "the test must clip"
        clip.norms.append(float(norm))
    clip.norms = []
    return clip


def torch_clip_body(norm_type, foreach):
    model = fs.flex_shard(make_model())
    clip = torch_clip(norm_type, foreach)
    losses = sgd_train(model, sgd(model.parameters()), step_fn=clip)
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads)  # zero_grad
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    totals = (float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()],
                                                  norm_type)),
              float(fs.clip_grad_norm_(model, 1e9, norm_type)))
    return (losses, fs.full_state_dict(model)), clip.norms, totals


@pytest.mark.parametrize("norm_type,foreach", [(2.0, None), (2.0, False), (float("inf"), None),
                                               (1.0, False)])
def test_torch_clip_grad_norm_is_global(norm_type, foreach):
    results = run_world(WORLD, torch_clip_body, norm_type, foreach)
    ref_clip = torch_clip(norm_type, foreach)
    assert_matches_reference(results[0][0], step_fn=ref_clip)
    torch.testing.assert_close(torch.tensor(results[0][1]), torch.tensor(ref_clip.norms),
                               rtol=1e-5, atol=0)
    for _, norms, (total, fs_total) in results:
        assert norms == results[0][1]  # the same on every rank
        assert total == pytest.approx(fs_total, rel=1e-5)


# A param flex_shard cannot keep (here one with a weak reference): the optimizer
# built before the wrap raises at its first step instead of training nothing.


def stale_optimizer():
    import weakref

    model = make_model()
    held = weakref.ref(model.head.weight)  # noqa: F841 - keeps swap_tensors from taking it
    opt = sgd(model.parameters())
    fs.flex_shard(model)
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    opt.step()


def test_optimizer_over_a_replaced_param_raises():
    expect_all_ranks_raise(WORLD, stale_optimizer, RuntimeError,
                           r"SGD holds parameter 'head.weight' as it was before flex_shard.*"
                           r"Build the optimizer after flex_shard")


# A bucket on its own smaller mesh with plain params: torch's norms refuse.


def sub_mesh_clip():
    from torch.distributed.device_mesh import init_device_mesh

    solo = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    specs = [fs.BucketSpec("layers.1.*", mesh=solo, name="expert"),
             fs.BucketSpec(["tok.*", "pos", "layers.0.*", "norm.*", "head.*"])]
    model = fs.flex_shard(make_model(), buckets=specs)
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_torch_clip_refuses_a_bucket_on_a_smaller_mesh():
    expect_all_ranks_raise(WORLD, sub_mesh_clip, NotImplementedError,
                           r"bucket 'expert' runs on its own mesh, smaller than the model's.*"
                           r"fs.clip_grad_norm_\(model, max_norm\)")


# A module of the root's bucket (here the output head) called outside the model's
# forward raises; with a bucket of its own it gathers by itself and trains.


class HiddenGPT(TinyGPT):
    """TinyGPT whose forward stops before the head: the loss applies it."""

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def hidden_model() -> HiddenGPT:
    torch.manual_seed(0)
    return HiddenGPT()


def head_outside(model, x):
    return model.head(model(x))


def stray_head():
    model = fs.flex_shard(hidden_model())
    head_outside(model, batch(0, dist.get_rank())[0])


def own_head_bucket():
    specs = [fs.BucketSpec("layers.0.*"), fs.BucketSpec("layers.1.*"), fs.BucketSpec("head.*"),
             fs.BucketSpec(["tok.*", "pos", "norm.*"])]
    model = fs.flex_shard(hidden_model(), buckets=specs)
    return sgd_train(model, sgd(model.parameters()), logits=head_outside), fs.full_state_dict(model)


def test_root_module_called_outside_forward():
    expect_all_ranks_raise(WORLD, stray_head, RuntimeError,
                           r"module 'head' ran outside the model's forward, which gathers its "
                           r"bucket .*fs.BucketSpec\('head.\*'\)")
    assert_matches_reference(run_world(WORLD, own_head_bucket)[0], model=hidden_model(),
                             logits=head_outside)


def stray_tied_head():
    """The head, tied to the embedding (registered first there), called outside
    forward: refused; model.unshard() around the call: the unwrapped model's logits."""
    torch.manual_seed(0)
    model = fs.flex_shard(HiddenGPT(tied=True))
    x = batch(0, 0)[0]
    said = []
    for call in (lambda: head_outside(model, x), lambda: model.tok(x)):  # either end of the tie
        try:
            call()
        except RuntimeError as e:
            said.append(str(e))
    with torch.no_grad():
        model.unshard()
        logits = head_outside(model, x)
        model.reshard()
    return said, logits


def test_tied_module_called_outside_forward_is_told_to_unshard():
    torch.manual_seed(0)
    want = head_outside(HiddenGPT(tied=True), batch(0, 0)[0])
    for said, logits in run_world(WORLD, stray_tied_head):
        assert len(said) == 2, said  # the embedding's hint used to be "a bucket of its own"
        for name, message in zip(("head", "tok"), said):
            assert re.search(rf"module '{name}' ran outside the model's forward.*call "
                             r"model.unshard\(\) before and model.reshard\(\) after.*a bucket of "
                             r"its own cannot gather it, as it holds a parameter tied to another "
                             r"module's", message), message
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


# An optimizer built between flex_shard on the meta device and to_empty(): the
# Parameter objects survive the move, so it trains.


def optimizer_before_to_empty():
    with torch.device("meta"):
        model = make_model()
    fs.flex_shard(model)
    opt = sgd(model.parameters())
    before = list(model.parameters())
    model.to_empty(device="cpu")
    assert all(a is b for a, b in zip(before, model.parameters()))
    fs.load_full_state_dict(model, make_model().state_dict())
    # torch's clip after the move: the grads' norm groups follow the storage's device
    return sgd_train(model, opt, step_fn=torch_clip(2.0, None)), fs.full_state_dict(model)


def test_optimizer_built_before_to_empty_trains():
    assert_matches_reference(run_world(WORLD, optimizer_before_to_empty)[0],
                             step_fn=torch_clip(2.0, None))


# A tensor swapped under a sharded param (issue 45): `p.data = t` or `p.set_(t)` after
# wrapping left the gather reading the storage while the optimizer stepped `t`. The
# next forward (or module.unshard()) raises on every rank before any collective.


def same_size_clone(model):
    model.head.weight.data = model.head.weight.data.clone()


def full_size_tensor(model):
    model.head.weight.data = torch.randn(37, 30)


def set_storage(model):
    with torch.no_grad():
        model.layers[0].up.weight.set_(torch.zeros_like(model.layers[0].up.weight))


def swap_then_forward(swap, unshard: bool = False, save: bool = False):
    """One step, the swap, then a forward (or unshard(), or fs.full_state_dict: it
    would have gathered the old values) that must raise without a collective."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), comm=comm)
    sgd_train(model, sgd(model.parameters()), steps=1)
    swap(model)
    comm.reset()
    try:
        if save:
            fs.full_state_dict(model)
        else:
            model.unshard() if unshard else model(batch(1, dist.get_rank())[0])
    finally:
        assert not any(comm.calls.values()), comm.calls


@pytest.mark.parametrize("swap,fqn", [(same_size_clone, "head.weight"),
                                      (full_size_tensor, "head.weight"),
                                      (set_storage, "layers.0.up.weight")])
@pytest.mark.parametrize("save", [False, True], ids=["forward", "full_state_dict"])
def test_tensor_swapped_under_a_param_raises(swap, fqn, save):
    expect_all_ranks_raise(WORLD, swap_then_forward, ValueError,
                           rf"parameter '{re.escape(fqn)}' \(bucket '.*'\) no longer views its "
                           r"bucket's storage: its tensor was swapped after flex_shard .*"
                           rf"p.copy_\(shard\).*load_state_dict\(\{{'{re.escape(fqn)}'", swap,
                           save=save)


def half_submodule(model):
    model.layers[1].half()


def test_submodule_converted_after_wrapping_raises():
    expect_all_ranks_raise(WORLD, swap_then_forward, NotImplementedError,
                           r"parameter 'layers\.1\.[\w.]+' \(bucket 'layers\.1'\) was converted "
                           r"to torch\.float16 after flex_shard \(module\.half\(\).*keeps it "
                           r"torch\.float32.*Convert the model before flex_shard", half_submodule)


def compiled_wrapper_state() -> tuple:
    model = fs.flex_shard(make_model())
    compiled = torch.compile(model)  # compiles at its first call: none here
    return list(fs.full_state_dict(compiled)), list(fs.full_state_dict(model))


def test_fs_functions_take_the_compiled_wrapper():
    for got, want in run_world(WORLD, compiled_wrapper_state):
        assert list(got) == list(want)


def weight_normed_model():
    """TinyGPT whose blocks' `up` layers take torch.nn.utils.weight_norm (a
    forward pre-hook that recomputes the weight from its g and v params)."""
    import warnings

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations
        for layer in model.layers:
            torch.nn.utils.weight_norm(layer.up)
    return model


def weight_normed() -> tuple:
    # each `up` layer its own bucket: its hooks and weight_norm's on one module
    rest = ("norm1", "qkv", "proj", "norm2", "down")
    buckets = [spec for i in range(2) for spec in (
        fs.BucketSpec(f"layers.{i}.up.*"), fs.BucketSpec([f"layers.{i}.{m}.*" for m in rest]))]
    model = fs.flex_shard(weight_normed_model(),
                          buckets=buckets + [fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"])])
    return sgd_train(model, sgd(model.parameters())), fs.full_state_dict(model)


def test_pre_hooks_registered_before_wrapping_see_the_unsharded_params():
    """weight_norm's pre-hook, registered before flex_shard, runs after the
    gather (flex_shard's pre-hook goes first, as FSDP2's)."""
    ref_losses, ref_params = reference(model=weight_normed_model())
    for losses, full in run_world(WORLD, weight_normed):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0)
        for k, v in ref_params.items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_tensor_swapped_before_unshard_raises():
    expect_all_ranks_raise(WORLD, swap_then_forward, ValueError,
                           r"parameter 'head.weight' .* no longer views its bucket's storage",
                           same_size_clone, unshard=True)


def test_one_rank_swapping_ends_the_job():
    """Only rank 1 swaps: it raises before its gather; rank 0, in the gather, fails
    as its peer exits (gloo: connection closed; torchrun stops the others)."""
    proc = torchrun("torchrun_one_rank_swaps.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert re.search(r"\[rank1\]: ValueError: parameter 'head.weight' \(bucket 'root'\) no longer "
                     r"views its bucket's storage", out), out[-4000:]
    assert "[rank0]: ValueError" not in out, out[-4000:]


def write_in_place(model):
    """What the error points to, and what optimizers do: writes into the storage."""
    with torch.no_grad():
        model.head.weight.mul_(0.5)
        model.layers[0].up.weight.copy_(model.layers[0].up.weight + 0.01)
    model.layers[1].down.weight.data.copy_(model.layers[1].down.weight.data * 0.9)
    model.tok.weight.data.add_(-0.01)


def in_place_writes():
    model = fs.flex_shard(make_model())
    return sgd_train(model, sgd(model.parameters()), step_fn=write_in_place), \
        fs.full_state_dict(model)


def test_in_place_writes_to_params_train():
    assert_matches_reference(run_world(WORLD, in_place_writes)[0], step_fn=write_in_place)


# Torch's DistributedDataParallel around a flex_shard model (Hugging Face's Trainer and
# accelerate wrap one in DDP when launched on several processes) would broadcast rank
# 0's shards over every rank's and average different shards' grads: refused on every
# rank before DDP's first collective, and the model trains on untouched.


def ddp_refused():
    model = fs.flex_shard(make_model())
    messages = []
    for wrapped in (model, torch.compile(model)):
        try:
            nn.parallel.DistributedDataParallel(wrapped)
        except TypeError as e:
            messages.append(str(e))
    return messages, (sgd_train(model, sgd(model.parameters())), fs.full_state_dict(model))


def test_distributed_data_parallel_around_the_model_is_refused():
    for messages, result in run_world(WORLD, ddp_refused):
        assert len(messages) == 2
        for message in messages:
            assert re.search(r"flex_shard model \(FlexShardTinyGPT\) was handed to torch's "
                             r"DistributedDataParallel.*Hugging Face's Trainer.*train the "
                             r"model as it is", message), message
        assert_matches_reference(result)
