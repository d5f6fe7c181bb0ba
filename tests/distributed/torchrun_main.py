"""Entry point of the torchrun tests: ``torchrun ... tests/distributed/torchrun_main.py AXES PER [NAMES]``.

No explicit ``initialize``: ``Mesh.create`` joins the run from torchrun's environment (``GROUP_RANK``
gives each simulated host). Rank 0 prints ``ok <layout>`` when every check passed.
"""

from __future__ import annotations

import os
import sys

from workers import held_worker

if __name__ == "__main__":
    axes = dict((a.split("=")[0], int(a.split("=")[1])) for a in sys.argv[1].split(","))
    per = int(sys.argv[2])
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    held_worker(rank, world, "auto", axes, per, False, names=names)
    if rank == 0:
        print(f"ok {world} processes, nodes {os.environ.get('GROUP_WORLD_SIZE')}, mesh {axes} cpu:{per}", flush=True)
