"""Startup of `pagedserve serve`: seconds from launch to the first 200 from /health, the CPU seconds its
processes spent getting there, and memory after load.

    python benchmarks/startup.py                      # the default model (SmolLM2-135M-Instruct), CPU
    python benchmarks/startup.py --runs 5 -- --model tiny-random --dtype bfloat16
    python benchmarks/startup.py --phases             # in-process: CPU seconds of each step of loading

Each run starts a fresh server process (arguments after `--` are passed to `pagedserve serve`), polls
/health every 20 ms, then reads the resident memory (VmRSS) and CPU time (user + system) of the server and
of every process it started (the engine process) from /proc, and stops it with SIGTERM. Prints each run and
the median. On a shared machine the wall time grows with the load; the CPU time does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.server_proc import ServerProcess  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime + stime


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(p) for p in children.read_text().split()] if children.exists() else []
    return kids + [d for k in kids for d in descendants(k)]


def one_run(serve_args: list[str]) -> tuple[float, dict[int, tuple[int, float]]]:
    start = time.monotonic()
    server = ServerProcess("--device", "cpu", *serve_args)
    try:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        ready = time.monotonic() - start
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        return ready, {pid: (rss_bytes(pid), cpu_seconds(pid)) for pid in pids}
    finally:
        server.stop()


def load_phases() -> None:
    """Loads the default model in this process step by step, printing wall and CPU seconds of each step."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    last = [time.monotonic(), cpu()]

    def mark(step: str) -> None:
        now, used = time.monotonic(), cpu()
        print(f"{step:<34} wall {now - last[0]:6.2f} s   CPU {used - last[1]:6.2f} s", flush=True)
        last[:] = [now, used]

    import torch
    mark("import torch")
    import transformers  # noqa: F401
    mark("import transformers")
    from engine import gguf_loader, loader
    from engine.default_model import default_model_file
    from engine.models.config import ModelConfig
    mark("import engine")
    path = default_model_file()
    file = gguf_loader.open_gguf(path)
    cfg = ModelConfig.from_hf(gguf_loader.hf_config(file))
    mark("read GGUF header and config")
    model = loader._empty_model(cfg, torch.float32, torch.device("cpu"), cfg.max_position_embeddings)
    mark("allocate the model (float32)")
    tensors = list(gguf_loader.named_tensors(file, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers))
    mark("dequantize every tensor")
    loader.load_tensors(model, tensors)
    mark("copy into the model (fusing q/k/v)")
    gguf_loader.load_tokenizer(path)
    mark("tokenizer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="profile the steps of loading, in-process")
    parser.add_argument("serve_args", nargs="*", help="arguments for `pagedserve serve` (after --)")
    args = parser.parse_args()
    if args.phases:
        load_phases()
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    times, totals, cpus = [], [], []
    for i in range(args.runs):
        ready, procs = one_run(args.serve_args)
        times.append(ready)
        totals.append(sum(rss for rss, _ in procs.values()))
        cpus.append(sum(cpu for _, cpu in procs.values()))
        parts = ", ".join(f"pid {pid}: {rss / 2**20:.0f} MiB, {cpu:.1f} s CPU" for pid, (rss, cpu) in procs.items())
        print(f"run {i + 1}: ready in {ready:.2f} s; {cpus[-1]:.1f} s CPU; RSS {totals[-1] / 2**20:.0f} MiB ({parts})")
    print(f"median: ready in {statistics.median(times):.2f} s, {statistics.median(cpus):.1f} s CPU, "
          f"RSS {statistics.median(totals) / 2**20:.0f} MiB; load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
