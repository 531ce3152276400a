"""A plan as text, markdown rows and the environment a SLURM launcher reads."""

from __future__ import annotations

from tcal.tools.plan.memory import KINDS, STAGE_ORDER, stage_order

ROWS = (  # (label, key in a stage's dict)
    ("init", "init"), ("strategy", "strategy"), ("precision", "precision"), ("batch per rank", "batch_per_rank"),
    ("tokens per step", "tokens_per_step"), ("steps", "steps"), ("weights GB", "weights_gb"),
    ("gradients GB", "gradients_gb"), ("optimizer GB", "optimizer_gb"), ("teacher GB", "teacher_gb"),
    ("buffers GB", "buffers_gb"), ("autocast copies GB", "autocast_gb"), ("gathered units GB", "gathered_gb"),
    ("activations GB", "activations_gb"), ("kl GB", "kl_gb"), ("peak GB", "peak_gb"), ("free GB", "free_gb"),
    ("fits", "fits"),
)
CHECKPOINTING = ("none", "checkpoint_mixers", "activation_checkpointing")
TABLE_ACTIVATIONS = "distill"  # the stage whose activations by checkpointing `markdown_table` shows
MOMENT_LABELS = {"step": "training step", "stage_end_gather": "stage-end gather",
                 "final_evaluation": "final evaluation"}


