"""Launching the trainer under torchrun for a scenario: the built-in trainer, or the user's own
script (``trainer.command``) with the environment variables of the probe contract."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from antifragile.chaos.infra.lifetime import die_with_parent
from antifragile.chaos.infra.netns import IFNAME, Network
from antifragile.chaos.scenario import CommandSpec, Scenario, is_python
from antifragile.chaos.scenario.trainer import CHAOS_ENV, CKPT_URL_ENV, RUN_DIR_ENV


def command_args(spec: CommandSpec) -> list[str]:
    """One rank's argv for ``torchrun --no-python``: ``python`` is this interpreter; a
    ``.py`` script given first runs under it too."""
    argv = list(spec.command)
    if is_python(argv[0]):
        argv[0] = sys.executable
    elif argv[0].endswith(".py"):
        argv.insert(0, sys.executable)
    return argv


def command_env(spec: CommandSpec, run_dir: Path, ckpt_url: str) -> dict[str, str]:
    """The script's environment beyond chaos's own: the scenario's ``env``, then the contract.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless the scenario's ``env`` says otherwise):
    a fresh c10d store for every torchrun attempt. With the agent's shared store, a plain
    ``init_process_group("gloo")`` after an in-place restart reads the previous attempt's keys
    and fails ("Gloo connectFullMesh failed ... Connection refused"); our trainer works around
    it with a store prefix per attempt, a user's script should not have to.

    The run folder and a local checkpoint URL are given absolute (chaos's own are relative to
    its working directory, ``reports/...``): a script that changes its working directory (to
    its own folder, as Hydra does) would write its events and checkpoints elsewhere."""
    url = ckpt_url if "://" in ckpt_url else os.path.abspath(ckpt_url)
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **spec.env,
            RUN_DIR_ENV: os.path.abspath(run_dir), CKPT_URL_ENV: url, CHAOS_ENV: "1"}


def trainer_args(s: Scenario, run_dir: Path, ckpt_url: str) -> list[str]:
    t, c = s.trainer, s.checkpoint
    args = ["--dp", t.parallel.dp, "--tp", t.parallel.tp, "--pp", t.parallel.pp,
            "--steps", t.steps, "--seed", s.seed, "--layers", t.model.layers,
            "--d-model", t.model.d_model, "--heads", t.model.heads, "--vocab", t.model.vocab,
            "--seq-len", t.model.seq_len, "--batch-size", t.batch_size,
            "--micro-batches", t.micro_batches, "--schedule", t.schedule,
            "--collective-timeout-s", t.collective_timeout_s, "--recovery", t.recovery,
            "--ckpt-url", ckpt_url,
            "--ckpt-engine", c.engine,
            "--ckpt-every", c.every_steps, "--keep-last", c.keep_last, "--run-dir", run_dir]
    if t.hang_timeout_s is not None:
        args += ["--hang-timeout-s", t.hang_timeout_s]
    if t.lease_s is not None:
        args += ["--lease-s", t.lease_s]
    if not c.async_:
        args.append("--no-async-ckpt")
    return [str(a) for a in args]


def launch(s: Scenario, run_dir: Path, ckpt_url: str, *, max_restarts: int,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start torchrun (one agent; CPU + gloo) with in-place restarts. ``env`` is added to the
    environment of torchrun and so of every rank (e.g. the S3 endpoint to use), over a
    command trainer's ``env``. A command trainer's environment is what README's "What chaos
    gives the script" lists."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={s.trainer.world_size + s.trainer.spare_workers}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
           # Grace before SIGKILL when the agent itself shuts down (restarts in torch 2.13
           # always give 30 s; the workers are supervisors that act on SIGTERM at once).
           "--shutdown-timeout=3", _log_dir(run_dir)]
    own = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if isinstance(s.trainer, CommandSpec):  # the user's script, as its ranks
        # its warnings (the engine's skipped saves, quarantined steps) stay in its log
        cmd += ["--no-python", *command_args(s.trainer)]
        # the run's own (the S3 endpoint chaos checks and faults: its proxy, a relay) over the
        # scenario's env: an endpoint named there took the ranks around the fault proxy
        env = {**command_env(s.trainer, run_dir, ckpt_url), **(env or {})}
    else:
        own["PYTHONWARNINGS"] = "ignore"
        cmd += ["-m", "antifragile.trainer", *trainer_args(s, run_dir, ckpt_url)]
    env = {**_inherited(), **own, **(env or {})}
    log = open(run_dir / "torchrun.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_ends_with_chaos())


def _inherited() -> dict[str, str]:
    """This process's environment less torchrun's options: torchrun reads each option its
    command line does not give from ``PET_<OPTION>``, so one in the caller's shell changed the
    launch chaos means (``PET_NNODES=2``, as a Kubeflow PyTorchJob pod has it, made the
    one-host job wait for a second host until the run's time limit)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PET_")}


def _log_dir(run_dir: Path) -> str:
    """torchrun's folder for its workers' error files, in the run's folder: by default it
    makes a ``torchelastic_*`` folder in the temporary folder and never deletes it."""
    return f"--log-dir={run_dir / 'torchelastic'}"


def _ends_with_chaos() -> Callable[[], None] | None:
    """torchrun is sent SIGTERM if chaos dies without stopping it (SIGKILL): it then stops its
    workers, the supervisors, which act on SIGTERM at once (``lifetime``)."""
    return die_with_parent(os.getpid(), signal.SIGTERM)


RDZV_PORT = 29400  # inside host 0's own namespace, so never taken by anything else


def launch_hosts(s: Scenario, run_dir: Path, ckpt_url: str, *, max_restarts: int,
                 network: Network, env: dict[str, str] | None = None
                 ) -> list[subprocess.Popen[str]]:
    """Start one torchrun agent per emulated host, inside its namespace, joined by a c10d
    rendezvous on host 0. Logs: ``torchrun.log`` (host 0), ``torchrun-host<i>.log``.

    gloo and the stores use the emulated network (``GLOO_SOCKET_IFNAME``, ``--local-addr``);
    ``trainer/distributed.py`` explains the two ``TORCH*``/``ANTIFRAGILE_*`` variables. The
    rendezvous tolerates a cut link for a while: its store reads wait ``read_timeout`` and an
    agent counts as dead only after ``keep_alive_max_attempt`` missed 5 s keep-alives.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes = len(network.hosts)
    endpoint = f"{network.hosts[0].address}:{RDZV_PORT}"
    procs = []
    for host in network.hosts:
        conf = (f"is_host={int(host.index == 0)},read_timeout=120,join_timeout=180,"
                "keep_alive_max_attempt=24")
        cmd = host.command([
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
            f"--nproc-per-node={(s.trainer.world_size + s.trainer.spare_workers) // nodes}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={s.name}",
            f"--rdzv-conf={conf}", f"--local-addr={host.address}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
            "--shutdown-timeout=3", _log_dir(run_dir),
            "-m", "antifragile.trainer", *trainer_args(s, run_dir, ckpt_url)])
        host_env = {**_inherited(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                    "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": IFNAME,
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                    "ANTIFRAGILE_ATTEMPT_STORE": endpoint, **(env or {})}
        name = "torchrun.log" if host.index == 0 else f"torchrun-host{host.index}.log"
        log = open(run_dir / name, "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, env=host_env, stdout=log, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True,
                                      preexec_fn=_ends_with_chaos()))
    return procs
