"""`tcal-plan [overrides] [--json|--markdown|--slurm-env] [--device-gb 80] [--headroom-gb 8]`: what a run holds per
device and per host, from its configs alone.

The overrides are those of `tcal` (an experiment, a teacher, a trainer, `stage.*`, ...). The teacher is built from
its architecture on the meta device (`teachers.load.teacher_architecture`: a paper teacher's shipped config.json or
a local folder's; no weights, no data, no GPU), then the student with the retention policy's layers converted.

For calibration, Stage 1 (align) and Stage 2 (distill) the plan adds up, per device (GB = 2^30 bytes):

- weights, gradients and optimizer (`Strategy.state_bytes`): under `*-true` everything in the compute dtype (AdamW's
  two moments too); under `*-mixed` the student is float32 (`pipeline` casts it): 4-byte weights and gradients,
  8 bytes of moments per trainable parameter;
- autocast copies: under `*-mixed`, the compute-dtype copy of each trainable Linear weight that autograd keeps for
  backward (Lightning's autocast caches none), by checkpointing setting (`Step.autocast_params`);
- teacher: frozen, in `teacher.dtype` (Stage 2: `stage.teacher_dtype` when set), whole on every device;
- buffers: DDP's bucket copy of the gradients;
- gathered units: under FSDP2 (`trainer.strategy=fsdp`: each decoder layer and GDN mixer a unit), the root's
  parameters and two layer units with their unsharded gradients (`fsdp_gathered`);
- activations: what autograd keeps for backward at the configured per-rank batch (`stage.batch_size` x
  `stage.seq_len`), traced through the real modules on the meta device, with the attention and delta-rule kernels
  standing in by what the flash (CPU, CUDA) and fla (CUDA) kernels keep, plus the backward's working set; with and
  without checkpointing. Under autocast the float32 student is traced (an upper bound: matmul outputs are in the
  compute dtype there, while the residual stream, the norms and the GDN's recurrence are float32);
- kl: the fused KL of Stage 2 (`training/kd.py`) at its peak.

Strategies (`trainer.strategy`, the same for both stages): one device and `ddp` replicate everything; `fsdp` shards
the weights, gradients and optimizer states over the ranks, and under `bf16-mixed` gathers parameters in bfloat16
(no autocast copies then) and reduce-scatters gradients from float32 (`tcal.training.stages.fsdp_policy`). The
peak is the sum of all of them, at the start of a backward (the previous step's gradients counted too: Lightning
zeroes them between the forward and the backward). A stage fits when its peak plus `--headroom-gb` is at most
`--device-gb`. It counts allocated tensors: not CUDA's context, nor free memory an allocator keeps (glibc's heap on
the CPU, PyTorch's cache on CUDA); the headroom is for those. The host section is what a node's ranks hold in host
memory (`host_plan`) and what a SLURM job asks for it; `--slurm-env` prints it as the variables
conf/hydra/launcher/slurm_gpu.yaml reads.

Three moments are planned (`moments`), each fitting by the same rule: the training step (the largest stage peak
above), the stage-end gather (`gather_moment`: under FSDP the full student gathered on every rank next to its
shards and the teacher, once `tcal.training.run.release_stage` has freed optimizer states and gradients) and the
final evaluation (`final_eval_moment`: teacher, trained student and the largest working set of perplexity, the
harness and RULER, whose logits are bounded by a chunk of positions). `fits` holds when every stage and every
moment fits. `hours` predicts the training stages' hours on 8 x H100 and 8 x A100 from a FLOPs model
(`FLOPS_FORMULA`, with the peak bf16 throughput and the utilisation `GPU_RATES` assume: H100 989 TFLOPs at MFU 0.35,
A100 312 TFLOPs at MFU 0.45; planning constants, not measurements). `--moments-markdown` prints one row per plan
of the three moments and the hours.

What a training stage holds, trains, runs and costs is asked of its settings, never of its kind
(`tcal.settings.stage.TrainingStageSettings`: `trains`, `runs`, `checkpointing`, `stage_teacher_dtype`,
`logit_kl_chunk`, `steps`): a new stage kind brings its own terms. The modules: `trace` (what autograd keeps, on the
meta device), `memory` (per device: the stages and the moments), `cost` (the hours), `staging` (host memory of a
node), `output` (text, markdown rows, SLURM variables) and `cli` (`make_plan`, `main`).
`make bench ARGS=plan` checks the plan against a measured Stage 2, `make bench ARGS=plan_activations` its activation
model at a paper width. A configuration error prints one line and exits with code 2, as `tcal` does.
"""

from tcal.tools.plan.cli import main, make_plan

__all__ = ["main", "make_plan"]
