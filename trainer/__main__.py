"""``torchrun --nproc-per-node N -m antifragile.trainer --dp D --tp T --pp P ...`` (see --help).

Under torchrun every worker is a supervisor (``trainer.supervisor``) that forks the training
process once torch is imported, and watches it.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# cuBLAS is deterministic only with a fixed workspace (torch's reproducibility notes); without
# it, deterministic algorithms on CUDA only warn (warn_only) and the bitwise claim is gone
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def main() -> int:
    from antifragile.trainer.config import parse_args

    cfg = parse_args()
    import torch  # before the fork: the training process starts with it loaded

    from antifragile.engine import StorageError
    from antifragile.trainer.progress import SharedProgress
    from antifragile.trainer.supervisor import USAGE_EXIT_CODE, supervise
    from antifragile.trainer.train import LaunchError, run

    def train(progress: SharedProgress, incarnation: int) -> int:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if cfg.device == "cpu":
            torch.set_num_threads(1)
        try:
            return run(cfg, progress, incarnation)
        except LaunchError as exc:
            print(f"antifragile.trainer: error: {exc}", file=sys.stderr, flush=True)
            return USAGE_EXIT_CODE
        except StorageError as exc:  # down, or failing past its retries (at a restore): one
            # line, not a traceback, and exit 1, which a restart retries (the storage may be
            # back by then); a missing bucket or refused credentials exit 2 before this
            print(f"antifragile.trainer: error: --ckpt-url {cfg.ckpt_url}: {exc}; exiting with "
                  "code 1, a restart retries", file=sys.stderr, flush=True)
            return 1

    if "RANK" not in os.environ:  # not under torchrun: one process, nobody to supervise it
        return train(SharedProgress(), 0)

    from antifragile.trainer.distributed import attempt_store, launch_info, serve_store

    try:  # here, once: not in every forked training process, nor in a supervisor's thread
        attempt_store()
    except LaunchError as exc:
        print(f"antifragile.trainer: error: {exc}", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE

    def store() -> object:
        return launch_info(collective_timeout_s=cfg.collective_timeout_s).job_store()

    slots = int(os.environ["WORLD_SIZE"])  # torchrun's workers: trainer ranks + spares
    # served for as long as this process lives (it ends with os._exit below)
    _served = serve_store(recovery=cfg.recovery, collective_timeout_s=cfg.collective_timeout_s)
    code = supervise(train, slot=int(os.environ["RANK"]), recovery=cfg.recovery,
                     hang_timeout_s=cfg.hang_timeout_s, run_dir=cfg.run_dir,
                     store_factory=store, reform_timeout_s=cfg.collective_timeout_s * 2,
                     spares=slots - cfg.parallel.world_size, slots=slots,
                     lease_s=cfg.lease_s)
    # The supervisor holds no state worth a clean interpreter teardown, which takes seconds
    # with torch loaded (15 s on a busy 2-core machine): the launcher waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside torchrun: no supervisor to answer Ctrl-C (it exits 130)
        print("antifragile.trainer: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
