"""`chainspec train-mtp --workers N`: the run on N Ray Train workers (`TorchTrainer`).

Each worker runs `train_mtp.train_rank` as one rank of a torch.distributed group (gloo on
CPU, NCCL with one GPU per worker): it loads the frozen target itself, draws its share of
every global batch and trains the MTP modules under DDP (`data_parallel.py`). Rank 0
writes the checkpoints, the output folder and the model card, and hands its report back
through a Ray Train checkpoint. Ray is the cluster at `settings.address`, else the Ray
this process already joined, else a local one started (and stopped) here.

NOTE: on a multi-node cluster every path (target, data, out) must be the same shared
file system on all nodes, and chainspec must be installed on them.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from chainspec.training import mtp_export, resume
from chainspec.training.train_mtp import MTPJob, MTPReport, train_rank

REPORT_FILE = "report.pkl"


def absolute(job: MTPJob) -> MTPJob:
    """Ray Train runs workers in their own directory: relative paths would not resolve."""
    data = job.data if job.data == "stdlib" else str(Path(job.data).resolve())
    return replace(job, target=job.target.resolve(), data=data, out=job.out.resolve())


def train_on_ray(job: MTPJob) -> MTPReport:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    job = absolute(job)
    mtp_export.check_target(job.target, job.out)  # refuse before any worker starts
    gpu = job.settings.device.startswith("cuda")
    owned = _connect(job.settings.address)
    storage = resume.checkpoint_dir(job.out) / "ray-train"
    try:
        trainer = TorchTrainer(
            _worker, train_loop_config={"job": job},
            scaling_config=ScalingConfig(num_workers=job.recipe.workers, use_gpu=gpu),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            run_config=RunConfig(name="train-mtp", storage_path=str(storage)))
        result = trainer.fit()
        if result.checkpoint is None:
            raise RuntimeError("Ray Train finished without rank 0's report")
        with result.checkpoint.as_directory() as folder:
            return pickle.loads((Path(folder) / REPORT_FILE).read_bytes())
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if owned:
            ray.shutdown()


def _connect(address: str | None) -> bool:
    """Join or start Ray; True when this call started it (and so must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.ERROR)
    return True


def _worker(config: dict) -> None:
    """One Ray Train worker: one rank of the run."""
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    job: MTPJob = config["job"]
    if job.settings.device.startswith("cuda"):
        device = str(ray.train.torch.get_device())  # this worker's GPU
        job = replace(job, settings=replace(job.settings, device=device))
    torch.set_num_threads(job.settings.threads)
    report = train_rank(job, ray.train.get_context().get_world_rank())
    if report is None:
        ray.train.report({})  # NOTE: a collective: every rank must call it
        return
    with tempfile.TemporaryDirectory(prefix="chainspec-report-") as folder:
        (Path(folder) / REPORT_FILE).write_bytes(pickle.dumps(report))
        ray.train.report({"steps": job.recipe.schedule.steps},
                         checkpoint=Checkpoint.from_directory(folder))