def _cell(value) -> str:
    if isinstance(value, list):
        return " x ".join(str(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def format_plan(plan: dict, label: str) -> str:
    """The plan as text: the run, one column per stage, the moments, the hours and every note."""
    ret, host = plan["retention"], plan["host"]
    kept = ret["keep_layers"] if ret["keep_layers"] is not None else f"({ret['note']})"
    lines = [f"tcal-plan {label}",
             f"teacher  {plan['teacher']} ({plan['model_type']}, {plan['num_layers']} layers): "
             f"{plan['teacher_params']:,} parameters",
             f"student  {plan['student_params']:,} parameters: {ret['kept']} softmax layers kept, "
             f"{ret['converted']} converted to Gated DeltaNet ({plan['gdn_params']:,} GDN parameters)",
             f"retention {ret['policy']}: keep {kept}",
             f"trainer  {plan['trainer']['devices']} x {plan['trainer']['accelerator']}, "
             f"{plan['trainer']['precision']}, kernels {plan['trainer']['kernels']}; fits {plan['device_gb']:g} GB "
             f"per device with {plan['headroom_gb']:g} GB headroom: {_cell(plan['fits'])}",
             f"host     {host['per_node_gb']:g} GB per node of {host['ranks']} ranks (rank 0 {host['rank0_gb']:g} GB): "
             f"SLURM mem_gb={host['slurm_mem_gb']}, cpus_per_task={host['cpus_per_task']}", ""]
    stages = [k for k in stage_order(plan["stages"]) if k in plan["stages"]]
    rows = [["", *stages]]
    rows += [[name, *(_cell(plan["stages"][k].get(key)) for k in stages)] for name, key in ROWS]
    rows += [[f"  activations, {setting}",
              *(_cell(plan["stages"][k]["activations_gb_by_checkpointing"].get(setting)) for k in stages)]
             for setting in CHECKPOINTING]
    rows.append(["host GB (statistics)", _cell(plan["stages"]["calibration"]["host_gb"]), *([""] * (len(stages) - 1))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines += ["", moments_line(plan), hours_line(plan)]
    for kind in stages:
        lines += [f"note ({kind}): {n}" for n in plan["stages"][kind]["notes"]]
    for name, moment in plan["moments"].items():
        parts = ", ".join(f"{part} {gb:g}" for part, gb in moment["parts_gb"].items())
        lines.append(f"note ({MOMENT_LABELS[name]}): {parts} GB; {moment['note']}")
    lines.append(f"note (hours): {plan['hours']['formula']}; not counted: {plan['hours']['not_counted']}")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def made_of(moment: dict) -> str:
    """The stage or the working set a moment's peak is made of, in parentheses ("" for none)."""
    which = moment.get("stage") or moment.get("largest")
    return f" ({which})" if which else ""


def moments_line(plan: dict) -> str:
    """The three moments' per-device peaks and whether each fits, on one line."""
    return "moments  " + "; ".join(f"{MOMENT_LABELS[name]}{made_of(moment)} {moment['peak_gb']:g} GB "
                                   f"(fits: {_cell(moment['fits'])})" for name, moment in plan["moments"].items())


def hours_line(plan: dict) -> str:
    """The predicted hours on each GPU type, with the peak and utilisation they assume."""
    hours = plan["hours"]
    cells = [f"{gpus} ({rate['peak_bf16_tflops']:g} TFLOPs bf16 peak, MFU {rate['mfu']:g}): {rate['hours']:g} h"
             for gpus, rate in hours["gpus"].items()]
    return f"hours    {'; '.join(cells)} ({hours['total_flops']:.3g} FLOPs of training stages)"


def table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def by_kind(cells: dict, key: str) -> str:
    """One figure of each training stage kind, `-` for a stage the run does not have."""
    return ", ".join(_cell(cells[k][key]) if k in cells else "-" for k in KINDS)


def markdown_table(plans: list[tuple[str, dict]]) -> str:
    """One row per plan: parameter counts and per-device peaks (GB), the distill activations by checkpointing."""
    head = ["run", "teacher params", "student params", "converted", *(f"{k} GB" for k in STAGE_ORDER),
            f"{TABLE_ACTIVATIONS} activations GB (none / mixers / layers)", f"tokens per step ({', '.join(KINDS)})",
            "fits"]
    rows = []
    for label, plan in plans:
        stages, per = plan["stages"], plan["per_device_gb"]
        acts = stages.get(TABLE_ACTIVATIONS, {}).get("activations_gb_by_checkpointing", {})
        rows.append([label, f"{plan['teacher_params'] / 1e9:.2f}B", f"{plan['student_params'] / 1e9:.2f}B",
                     f"{plan['retention']['converted']} of {plan['num_layers']}",
                     *(_cell(per[k]) for k in STAGE_ORDER), " / ".join(_cell(acts.get(k)) for k in CHECKPOINTING),
                     by_kind(stages, "tokens_per_step"), _cell(plan["fits"])])
    return table(head, rows)


def moments_markdown(plans: list[tuple[str, dict]]) -> str:
    """One row per plan: the per-device peak (GB) of each moment and whether all fit, the training tokens of each
    stage and the predicted hours on each GPU type."""
    gpus = list(plans[0][1]["hours"]["gpus"]) if plans else []
    head = ["run", *(f"{MOMENT_LABELS[name]} GB" for name in MOMENT_LABELS), "fits",
            f"tokens ({', '.join(KINDS)})", *(f"hours {g}" for g in gpus)]
    rows = []
    for label, plan in plans:
        moments = plan["moments"]
        peaks = [f"{moments[n]['peak_gb']:g}{made_of(moments[n])}" if n in moments else "-" for n in MOMENT_LABELS]
        rows.append([label, *peaks, _cell(plan["fits"]), by_kind(plan["hours"]["stages"], "tokens"),
                     *(f"{plan['hours']['gpus'][g]['hours']:g}" for g in gpus)])
    return table(head, rows)


def slurm_env(plans: list[dict]) -> str:
    """`export` of the variables conf/hydra/launcher/slurm_gpu.yaml reads, from the plans' host figures (the
    largest of each over the plans: one SLURM preset serves every job of a sweep)."""
    mem = max(plan["host"]["slurm_mem_gb"] for plan in plans)
    cpus = max(plan["host"]["cpus_per_task"] for plan in plans)
    gpus = max(plan["trainer"]["devices"] for plan in plans)
    return f"export TCAL_SLURM_MEM_GB={mem} TCAL_CPUS_PER_TASK={cpus} TCAL_GPUS_PER_NODE={gpus}"
