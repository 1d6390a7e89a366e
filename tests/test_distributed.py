"""DDP, FSDP2 (eager and compiled) and group-parallel GroupedLinear in several processes: gloo on the
CPU with 2 and 4 processes, and NCCL with 2 GPUs where the machine has them. Each world runs once
(distributed_worker.py, in a subprocess) and every scenario is its own test here."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this PyTorch build has no torch.distributed")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from distributed_worker import SCENARIOS  # noqa: E402

WORLDS = [("gloo", 2), ("gloo", 4)]
if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
    WORLDS.append(("nccl", 2))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w[0]}-{w[1]}")
def world_results(request, tmp_path_factory):
    backend, world = request.param
    out = tmp_path_factory.mktemp(f"{backend}{world}")
    run = subprocess.run([sys.executable, os.path.join(HERE, "distributed_worker.py"), str(world), backend, str(out)],
                         capture_output=True, text=True, timeout=900)
    results = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results (exit {run.returncode}):\n{run.stderr[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_distributed(world_results, scenario):
    missing = "not run (the world ended first)"
    failures = [f"rank {rank}:\n{r.get(scenario, missing)}" for rank, r in enumerate(world_results)
                if r.get(scenario, missing) != "ok"]
    assert not failures, "\n".join(failures)


def test_distributed_bench_smoke_renders_as_a_results_section(tmp_path):
    """`torchrun bench/distributed.py --smoke --json` runs every form in 2 gloo processes, and
    bench/results.py renders the saved run as a section of RESULTS.md."""
    import socket

    with socket.socket() as s:  # a free port: other worlds may be running beside this one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bench = os.path.join(HERE, "..", "bench")
    saved = tmp_path / "cpu-x2-distributed.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), os.path.join(bench, "distributed.py"), "--smoke", "--json", str(saved)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert saved.exists(), f"exit {run.returncode}:\n{run.stderr[-4000:]}"
    rows = json.loads(saved.read_text())["rows"]
    forms = ["1 GPU", "DDP", "groups, batch-sharded in", "groups, replicated in", "groups, groups-sharded in"]
    assert [r["form"] for r in rows] == forms * 2 and all(r["ms"] > 0 for r in rows)
    sys.path.insert(0, bench)
    import results

    out = tmp_path / "RESULTS.md"
    assert results.main([str(saved), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Several GPUs, group-parallel GroupedLinear (2 ranks, gloo)" in text
    assert "groups, groups-sharded in" in text and "torchrun --nproc-per-node 2" in text
