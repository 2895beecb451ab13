"""fs.compile with blocks that have Python side effects: a Hugging Face model's KV
cache (on by default, also while training), a counter, an auxiliary loss stored on
the module (troubleshooting.md's pattern). The reshard checkpoint recomputes only
the gathers, so each side effect happens once per forward, as in eager: the whole
step compiles with fullgraph=True and trains as one process does (SGD). Under the
user's own activation checkpoint too, without reshard after forward; with it, torch's
dynamo fails on the nested checkpoints and fs.compile says so on every rank."""

from __future__ import annotations

import inspect

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch._dynamo.utils import counters

import flexshard as fs
from compile_check import compiled_graph_calls, counting_backend
from harness import expect_all_ranks_raise, run_world

WORLD, STEPS, LR = 2, 3, 0.5


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


class Block(nn.Module):
    """Counts its calls and keeps an orthogonality penalty on its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.calls, self.aux = 0, None

    def forward(self, x):
        self.calls += 1
        self.aux = (self.weight @ self.weight.T - torch.eye(16)).square().sum()
        return torch.tanh(x @ self.weight.T)


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def checkpointed() -> nn.Sequential:
    """blocks() under the user's activation checkpoint (torchtitan's wrapper)."""
    return nn.Sequential(*(checkpoint_wrapper(b) for b in blocks()))


def ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def features(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))


def llama_loss(model, x):
    return model(input_ids=x, labels=x).loss  # use_cache as configured: on


def blocks_loss(model, x):
    return model(x).square().mean() + 0.01 * sum(b.aux for b in model)


CASES = {"llama": (llama, llama_loss, ids), "blocks": (blocks, blocks_loss, features),
         "checkpointed": (checkpointed, blocks_loss, features)}


def train(case: str, rank: int = 0, world: int = 1, reshard: bool = True) -> tuple:
    """STEPS SGD steps: (losses, first grads, final params, block calls, graph calls,
    graph breaks, forward's signature); one process on every rank's batch when
    world is 1, else fs.compile'd flex_shard on this rank's."""
    make, loss_fn, data = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    model = make()
    signature = None
    if world > 1:
        specs = None if case == "llama" else [fs.BucketSpec(f"{i}.*") for i in range(2)]
        model = fs.flex_shard(model, buckets=specs, reshard_after_forward=reshard)
        plain = inspect.signature(model.forward)
        graphs = []
        fs.compile(model, fullgraph=True, backend=counting_backend(graphs))
        signature = inspect.signature(model.forward) == plain
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first, ran = [], None, []
    for step in range(STEPS):
        x = data(step, rank) if world > 1 else torch.cat([data(step, r) for r in range(WORLD)])
        loss = loss_fn(model, x)
        ran.append(compiled_graph_calls(loss))
        loss.backward()
        if first is None:
            first = fs.full_grads(model) if world > 1 else {
                k.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                for k, p in model.named_parameters()}  # the names fs.full_grads gives
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = fs.full_state_dict(model) if world > 1 else dict(model.state_dict())
    calls = [b.calls for b in model] if case != "llama" else []
    breaks = sum(counters["graph_break"].values())
    return losses, first, params, calls, ran, breaks, signature


def _rank(case: str, reshard: bool = True) -> tuple:
    return train(case, dist.get_rank(), dist.get_world_size(), reshard)


def check(case: str, reshard: bool = True) -> list:
    ref_losses, ref_grads, ref_params, _, _, _, _ = train(case)
    results = run_world(WORLD, _rank, case, reshard, timeout=400)
    mean = torch.stack([torch.stack(r[0]) for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    for losses, grads, params, calls, ran, breaks, signature in results:
        for k, ref in ref_grads.items():
            torch.testing.assert_close(grads[k], ref, rtol=1e-4, atol=1e-6, msg=k)
        for k, ref in ref_params.items():
            torch.testing.assert_close(params[k], ref, rtol=1e-4, atol=1e-6, msg=k)
        assert all(ran) and breaks == 0 and signature, (ran, breaks, signature)
    return results


def test_a_hf_model_with_its_kv_cache_on_trains_as_one_process():
    check("llama")


def test_a_blocks_side_effects_happen_once_per_forward():
    for result in check("blocks"):
        assert result[3] == [STEPS, STEPS]  # self.calls += 1 ran once per step, not twice


def test_side_effects_under_the_users_activation_checkpoint():
    """Without reshard after forward the user's checkpoint is the only one: trains
    as one process, the side effects once per forward. With it, dynamo's internal
    error becomes fs.compile's, naming the way out, on every rank."""
    for result in check("checkpointed", reshard=False):
        assert result[3] == [STEPS, STEPS]
    expect_all_ranks_raise(WORLD, _rank, RuntimeError,
                           r"fs.compile: dynamo failed on a block's Python side effect inside an "
                           r"activation checkpoint nested .* reshard_after_forward=False",
                           "checkpointed", timeout=400)


def _head_called_outside():
    """A loss that applies the model's head itself, after a compiled step."""
    rank = dist.get_rank()
    model = fs.flex_shard(llama())
    fs.compile(model, backend=counting_backend([]))
    model(input_ids=ids(0, rank), labels=ids(0, rank)).loss.backward()
    hidden = model.model(input_ids=ids(1, rank)).last_hidden_state
    model.lm_head(hidden)


def test_the_roots_modules_called_outside_its_forward_are_refused():
    expect_all_ranks_raise(WORLD, _head_called_outside, RuntimeError,
                           r"module 'model.embed_tokens' ran outside the model's forward, which "
                           r"gathers its bucket 'root'")
