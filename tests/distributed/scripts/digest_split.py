"""torchrun script: at a resume on 2 ranks, each file of a directory of shards is hashed
by one rank, and a damaged file hashed by rank 1 is the same named error on both ranks,
for tests/distributed/test_background_failure_processes.py.

Usage: torchrun --nproc_per_node=2 digest_split.py OUT_DIR

1. a sharded run (FSDP, gloo) writes its directories (``run`` of integrity.py);
2. a relaunch resumes from the newest (``resume=True``) while every digest is recorded;
3. ``hookloop.load_checkpoint`` of the newest on both ranks into an unsharded model (every
   digest recorded again);
4. a bit of a file that rank 1 hashes is flipped, and a relaunch resumes again, and
   ``load_checkpoint`` reads it on both ranks.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist
from common import out_dir, rank, save
from fsdp import gathered, make_model
from integrity import run

import hookloop
from hookloop import CheckpointError
from hookloop.runfile import integrity as checks


def main() -> None:
    dist.init_process_group("gloo")
    out = out_dir()
    directory = out / "ckpt"
    run(directory)  # 2 epochs, a directory every 2 steps
    hashed: list[str] = []
    real = checks._digest_or_none

    def recording(path: str, *args: str) -> str | None:
        hashed.append(os.path.relpath(path, directory))
        return real(path, *args)

    checks._digest_or_none = recording  # type: ignore[assignment]
    resumed = run(directory)  # resumes from the newest: the run is over, nothing trains
    weights = gathered(resumed.unwrapped_model)
    newest = sorted(name for name in os.listdir(directory) if name.endswith(".dcp"))[-1]
    save("hashed", {"files": hashed, "newest": newest})
    if rank() == 0:
        save("weights", weights)
    hashed.clear()
    loaded = make_model(seed=11)  # unsharded: the shards are read whole on each rank
    hookloop.load_checkpoint(directory / newest, loaded)
    save("load_hashed", {"files": hashed})
    save("loaded", {name: value.detach().clone() for name, value in
                    loaded.state_dict().items()})
    dist.barrier()
    turns = sorted(name for name in os.listdir(directory / newest) if name != "hookloop.pt")
    damaged = turns[1]  # the second file in name order: rank 1's turn
    if rank() == 0:
        shutil.copytree(directory, out / "damaged")
        path = out / "damaged" / newest / damaged
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    dist.barrier()
    hashed.clear()
    try:
        run(out / "damaged")
        found = None
    except CheckpointError as error:
        found = str(error)
    save("damaged", {"error": found, "file": f"{newest}/{damaged}", "hashed": hashed})
    try:
        hookloop.load_checkpoint(out / "damaged" / newest, make_model(seed=11))
        found = None
    except CheckpointError as error:
        found = str(error)
    save("load_damaged", {"error": found})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
