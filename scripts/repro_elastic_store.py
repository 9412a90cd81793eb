"""The torch behaviour stabilize/elastic.py works round, without the harness: a group that
torchrun restarts is handed the agent's store again, and its gloo process group never forms.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        scripts/repro_elastic_store.py            # torch 2.13: attempt 1 waits forever
    STORE_FIX=1 python -m torch.distributed.run ... scripts/repro_elastic_store.py  # passes

Rank 1 SIGKILLs itself in attempt 0; each rank prints its attempt, and "done" at the end.
"""

import os
import time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt > 0 and os.environ.get("STORE_FIX"):  # a store of the attempt's own
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + attempt)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
print("attempt", attempt, "rank", rank, flush=True)
for i in range(5):
    x = torch.ones(1)
    dist.all_reduce(x)
    if attempt == 0 and rank == 1 and i == 2:
        os.kill(os.getpid(), 9)
    time.sleep(0.2)
print("done", rank, flush=True)
