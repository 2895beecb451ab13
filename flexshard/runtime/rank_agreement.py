"""What the ranks of one wrapped model agree on at each training forward, and
where each rank is.

Which params train. Freezing a param after flex_shard is fine when every rank
freezes it (its grad is left out of the reduce). A rank that freezes a param the
others train adds zeros to their averaged gradient, and its pieces never update;
one that freezes a whole bucket skips the bucket's reduce-scatter while the others
wait in it. A rule on `p.numel()` does this quietly: under Owned or an uneven split
a rank's piece may be empty.

The setters' values. `set_requires_gradient_sync`, `set_requires_all_reduce`,
`set_reshard_after_forward` and `set_prefetch_depth` decide which collectives a
backward runs and in what order; `set_gradient_divide_factor` the scale of what it
reduces. A rank whose values differ skips a collective the others wait in, or
pairs its collectives with different ones of theirs (a hang until the process
group's timeout, or wrong values). Gradient accumulation over an uneven split of
the data does this: a rank that syncs on its own last micro-batch
(`i == len(loader) - 1`) syncs at another step than the others.

So at each forward under grad, before its first collective, the ranks compare a
checksum of each: host values over a gloo group of the model's ranks (no device
sync), the mesh's own where it is gloo. Where they differ every rank raises, naming
what differs (for the setters, after one all_gather_object of their values, which
every rank reaches since every rank saw the difference). The same all-reduce opens
the calls that gather the model outside the step (fs.full_state_dict,
fs.save_checkpoint, ...), carrying which call it is: a rank that calls one alone
(`if rank == 0: fs.full_state_dict(model)`) while the others go on training meets
their next forward's check, and both raise instead of pairing gathers until the
process group's timeout. So do the norms of sharded grads a user lists (torch's
clip_grad_norm_), with the grads' count and names: lists filtered by p.numel()
differ by rank under Owned.
"""

from __future__ import annotations

import functools
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

_FORWARD = "the model's forward"
_NORM = "a norm of sharded grads (torch.nn.utils.clip_grad_norm_, get_total_norm, ...)"
_EVAL = "a forward without grad (evaluation, generate)"
CALLS = ("fs.full_state_dict", "fs.full_optimizer_state_dict", "fs.full_grads",
         "fs.save_checkpoint")


def _site_code(site: str) -> int:
    return zlib.crc32(site.encode()) + 1  # > 0: the other half of the pair is its negation


_SITES = {_site_code(site): site for site in (_FORWARD, _NORM, _EVAL) + CALLS}


_NORM_FIX = (
    "a sharded grad's norm sums every rank's piece, so each rank must pass the same params in "
    "the same order; a list filtered by p.numel() or p.shape differs by rank (Owned, an uneven "
    "RaggedShard). Pass every param, or use fs.clip_grad_norm_(model, max_norm); in a "
    "hand-written optimizer step that wants this rank's piece (an Owned matrix its owner holds "
    "whole), take the norm of p.grad.as_subclass(torch.Tensor), which is no collective")


_CALL_FIX = (
    "calls that gather the model (fs.full_state_dict, fs.full_optimizer_state_dict, "
    "fs.full_grads, fs.save_checkpoint) are collectives: call them on every rank, at the same "
    "point of the loop (not under `if rank == 0:`), and save the result on rank 0")
_EVAL_FIX = (
    "each forward gathers its params from every rank of the model. Evaluate or generate on "
    "every rank (each on its own batch or prompts) and print or save on rank 0; to generate "
    "on one rank, gather first: fs.full_state_dict(model) on every rank, then on rank 0 "
    "load_state_dict(...) into an unwrapped copy of the model")


