"""FSDP's row shards gather through one blocking all-gather (`packing._gather_rows`): rows
that do not split evenly over the ranks, a rank with none, and a column shard (DTensor's own
gather) all come back whole on every rank."""

import torch
import torch.distributed as dist

from torchtitan_rl.weight_sync import packing
from torchtitan_rl.weight_sync.packing import (
    PackedWeights,
    gather_into,
    make_layout,
    unpack_weights,
)


def _uneven_rows_worker(rank, port, queue):
    """Row-sharded DTensors whose rows do not split evenly (5 rows: 3 + 2; 1 row: 1 + 0)
    and a column-sharded one (DTensor's own gather): every rank gets the full tensor."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        full = {"w": torch.randn(5, 3), "one": torch.randn(1, 4), "cols": torch.randn(2, 5)}
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "one": distribute_tensor(full["one"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        }
        rows = [n for n, t in state.items() if packing._row_sharded(t)]
        layout, numel = make_layout(state)
        flat_P = torch.full((numel,), float("nan"), dtype=torch.float64)
        gather_into(state, flat_P)
        back = unpack_weights(PackedWeights(version=0, flat_P=flat_P, layout=layout))
        same = [n for n, t in full.items() if torch.equal(back[n], t.double())]
        dist.destroy_process_group()
        queue.put((rank, (rows, same)))
    except Exception:
        import traceback

        queue.put((rank, traceback.format_exc()))


def test_uneven_row_shards_gather_into_the_full_tensors_on_every_rank():
    from fakes import run_two_ranks

    results = run_two_ranks(_uneven_rows_worker, timeout=120)
    for rank in (0, 1):
        assert results[rank] == (["w", "one"], ["w", "one", "cols"]), rank
