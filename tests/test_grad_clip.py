"""`grad_clip.clip_grad_norm` on 2 FSDP ranks: the norm and the clipped gradients match a
float64 reference of the unsharded model, a NaN on one rank makes every rank's norm NaN,
and no functional collective waits (torch's own
clip_grad_norm_ on the same gradients does, the control)."""

import torch
import torch.distributed as dist

from torchtitan_rl.training.grad_clip import clip_grad_norm


class _Net(torch.nn.Module):
    """Rows that do not split evenly over 2 ranks (7, 5, 3 and 1 rows)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(3, 4)
        self.lin = torch.nn.Linear(4, 7)
        self.out = torch.nn.Linear(7, 5)
        self.tiny = torch.nn.Parameter(torch.randn(1, 5))

    def forward(self, ids):
        return (self.out(torch.tanh(self.lin(self.emb(ids)))) * self.tiny).square().mean()


IDS = torch.tensor([[0, 2, 1, 2], [1, 1, 0, 2]])


def _grads(net):
    return {n: p.grad for n, p in net.named_parameters()}


def _reference(max_norm):
    """float64, one process: torch's clip_grad_norm_ on the unsharded model."""
    torch.manual_seed(0)
    net = _Net().double()
    net(IDS).backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    return float(norm), _grads(net)


def _worker(rank, port, queue):
    try:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        waits = []
        wait_tensor = funcol.wait_tensor
        funcol.wait_tensor = lambda t: waits.append(1) or wait_tensor(t)
        out = {}
        for name, max_norm in (("clipped", 0.05), ("unclipped", 1e9), ("torch", 0.05)):
            torch.manual_seed(0)
            net = fully_shard(_Net(), mesh=mesh)
            net(IDS).backward()
            before = len(waits)
            if name == "torch":
                norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).full_tensor()
            else:
                norm = clip_grad_norm(net.parameters(), max_norm)
            waited = len(waits) - before
            # numpy: the queue copies it by value
            grads = {n: g.full_tensor().double().numpy() for n, g in _grads(net).items()}
            out[name] = (float(norm), grads, waited)
        torch.manual_seed(0)
        net = fully_shard(_Net(), mesh=mesh)
        net(IDS).backward()
        if rank == 1:  # a NaN in one rank's shard: every rank's norm is NaN, so all skip
            net.lin.weight.grad.to_local()[0, 0] = float("nan")
        out["nan"] = float(clip_grad_norm(net.parameters(), 0.05))
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:
        import traceback

        queue.put((rank, traceback.format_exc()))


def test_sharded_clip_matches_float64_reference_without_functional_collectives():
    from fakes import run_two_ranks

    results = run_two_ranks(_worker, timeout=120)
    for rank in (0, 1):
        out = results[rank]
        assert isinstance(out, dict), out
        for name, max_norm in (("clipped", 0.05), ("unclipped", 1e9)):
            ref_norm, ref_grads = _reference(max_norm)
            norm, grads, waited = out[name]
            assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (name, norm, ref_norm)
            for n, g in grads.items():
                torch.testing.assert_close(torch.from_numpy(g), ref_grads[n], rtol=1e-5, atol=1e-7)
            assert waited == 0, (name, waited)
        assert ref_norm > 0.05 * 1.5  # the clipped case really clips
        assert out["torch"][2] >= 1  # control: the counter sees torch's functional wait
        assert abs(out["torch"][0] - out["clipped"][0]) <= 1e-6 * out["torch"][0]
        assert out["nan"] != out["nan"], out["nan"]
