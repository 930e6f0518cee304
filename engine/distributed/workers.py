"""Worker ranks 1..N-1 of a tensor-parallel engine, and rank 0's handle on them.

Rank 0 is the engine itself. Each worker process joins the group, builds its shard of the model exactly
as rank 0 does (engine.runner_setup.build_runner), then runs one forward per step received on the step
channel; rank 0 samples. A worker exits when rank 0 says stop, when a collective fails (a peer died, or
the timeout passed) and when its parent process disappears, so no rank is left behind holding a device.
On other nodes, `pagedserve serve --node-rank K` starts that node's ranks (run_node).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.distributed import parallel_state as ps
from engine.distributed.step_channel import StepChannel

log = logging.getLogger(__name__)
_PARENT_POLL_S = 0.5
_STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class Topology:
    how: ps.DistInit
    ranks_per_node: int
    node_rank: int


def topology(cfg: EngineConfig) -> Topology:
    """Where the ranks meet (flags, else MASTER_ADDR / MASTER_PORT, else this host and a free port)."""
    tp, nnodes = cfg.tensor_parallel_size, cfg.nnodes
    addr = cfg.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = cfg.master_port or int(os.environ.get("MASTER_PORT", "0"))
    if not port:
        if nnodes > 1:
            raise ValueError("multi-node tensor parallelism needs --master-port (or MASTER_PORT) on every node.")
        port = _free_port(addr)
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    return Topology(ps.DistInit(tp, addr, port, backend), tp // nnodes, cfg.node_rank)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_device(cfg: EngineConfig, rank: int, ranks_per_node: int) -> torch.device:
    if not cfg.device.startswith("cuda"):
        return torch.device("cpu")
    local = rank % ranks_per_node
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class WorkerGroup:
    """Rank 0's view: this node's worker processes, the step channel, and their liveness."""

    def __init__(self, processes: list, top: Topology) -> None:
        self.processes, self.top = processes, top
        self.channel: StepChannel | None = None

    @classmethod
    def start(cls, plan) -> WorkerGroup:
        """Starts ranks 1..ranks_per_node-1 and joins the group as rank 0 (plan: engine.runner_setup.ModelPlan)."""
        top = topology(plan.config)
        procs = _spawn(plan, top, range(1, top.ranks_per_node))
        group = cls(procs, top)
        try:
            rank_device(plan.config, 0, top.ranks_per_node)
            ps.init(0, top.how)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        group.channel = StepChannel()
        log.info("tensor parallelism: %d ranks (%s, %d per node) at %s:%d; worker pids %s", top.how.world_size,
                 top.how.backend, top.ranks_per_node, top.how.master_addr, top.how.master_port,
                 ",".join(str(p.pid) for p in procs))
        return group

    def dead(self) -> str | None:
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def check(self) -> None:
        reason = self.dead()
        if reason is not None:
            raise RuntimeError(reason)

    def shutdown(self, graceful: bool = True) -> None:
        """Tells the workers to stop (when they all live and wait for a step), then makes sure they are gone.
        graceful=False (a failed startup: the workers may be inside a collective, not reading the channel)
        kills them at once."""
        if not graceful:
            for p in self.processes:
                p.kill()
        elif self.channel is not None and self.dead() is None:
            try:
                self.channel.send_stop()
            except Exception:   # a peer already gone: the processes are reaped below
                log.warning("tensor parallelism: could not send stop to the workers")
        deadline = time.monotonic() + _STOP_WAIT_S
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
        ps.destroy()


def _spawn(plan, top: Topology, ranks: range) -> list:
    spawn = multiprocessing.get_context("spawn")   # fresh interpreters: no inherited threads or CUDA state
    procs = []
    for rank in ranks:
        # daemon: an engine left running at interpreter exit (no LLM.shutdown()) terminates its workers
        # instead of joining them forever
        p = spawn.Process(target=run_worker, name=f"pagedserve-tp{rank}", daemon=True,
                          args=(plan, rank, top, os.getpid(), logging.getLogger().level))
        p.start()
        procs.append(p)
    return procs


def run_node(config: EngineConfig) -> int:
    """A node other than node 0: runs its ranks until they end; exit status 0 only if all ended cleanly."""
    from engine.runner_setup import plan_model
    plan = plan_model(config)
    top = topology(plan.config)
    first = top.node_rank * top.ranks_per_node
    procs = _spawn(plan, top, range(first, first + top.ranks_per_node))
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)   # the engine is gone: nobody will ever send the next step
    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


def run_worker(plan, rank: int, top: Topology, parent_pid: int, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C and SIGTERM are the server's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    _watch_parent(parent_pid)
    from engine.lora.request import LoRARequest
    from engine.runner_setup import build_runner
    try:
        device = rank_device(plan.config, rank, top.ranks_per_node)
        torch.manual_seed(plan.config.seed)
        ps.init(rank, top.how)
        built = build_runner(plan, device)
        runner, lora = built.runner, built.lora
        channel = StepChannel()
        with torch.inference_mode():
            while (msg := channel.recv()) is not None:
                if isinstance(msg[1], LoRARequest):
                    lora.write_slot(*msg)
                    continue
                packed, copies = msg
                runner.copy_blocks(copies)
                runner.forward(runner.unpack(packed))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    ps.destroy()
