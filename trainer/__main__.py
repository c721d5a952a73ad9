"""``torchrun --nproc-per-node N -m antifragile.trainer --dp D --tp T --pp P ...`` (see --help)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> int:
    import torch

    from antifragile.trainer.config import parse_args
    from antifragile.trainer.train import run

    cfg = parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.device == "cpu":
        torch.set_num_threads(1)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
