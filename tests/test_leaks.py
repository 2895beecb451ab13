"""No leaks: 100 training steps (with a failed step now and then) keep memory
flat. Every buffer a collective filled is dead or freed once its step is over, the
live tensors are the same at step 10 and step 100, and RSS grows by far less
than what the collectives moved."""

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.runtime.state import get_state
from harness import run_world
from models import TinyGPT, batch, loss_fn

pytestmark = pytest.mark.world

STEPS = 100
FIRST = 10  # live tensors are compared between this step and the last
RSS_FROM = 50  # RSS growth is measured from this step to the last
FAIL_EVERY = 25  # a forward that raises, now and then


class TrackingComm(fs.GlooComm):
    """Keeps a weak reference to every buffer a collective writes."""

    def __init__(self):
        self.refs = []

    def all_gather(self, output, input, group, async_op=False):
        self.refs.append(weakref.ref(output))
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False):
        self.refs += [weakref.ref(output), weakref.ref(input)]
        return super().reduce_scatter(output, input, group, async_op)


def _holds_memory(t) -> bool:
    """Alive, over allocated storage (a bucket's gather output made once lives on
    over a freed storage between its gathers: runtime/unsharded.py)."""
    return t is not None and t.untyped_storage().nbytes() > 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reachable_tensors() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _live_tensors(earlier: dict) -> tuple:
    """(count, bytes of distinct storages) of the tensors Python can reach, less
    those alive before this test began (`earlier`, id -> tensor, held so their ids
    stay theirs: an earlier test's leftovers in this reused world)."""
    tensors = [t for t in _reachable_tensors() if id(t) not in earlier]
    storages = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        except RuntimeError:  # no real storage (a fake or freed tensor an earlier test's
            continue          # meter left to gc in this reused world): it holds no memory
    return len(tensors), sum(storages.values())


def _failing_forward(model, x) -> None:
    def boom(module, args):
        raise RuntimeError("injected")

    handle = model.layers[1].up.register_forward_pre_hook(boom)
    try:
        model(x)
    except RuntimeError:
        pass
    finally:
        handle.remove()


def _moved_bytes(model) -> int:
    return sum(b.counters.gather_wire_bytes + b.counters.reduce_wire_bytes
               for b in get_state(model).buckets)


def _train_and_measure():
    earlier = {id(t): t for t in _reachable_tensors()}
    torch.manual_seed(0)
    comm = TrackingComm()
    model = fs.flex_shard(TinyGPT(), comm=comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outlived, samples = 0, {}
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        if step % FAIL_EVERY == FAIL_EVERY - 1:
            _failing_forward(model, x)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        outlived += sum(_holds_memory(r()) for r in comm.refs)
        comm.refs.clear()
        if step + 1 in (FIRST, STEPS):
            samples[step + 1] = _live_tensors(earlier)
        if step + 1 in (RSS_FROM, STEPS):
            samples[f"rss{step + 1}"] = (_rss(), _moved_bytes(model))
    return outlived, samples


def test_hundred_steps_keep_memory_flat():
    for outlived, samples in run_world(2, _train_and_measure, timeout=180):
        assert outlived == 0  # no gather output, reduce input or output survives its step
        assert samples[STEPS] == samples[FIRST]  # same live tensors, same bytes
        (rss_a, moved_a), (rss_b, moved_b) = samples[f"rss{RSS_FROM}"], samples[f"rss{STEPS}"]
        assert moved_b > moved_a
        assert rss_b - rss_a < (moved_b - moved_a) / 2, (rss_b - rss_a, moved_b - moved_a)
