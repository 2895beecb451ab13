"""Methods of the user's class that cannot run on a wrapped model: the class a
flex_shard model becomes refuses them on every rank alike, before any work.

PEFT's `merge_adapter()`, `merge_and_unload()` and `unmerge_adapter()` add (or
take back) an adapter's delta, B @ A, into its base weight in place. Each rank of
a model sharded over several ranks holds pieces of both, so the merge fails in
PEFT's matmul with a shape error, and under `Owned` on some ranks only (an owner
holds its matrices whole): the others go on to their next collective and wait
there for ever. Under `module.unshard()` the merge would write into gathered
copies, which `reshard()` drops. At one rank each piece is the whole tensor and
the merges run as PEFT's.

transformers' `resize_token_embeddings()` swaps the embedding's tensor for a
resized copy of this rank's piece (`weight.data = ...`) and registers a new head:
the bucket's storage no longer backs the param, and a tied head keeps the old
shape. Refused at any world size: resize before flex_shard.
"""

from __future__ import annotations

from typing import Callable

MERGES = ("merge_adapter", "merge_and_unload", "unmerge_adapter")


def refused_methods(cls: type, spans_ranks: Callable) -> dict:
    """The refusing methods of the wrapped class of `cls` (see the module's text)."""
    return {**_refused_merges(cls, spans_ranks), **_refused_resize(cls)}


def _refused_resize(cls: type) -> dict:
    """transformers' resize_token_embeddings, where `cls` has it."""
    if getattr(cls, "resize_token_embeddings", None) is None:
        return {}

    def resize_token_embeddings(self, *args, **kwargs):
        raise RuntimeError(
            f"resize_token_embeddings() on a flex_shard model ({cls.__name__}): it would "
            "resize this rank's piece of the embedding as if it were the whole table and "
            "swap it in, which the bucket's storage and a tied head do not follow. Resize "
            "before flex_shard: model.resize_token_embeddings(n), then fs.flex_shard(model); "
            "to resize a trained model, load fs.full_state_dict(model) into an unwrapped "
            "one, resize it there and wrap it again")

    return {"resize_token_embeddings": resize_token_embeddings}


def _refused_merges(cls: type, spans_ranks: Callable) -> dict:
    """The merge methods of the wrapped class of `cls` when `cls` is one of PEFT's
    (a PeftModel passes them on to its tuner through __getattr__), else {}.
    `spans_ranks(module)`: whether the model's mesh has more than one rank."""
    if cls.__module__.split(".")[0] != "peft":
        return {}
    forwards = any(c.__name__ == "PeftModel" and c.__module__ == "peft.peft_model"
                   for c in cls.__mro__)
    return {name: _refusing(cls, name, spans_ranks) for name in MERGES
            if forwards or getattr(cls, name, None) is not None}  # never one it lacks


def _refusing(cls: type, name: str, spans_ranks: Callable):
    own = getattr(cls, name, None)  # a tuner defines it; a PeftModel finds it in its tuner

    def merge(self, *args, **kwargs):
        if spans_ranks(self):
            raise RuntimeError(
                f"{name}() on a flex_shard model sharded over several ranks: each rank holds "
                "pieces of the base weights and of the adapter, so the merge cannot run here "
                "(PEFT's matmul would fail on some ranks while the others wait). Merge on an "
                "unwrapped model: build the same PeftModel without flex_shard, "
                "load_state_dict(dict(fs.full_state_dict(model))) into it (the gather is a "
                f"collective: every rank), then call {name}() there")
        method = own.__get__(self) if own is not None else cls.__getattr__(self, name)
        return method(*args, **kwargs)

    merge.__name__ = merge.__qualname__ = name
    merge.__doc__ = own.__doc__ if own is not None else None
    return merge