class RankAgreement:
    """The check of one wrapped model (`buckets`, over the ranks of its mesh's
    `group`; `prefetcher`'s depth)."""

    def __init__(self, buckets: Sequence, group, prefetcher) -> None:
        # the model's list, filled as the wrap builds its buckets (its grads' norms
        # hold this check before the last is built)
        self.buckets, self.group, self.prefetcher = buckets, group, prefetcher
        # torch's "fake" backend runs one rank of a world in one process: none to ask
        real = group is not None and dist.get_backend(group) != "fake"
        self.ranks = tuple(sorted(dist.get_process_group_ranks(group))) if real else ()
        self._host_group = None  # held here, not by the module: it goes with the model

    @functools.cached_property
    def trains(self) -> bool:  # read first after the wrap built every bucket
        return any(b.grad_slots for b in self.buckets)

    def check(self) -> None:
        """At a training forward: the ranks are all there, freeze alike and set alike."""
        if len(self.ranks) < 2 or not self.trains:
            return
        trains = zlib.crc32(bytes(p.requires_grad for b in self.buckets for p in b.params))
        settings = self._settings()
        # the values' hash: bools, ints, floats and None hash alike in every process
        setting_sig = hash(tuple(value for _, _, value in settings)) & ((1 << 62) - 1)
        (high, low), setting = self._agree(_FORWARD, trains, setting_sig)
        if (high, low) != (trains, trains):
            raise ValueError(
                f"the ranks disagree on which parameters train: rank {dist.get_rank()} "
                f"freezes {self._frozen()} (requires_grad_(False) after flex_shard). Every rank "
                "must freeze the same parameters, or the rank that freezes one adds zeros to "
                "the others' averaged gradient. A rule on p.numel() or p.shape sees this "
                "rank's piece, not the parameter: choose by name, p.ndim, or the full shape, "
                "model.state_dict()[name].shape")
        if setting[0] != setting[1]:
            self._raise_settings(settings)

    def check_eval(self) -> None:
        """At a forward without grad that gathers: the ranks are all in one. A rank
        that evaluates or generates alone (`if rank == 0: model.generate(...)`) meets
        the others' next forward or call here, and all raise."""
        if len(self.ranks) >= 2 and self.trains and \
                not all(b.held is not None for b in self.buckets):  # unshard(): no gathers
            self._agree(_EVAL, 0, 0)

    def check_call(self, site: str, *sigs: int) -> list:
        """At the start of `site`, a call that gathers the model outside the step: the
        ranks are all in it (a rank training meanwhile is at its forward's check).
        Returns each of `sigs` (what the call needs alike) as (max, min), [] alone."""
        assert site in CALLS and len(sigs) <= 2, site
        if len(self.ranks) >= 2 and self.trains:
            return self._agree(site, *sigs, *(0,) * (2 - len(sigs)))[:len(sigs)]
        return []

    def check_norms(self, names: Sequence[str]) -> None:
        """Before a norm's all-reduce over the sharded grads a user passed (a list
        filtered by p.numel() differs by rank under Owned): the ranks are all in one,
        over the same grads. A rank whose list is longer meets the others' next
        forward here, and both raise, instead of pairing its norm with their next
        collective."""
        if len(self.ranks) < 2:
            return
        count, names_sig = len(names), zlib.crc32("\n".join(names).encode())
        agreed = self._agree(_NORM, count, names_sig)
        if agreed != [(count, count), (names_sig, names_sig)]:
            listed = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            raise RuntimeError(
                f"the ranks took the norms of different gradients in one collective (rank "
                f"{dist.get_rank()}: {count}, {listed}): {_NORM_FIX}")

    def _agree(self, site: str, *sigs: int) -> list:
        """All-reduce (site, sigs) by max and min; raise where the sites differ.
        Returns each sig's (max, min)."""
        code = _site_code(site)
        values = torch.tensor([v for x in (code, *sigs) for v in (x, -x)], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._host())
        high, low = int(values[0]), -int(values[1])
        if high != low:
            other = _SITES.get(high if high != code else low, "another flexshard call")
            fix = _NORM_FIX if _NORM in (site, other) else \
                _EVAL_FIX if _EVAL in (site, other) else _CALL_FIX
            raise RuntimeError(f"rank {dist.get_rank()} is in {site} while another rank of "
                               f"the model is in {other}: {fix}")
        return [(int(values[i]), -int(values[i + 1])) for i in range(2, len(values), 2)]

    def _settings(self) -> list:
        """(setter, bucket, value) of each setter's value that decides a bucket's
        collectives or its grads' scale, then the prefetch depth (bucket None)."""
        rows = []
        for b in self.buckets:
            rows += [("set_requires_gradient_sync", b.name, b.grads.requires_gradient_sync),
                     ("set_gradient_divide_factor", b.name, b.grads.gradient_divide_factor),
                     ("set_reshard_after_forward", b.name, b.gather.reshard_after_forward)]
            if b.grads.replicate_group is not None:  # without replicas it changes nothing
                rows.append(("set_requires_all_reduce", b.name, b.grads.requires_all_reduce))
        return rows + [("set_prefetch_depth", None, self.prefetcher.depth)]

    def _raise_settings(self, settings: list) -> None:
        """Every rank: gather the ranks' settings and raise naming the first that differs."""
        everyone = [None] * len(self.ranks)
        dist.all_gather_object(everyone, settings, group=self._host())
        i = next(i for i in range(len(settings)) if len({s[i] for s in everyone}) > 1)
        setter, bucket = settings[i][:2]
        ranks = [dist.get_global_rank(self._host(), k) for k in range(len(everyone))]
        values = ", ".join(f"rank {r} has {s[i][2]!r}" for r, s in zip(ranks, everyone))
        where = f" for bucket {bucket!r}" if bucket is not None else ""
        raise ValueError(
            f"the ranks disagree on {setter}{where}: {values}. Call each setter alike on every "
            "rank, before the forward: a rank whose backward skips or reorders a collective "
            "leaves the others waiting in theirs (a hang until the process group's timeout). "
            "Under gradient accumulation every rank runs the same number of micro-batches and "
            "syncs on the same one; a rule on this rank's own data (len(loader), the last "
            "batch of an uneven split) differs between ranks: give every rank the same number "
            "of batches (drop_last=True, or a DistributedSampler)")

    def _host(self):
        """The mesh's group where it takes CPU tensors (gloo), else a gloo group of its
        ranks made on first use (only they take part)."""
        if self._host_group is None:
            self._host_group = self.group if "gloo" in str(dist.get_backend(self.group)) \
                else dist.new_group(list(self.ranks), backend="gloo",
                                    use_local_synchronization=True)
        return self._host_group

    def _frozen(self) -> str:
        """This rank's params frozen since the wrap (a few, then a count)."""
        names = [repr(b.slots[i].fqn) for b in self.buckets for i in b.grad_slots
                 if not b.params[i].requires_grad]
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return ", ".join(names[:4]) + more if names else "none of the trainable ones"
