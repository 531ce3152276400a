"""The SLURM preset (src/tcal/conf/hydra/launcher/slurm_gpu.yaml) as submitit renders it: one rank's bad exit ends the job,
a timed-out or preempted job is requeued, and memory, CPUs and GPUs are those `tcal-plan --slurm-env` exports."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from tcal.tools.plan import main as plan_main


def launcher_config(monkeypatch, **env):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tcal.cli.app import CONF_DIR

    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm_gpu"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    launcher = cfg.hydra.launcher
    return OmegaConf.to_container(OmegaConf.create({k: launcher[k] for k in launcher if k != "submitit_folder"}),
                                  resolve=True)


def test_sbatch_kills_on_bad_exit_requeues_and_takes_the_plans_host_figure(monkeypatch, tmp_path, capsys):
    from submitit.slurm.slurm import _make_sbatch_string  # what SlurmExecutor writes (it needs srun to exist)

    plan_main(["teacher=tiny_llama", "stage=distill", "trainer=ddp", "trainer.devices=4", "trainer.accelerator=cpu",
               "--slurm-env"])
    exported = dict(part.split("=") for part in capsys.readouterr().out.split()[1:])
    plan_main(["teacher=tiny_llama", "stage=distill", "trainer=ddp", "trainer.devices=4", "trainer.accelerator=cpu",
               "--json"])
    host = json.loads(capsys.readouterr().out)["host"]
    assert exported == {"TCAL_SLURM_MEM_GB": str(host["slurm_mem_gb"]), "TCAL_CPUS_PER_TASK": str(host["cpus_per_task"]),
                        "TCAL_GPUS_PER_NODE": "4"}

    launcher = launcher_config(monkeypatch, **exported)
    assert launcher["max_num_timeout"] >= 1  # requeues after a timeout or a preemption
    sbatch = _make_sbatch_string("python -m tcal.cli.app", tmp_path, setup=launcher["setup"], mem=f"{launcher['mem_gb']}GB",
                                 cpus_per_task=launcher["cpus_per_task"], ntasks_per_node=launcher["tasks_per_node"],
                                 gpus_per_node=launcher["gpus_per_node"], nodes=launcher["nodes"],
                                 signal_delay_s=launcher["signal_delay_s"]).splitlines()
    assert f"#SBATCH --mem={host['slurm_mem_gb']}GB" in sbatch
    assert f"#SBATCH --cpus-per-task={host['cpus_per_task']}" in sbatch
    assert "#SBATCH --ntasks-per-node=4" in sbatch and "#SBATCH --gpus-per-node=4" in sbatch
    srun = next(i for i, line in enumerate(sbatch) if line.startswith("srun"))
    assert "export SLURM_KILL_BAD_EXIT=1" in sbatch[:srun]  # srun reads it as --kill-on-bad-exit
    assert any("--signal=USR2" in line for line in sbatch)  # submitit's requeue signal before the time limit
