"""Manual check (not committed): TP and sub-mesh MoE through fs.compile under inductor."""
import torch, torch.distributed as dist
import flexshard as fs
from harness import run_world
from compile_check import compiled_graph_calls
from tp_model import batch, dp_tp_mesh, loss_fn
from test_tensor_parallel import tp_model, reference, _optimizer, train_steps
import test_bucket_mesh as tbm


def tp_inductor():
    torch._dynamo.reset()
    mesh = dp_tp_mesh()
    model = tp_model(mesh, "shard0", True)
    fs.compile(model, fullgraph=True)
    calls = []
    losses = train_steps(model, mesh.get_local_rank(0), _optimizer(model, True), 3,
                         on_loss=lambda l: calls.append(compiled_graph_calls(l)))
    return losses, calls, fs.full_state_dict(model)


def test_tp_inductor():
    ref_losses, ref_params = reference(steps=3, sgd=True)
    losses, calls, full = run_world(4, tp_inductor, timeout=900)[0]
    print("tp", losses, ref_losses, calls)
    worst = max(((full[k] - v).abs().max() / v.abs().max()).item() for k, v in ref_params.items())
    print("tp worst param rel", worst)
