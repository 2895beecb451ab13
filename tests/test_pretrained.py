"""fs.load_pretrained: full weights from a state dict or safetensors files into
a sharded model, one parameter at a time, reading only each rank's boxes."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import flexshard as fs
from ckpt_util import PLACEMENTS
from harness import expect_all_ranks_raise, run_world
from reference import make_model


def pretrained(tied=False) -> dict:
    """The weights to load: TinyGPT with seed 0 (the tied embedding stored
    once, under its second name head.weight)."""
    sd = make_model(0, tied=tied).state_dict()
    if tied:
        del sd["tok.weight"]
    return {k: v.clone() for k, v in sd.items()}


def _load(source, placement_name, tied=False, prefix=""):
    model = fs.flex_shard(make_model(1, tied=tied), placement=PLACEMENTS[placement_name])
    ptrs = [p.data_ptr() for p in model.parameters()]
    keys = fs.load_pretrained(model, source,
                              key_map=(lambda n: prefix + n) if prefix else None)
    assert ptrs == [p.data_ptr() for p in model.parameters()], "params were rebound"
    return keys, fs.full_state_dict(model)


def check_loaded(results, expected: dict) -> None:
    for keys, full in results:
        assert keys == fs.PretrainedKeys([], [])
        for k, v in expected.items():
            assert torch.equal(full[k], v), k


@pytest.mark.parametrize("placement", ["shard1", "uneven"])
def test_safetensors_file(tmp_path, placement):
    save_file(pretrained(), str(tmp_path / "model.safetensors"))
    check_loaded(run_world(2, _load, str(tmp_path / "model.safetensors"), placement),
                 pretrained())


def test_safetensors_directory_renamed_and_tied(tmp_path):
    sd = {f"transformer.{k}": v for k, v in pretrained(tied=True).items()}
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:5]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[5:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    results = run_world(2, _load, str(tmp_path), "uneven", True, "transformer.")
    expected = pretrained(tied=True)
    expected["tok.weight"] = expected.pop("head.weight")  # full_state_dict's name for the pair
    check_loaded(results, expected)


class LazyWeights(Mapping):
    """Makes each tensor on access and counts how many are alive at once."""

    def __init__(self, weights: dict) -> None:
        self._weights, self.alive, self.peak = weights, 0, 0

    def __getitem__(self, key):
        tensor = self._weights[key].clone()
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor, self._dead)
        return tensor

    def _dead(self):
        self.alive -= 1

    def __iter__(self):
        return iter(self._weights)

    def __len__(self):
        return len(self._weights)


def _load_lazy():
    source = LazyWeights(pretrained())
    keys, full = _load(source, "uneven")
    return keys, full, source.peak


def test_mapping_is_read_one_tensor_at_a_time():
    results = run_world(2, _load_lazy)
    check_loaded([r[:2] for r in results], pretrained())
    assert [r[2] for r in results] == [1, 1]


def test_buffers_and_unused_keys(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9), nn.Linear(9, 3))
    net[1].running_mean.uniform_()
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    sd["extra.weight"] = torch.ones(2)
    save_file(sd, str(tmp_path / "net.safetensors"))
    for keys, loaded in run_world(2, _load_net, str(tmp_path / "net.safetensors")):
        assert keys == fs.PretrainedKeys([], ["extra.weight"])
        for k, v in net.state_dict().items():
            assert torch.equal(loaded[k], v), k


def _load_net(path):
    torch.manual_seed(1)
    net = fs.flex_shard(nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9), nn.Linear(9, 3)))
    keys = fs.load_pretrained(net, path)
    full = fs.full_state_dict(net)
    full.update({k: v for k, v in net.named_buffers()})
    return keys, full


def _load_broken(case):
    sd = pretrained()
    if case == "missing":
        del sd["layers.1.down.bias"]
    elif case == "shape":
        sd["layers.0.qkv.weight"] = sd["layers.0.qkv.weight"][:80]
    elif case == "lenient":
        del sd["layers.1.down.bias"]
        model = fs.flex_shard(make_model(1))
        return fs.load_pretrained(model, sd, strict=False)
    _load(sd, "shard0")


def test_errors_name_the_key(tmp_path):
    expect_all_ranks_raise(2, _load_broken, ValueError,
                           r"the source has no tensor for \['layers\.1\.down\.bias'\] "
                           r"\(1 missing\)", "missing")
    expect_all_ranks_raise(2, _load_broken, ValueError,
                           r"source tensor 'layers\.0\.qkv\.weight' has shape \(80, 30\) but "
                           r"parameter 'layers\.0\.qkv\.weight' is \(90, 30\)", "shape")
    assert run_world(2, _load_broken, "lenient") == [(["layers.1.down.bias"], [])] * 2
    expect_all_ranks_raise(2, _load, FileNotFoundError, r"'.*nothing\.safetensors' does not exist",
                           str(tmp_path / "nothing.safetensors"), "shard0")


def test_argument_errors(tmp_path, monkeypatch):
    import sys

    model = fs.flex_shard(make_model())  # no process group: world size 1
    with pytest.raises(TypeError, match=r"key_map must be a callable name -> source key"):
        fs.load_pretrained(model, pretrained(), key_map={"pos": "p"})
    with pytest.raises(TypeError, match=r"source must be a mapping of tensors or a path .*got int"):
        fs.load_pretrained(model, 42)
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors file in"):
        fs.load_pretrained(model, str(tmp_path))
    save_file(pretrained(), str(tmp_path / "model.safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'flexshard\[safetensors\]'"):
        fs.load_pretrained(model, str(tmp_path))


def test_buffer_of_another_shape():
    net = fs.flex_shard(nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9)))
    sd = dict(nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9)).state_dict())
    sd["1.running_mean"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"source tensor '1\.running_mean' has shape \(8,\) but "
                                         r"the buffer is \(9,\)"):
        fs.load_pretrained(net, sd)
