"""`make_plan` (the plan of one run's settings) and `main`, the `tcal-plan` console script."""

from __future__ import annotations

import argparse
import json

from tcal.arguments import number
from tcal.errors import ConfigError
from tcal.tools.plan import memory
from tcal.tools.plan.cost import hours_plan
from tcal.tools.plan.output import format_plan, markdown_table, moments_markdown, slurm_env
from tcal.tools.plan.staging import HOST_CPUS_PER_RANK, host_plan

DEFAULT_HEADROOM_GB = 8.0  # per device, for what the plan does not count (make_plan)


def make_plan(settings, device_gb: float = 80.0, headroom_gb: float = DEFAULT_HEADROOM_GB) -> dict:
    """The plan of a run's settings (see the package docstring) as one JSON-ready object. A stage fits when
    its peak plus `headroom_gb` (CUDA's context, the caching allocator's fragmentation, NCCL's buffers, kernels'
    workspaces: what the plan does not count) is at most `device_gb`."""
    from tcal.preflight import check_plan
    from tcal.runtime.distributed import world_size
    from tcal.settings.retention import uniform_layers
    from tcal.teachers.load import teacher_architecture

    problem = headroom_problem(device_gb, headroom_gb)
    if problem:
        raise ConfigError(problem)
    check_plan(settings)
    num_layers = teacher_architecture(settings.teacher, settings.paths.cache_dir).num_hidden_layers
    retention = memory.retention_plan(settings, num_layers)
    keep = retention["keep_layers"] or uniform_layers(num_layers, retention["kept"] / num_layers)
    model = memory.build_model(settings, keep)
    trainer = settings.trainer
    device_type = "cpu" if str(trainer.accelerator) == "cpu" else "cuda"
    world = world_size(trainer)
    stages = {"calibration": memory.calibration_memory(settings, model, device_type, world)}
    stages.update({node.kind: memory.stage_memory(node, settings, model, world, device_type)
                   for _, node in settings.stage.stages()})
    step_kind = max(stages, key=lambda kind: stages[kind].peak)
    moments = {"step": memory.Moment({"training_step": stages[step_kind].peak},
                                     f"the largest step: {step_kind}'s peak (stages)", {"stage": step_kind}),
               "stage_end_gather": memory.gather_moment(settings, model, world),
               "final_evaluation": memory.final_eval_moment(settings, model)}
    moments = {name: moment for name, moment in moments.items() if moment is not None}
    notes = []
    if str(trainer.devices) in ("-1", "auto") and str(trainer.accelerator) != "cpu":
        notes.append(f"trainer.devices={trainer.devices} counts the GPUs visible here ({world} counted); "
                     f"pass trainer.devices=N for the node's")
    workers = settings.data.workers
    if workers is not None and workers > HOST_CPUS_PER_RANK:
        notes.append(f"data.workers={workers}: more tokenizing processes than the {HOST_CPUS_PER_RANK} CPUs this "
                     f"plan's SLURM job asks a rank (cpus_per_task); tcal refuses more than the CPUs it may use, and "
                     f"the token store starts at most one per CPU and per batch of documents")
    return {
        "teacher": settings.teacher.name, "model_type": model.teacher_config.model_type,
        "teacher_params": model.teacher_params, "student_params": model.student_params,
        "gdn_params": model.gdn_params, "num_layers": num_layers,
        "retention": {**retention, "converted": num_layers - retention["kept"]},
        "trainer": {"accelerator": str(trainer.accelerator), "devices": world, "precision": str(trainer.precision),
                    "kernels": "fla + flash (CUDA)" if device_type == "cuda" else "torch chunk + flash (CPU)"},
        "device_gb": device_gb, "headroom_gb": headroom_gb,
        "per_device_gb": {kind: memory.gb(stages[kind].peak) if kind in stages else None
                          for kind in memory.stage_order(stages)},
        "fits": all(part.fits(device_gb, headroom_gb) for part in [*stages.values(), *moments.values()]),
        "stages": {kind: stage.as_dict(device_gb, headroom_gb) for kind, stage in stages.items()},
        "moments": {name: moment.as_dict(device_gb, headroom_gb) for name, moment in moments.items()},
        "hours": hours_plan(settings, model, world),
        "host": host_plan(settings, model, stages, world, headroom_gb),
        "notes": notes,
    }


def headroom_problem(device_gb: float, headroom_gb: float) -> str | None:
    """Why `--headroom-gb` cannot be kept free on a device of `device_gb` (None: it can)."""
    if not 0 <= headroom_gb < device_gb:
        return f"--headroom-gb {headroom_gb:g}: expected 0 <= headroom < the device's {device_gb:g} GB"
    return None


def main(argv=None) -> None:
    """The `tcal-plan` console script."""
    from tcal.errors import config_error_exit
    from tcal.settings.compose import compose_here, hydra_configs, planned_jobs
    from tcal.settings.conversion import run_settings
    from tcal.tools import plan as package

    parser = argparse.ArgumentParser(description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for tcal (group=a,b plans each)")
    parser.add_argument("--json", action="store_true", help="one JSON object per plan")
    parser.add_argument("--markdown", action="store_true", help="one markdown table row per plan")
    parser.add_argument("--moments-markdown", action="store_true",
                        help="one markdown table row per plan: the three moments' peaks and the predicted hours")
    parser.add_argument("--slurm-env", action="store_true",
                        help="the environment hydra/launcher=slurm_gpu reads (memory, CPUs and GPUs of a node), "
                             "the largest over the plans: eval \"$(tcal-plan ... --slurm-env)\"")
    parser.add_argument("--device-gb", type=number(above=0, unit="GB"), default=80.0,
                        help="memory of one device (default 80)")
    parser.add_argument("--headroom-gb", type=number(at_least=0, unit="GB"), default=DEFAULT_HEADROOM_GB,
                        help=f"kept free on each device: fits means peak + headroom <= device "
                             f"(default {DEFAULT_HEADROOM_GB:g})")
    args = parser.parse_args(argv)
    problem = headroom_problem(args.device_gb, args.headroom_gb)
    if problem:
        parser.error(problem)
    try:
        with hydra_configs():
            runs = [(" ".join(job) or "(defaults)",
                     make_plan(run_settings(compose_here(job)), args.device_gb, args.headroom_gb))
                    for job in planned_jobs(args.overrides)]
    except ConfigError as err:
        config_error_exit(err)
    if args.slurm_env:
        print(slurm_env([plan for _, plan in runs]), flush=True)
    elif args.json:
        for label, plan in runs:
            print(json.dumps({"run": label, **plan}), flush=True)
    elif args.markdown:
        print(markdown_table(runs), flush=True)
    elif args.moments_markdown:
        print(moments_markdown(runs), flush=True)
    else:
        print("\n\n".join(format_plan(plan, label) for label, plan in runs), flush=True)
