"""fs.compile: the whole step in one graph (gathers and reductions inside it)
trains as the one-process reference does, with SGD, and nothing runs eagerly."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import flexshard as fs
from compile_check import compiled_graph_calls
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import (assemble_grads, assert_rel_close, make_model, reference_run,
                       sharded_grads)

STEPS = 4
LR = 1e-2
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _breaks() -> int:
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def train_whole(config: dict, backend: str = "aot_eager", fullgraph: bool = True) -> dict:
    """Rank body: STEPS SGD steps of fs.compile(flex_shard(TinyGPT))."""
    import torch.distributed as dist

    torch._dynamo.reset()
    counters.clear()
    rank = dist.get_rank()
    model = fs.flex_shard(make_model(), **config)
    fs.compile(model, fullgraph=fullgraph, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, graph_calls, grads = [], [], None
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        graph_calls.append(compiled_graph_calls(loss))
        loss.backward()
        if step == 0:
            grads = sharded_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "full": fs.full_state_dict(model),
            "graph_calls": graph_calls, "breaks": _breaks(),
            "frames": counters["stats"]["unique_graphs"]}


def mixed(fqn: str, param) -> fs.Placement:
    """Three placements in every block's bucket."""
    if ".up." in fqn or ".down." in fqn:
        return fs.Owned()
    return fs.RaggedShard() if param.dim() == 1 else fs.Shard(0)


def check_whole(world: int, config: dict, rel: float = 1e-5, **kw) -> list:
    ref_losses, ref_params, ref_grads = reference_run(
        world, STEPS, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=LR),
        param_dtype=(config.get("mp_policy") or fs.MixedPrecisionPolicy()).param_dtype)
    results = run_world(world, train_whole, config, timeout=400, **kw)
    mean = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=rel, atol=0)
    grads = assemble_grads([(None, None, r["grads"]) for r in results])
    for k, ref in ref_grads.items():
        assert_rel_close(grads[k], ref, rel, f"grad of {k}")
    for k, ref in ref_params.items():
        assert_rel_close(results[0]["full"][k], ref, rel, k)
    for r in results:
        assert r["breaks"] == 0 and r["graph_calls"] == [1] * STEPS, r
    return results


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Owned(), fs.RaggedShard()],
                         ids=["shard", "owned", "ragged"])
def test_whole_step_matches_reference(placement):
    check_whole(2, {"placement": placement})


def test_whole_step_uneven_world_mixed_placements_and_inductor():
    """World 3 (uneven pieces), Shard(0), Owned and RaggedShard in one bucket each
    way, inductor: the same training."""
    config = {"placement": mixed}
    check_whole(3, config, backend="inductor")


def test_whole_step_bf16_gathers():
    check_whole(2, {"mp_policy": BF16}, rel=2 ** -6)
