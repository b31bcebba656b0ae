# A stock PyTorch script, unchanged from what torchrun runs: env:// init, Gloo all-reduce.
# With --fail-first-attempt, rank 1 exits 1 in restart round 0 after the collective, so the restarted
# round must form a fresh process group on the same launcher store.
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"python rank {rank}/{world} attempt {attempt}: sum={t.item():.0f} expected={expected:.0f}", flush=True)
ok = t.item() == expected
if "--fail-first-attempt" in sys.argv and attempt == "0" and rank == 1:
    sys.exit(1)
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 2)
