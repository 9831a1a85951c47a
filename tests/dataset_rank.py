"""One training rank for the dataset tests: reads a job with JobDataset through a DataLoader with
two workers and writes one JSON line per sample as it arrives (run as a subprocess)."""
from __future__ import annotations

import json
import sys
import time

from torch.utils.data import DataLoader

from dflash_tasks.training.data.gate import Rules
from dflash_tasks.training.torch_dataset import JobDataset


def main(job: str, source: str, rank: int, world: int, out: str) -> None:
    ds = JobDataset(job, source, rules=Rules(min_loss_tokens=0, max_length=10**9, keep_truncated=True),
                    follow=True, poll_s=0.3, follow_timeout_s=120, rank=rank, world_size=world)
    with open(out, "w") as f:
        for sample in DataLoader(ds, batch_size=None, num_workers=2):
            ids, mask = sample["input_ids"], sample["loss_mask"]
            assert ids.shape == mask.shape == sample["attention_mask"].shape
            f.write(json.dumps({"id": sample["id"], "len": len(ids), "loss": int(mask.sum()),
                                "first_loss_at": int(mask.argmax()), "t": time.time()}) + "\n")
            f.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
