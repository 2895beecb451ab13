"""Prefetching when the execution order changes between steps.

A pass that unshards a bucket other than the one its recorded order expects
launches nothing more until it ends, keeps the gathers already in flight for
the buckets that still come, and becomes the order the next pass follows.
Every route below trains to the single-process reference at every prefetch
depth, no bucket gathers twice for one use, and a pass that follows its
recorded order wastes no gather.
"""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from harness import run_world
from models import TinyGPT, loss_fn
from training_helpers import check_against_reference, train

STEPS = 6
LAYERS = 3
BLOCKS = [fs.BucketSpec(f"layers.{i}.*", name=f"layers.{i}") for i in range(LAYERS)] + [
    fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]


class RoutedGPT(TinyGPT):
    """TinyGPT whose forward runs its blocks in `self.route` order."""

    def __init__(self) -> None:
        super().__init__(layers=LAYERS)
        self.route = list(range(LAYERS))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i in self.route:
            x = self.layers[i](x)
        return self.head(self.norm(x))


ROUTES = {  # step -> the blocks the training forward runs
    "skip_odd": lambda step: [0, 2] if step % 2 else [0, 1, 2],
    "reverse_odd": lambda step: [2, 1, 0] if step % 2 else [0, 1, 2],
    "switch_once": lambda step: [0, 2] if step >= 2 else [0, 1, 2],
    "eval_between": lambda step: [0, 1, 2],
}


def routed_step(kind):
    def step_fn(model, step, x, y):
        if kind == "eval_between":  # an evaluation forward on another branch, every step
            model.eval()
            model.route = [2, 0]
            with torch.no_grad():
                model(x)
            model.train()
        model.route = ROUTES[kind](step)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss
    return step_fn


def new_model() -> RoutedGPT:
    torch.manual_seed(0)
    return RoutedGPT()


def _counters(model) -> dict:
    from flexshard.runtime.state import get_state

    return {b.name: (b.counters.gathers, b.counters.prefetches, b.counters.discarded_prefetches)
            for b in get_state(model).buckets}


def train_routed(kind: str, depth: int) -> tuple:
    """Rank body: (losses, full params, per-step counter deltas, order changes)."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(new_model(), buckets=BLOCKS)
    model.set_prefetch_depth(depth)
    inner, per_step = routed_step(kind), []

    def counted(model, step, x, y):
        before = _counters(model)
        loss = inner(model, step, x, y)
        after = _counters(model)
        per_step.append({k: tuple(a - b for a, b in zip(after[k], before[k])) for k in after})
        return loss

    losses = train(model, STEPS, step_fn=counted)
    prefetcher = get_state(model).prefetcher
    return losses, fs.full_state_dict(model), per_step, (prefetcher.forward.changes,
                                                         prefetcher.backward.changes)


# Steps whose passes run the same order as the step before (eval_between's forward
# order alternates inside every step).
STEADY = {"switch_once": [1, 3, 4, 5]}


@pytest.mark.parametrize("kind", sorted(ROUTES))
def test_order_changes_keep_parity_and_gather_once_per_use(kind):
    runs = {depth: run_world(2, train_routed, kind, depth) for depth in (0, 1, 2)}
    for depth, results in runs.items():
        losses, full, _, _ = results[0]
        check_against_reference(losses, full, 2, STEPS, model=new_model(),
                                step_fn=routed_step(kind))
    for rank in range(2):
        uses = runs[0][rank][2]  # without prefetch, every gather is one use
        assert all(p == d == 0 for step in uses for _, p, d in step.values())
        for depth in (1, 2):
            per_step = runs[depth][rank][2]
            for step, (counts, base) in enumerate(zip(per_step, uses)):
                for name, (gathers, _, discarded) in counts.items():
                    # No bucket gathers twice for one use: only unused prefetches add gathers.
                    assert gathers == base[name][0] + discarded, (kind, depth, step, name)
                # At most `depth` launched gathers go unused per pass (forward, backward, eval).
                assert sum(d for _, _, d in counts.values()) <= depth * 3
                if step in STEADY.get(kind, []):
                    assert sum(d for _, _, d in counts.values()) == 0, (kind, depth, step)
                    assert sum(p for _, p, _ in counts.values()) > 0, "the re-recorded order prefetches"


def test_order_is_re_recorded_when_it_changes():
    changes = {kind: run_world(2, train_routed, kind, 1)[0][3] for kind in ROUTES}
    # (forward, backward) passes whose order differed from the recorded one.
    assert changes["switch_once"] == (1, 1)
    assert changes["skip_odd"] == (STEPS - 1, STEPS - 1)
    assert changes["reverse_odd"] == (STEPS - 1, STEPS - 1)
    assert changes["eval_between"] == (2 * STEPS - 1, 0)  # eval and train forwards alternate
