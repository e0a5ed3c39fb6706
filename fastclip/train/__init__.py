"""The trainer (`fastclip train`): one process, torchrun or srun, every mode through the same code.

The path of one batch (fastclip/train/trainer.py, top to bottom):

    shards --fastclip.data.TrainStream.epoch(e)-->  (images [B,3,H,W], texts [B,ctx] int64, indices [B] int64,
        groups [B] int64) this rank's B samples of the global batch; the stream's position is part of every
        checkpoint; groups reach the loss (groups=) only where a manifest says samples share them
    --> to the device; images uint8 -> float, normalised there (data.device_normalize, fastclip/data/pixels.py)
    --> DDP( TowersWithLoss )                       one module holding the towers AND the loss, so the loss's
        |   encode_image / encode_text              temperature is a DDP parameter averaged with the towers
        |     (autocast bf16/fp16, optional torch.compile, optional gradient checkpointing)
        |   F.normalize in fp32
        |   loss_fn(image_features, text_features, indices, epoch=e)     fastclip.losses.build_loss(...)
        |     one all_gather of features+indices (+ the input-check words; no autograd), per-sample state
        |     sharded by owner rank (its writes journaled), gamma schedule by epoch; returns this rank's surrogate
    --> backward                                    DDP all-reduces (averages) every gradient, temperature too
    --> NaN/Inf decision on the device              from the all-reduced gradient norm (guards.py)
    --> optimizer step                              groups decay / no_decay (ndim<2) / temperature (own lr:
        |                                           cosine, const or step_thresh applied on-device); fused AdamW
        |                                           skips a NaN step itself (found_inf), the journal is rolled back
        |   lr = get_lr(samples_seen // global_batch)   pure warmup + cosine to lr_min
        |   GradScaler (fp16), clip_grad_norm_, loss_fn.clamp_() (logit_scale in [0, ln 100])
        |   (no host read and no other collective until here: tests/test_faults.py)
    --> every log_every steps: skips, input checks, loss_fn.metrics .item() -> progress line, metrics.jsonl,
        |                                           TensorBoard, W&B; stop signals agreed
    --> every N steps / M minutes: checkpoints/step_<N>/{model.pt, rank_<r>.pt} + `latest`  (fastclip/checkpoint)
    --> every N steps: fastclip.eval.run_evals on every rank -> metrics.jsonl "eval/..."

Modules: config.py (every knob, YAML + overrides + checks), trainer.py (the loop), catalog_checks.py (the data
catalog and the checks made with it before the first step, `--check` too), preflight.py (the operator's input, run
folder, resume and pretrained files, notes on legal but unlikely settings), data.py (the train stream and the
device's Normalize), schedules.py (the lr of the towers and of the temperature), evaluation.py (the scheduled
evaluations), net.py (towers + loss + engine, built once: build_net), engine.py (the backend: DDP or DeepSpeed
ZeRO-1/2/3, train.distributed), accumulate.py (gradient accumulation, GradCache, exact for the FastCLIP estimator:
optim.accum_steps), metrics.py (rank-0 reporting; the names of the metrics), parts.py (the run's checkpointed parts
that need the engine), guards.py (fault handling), cli.py (`main(argv)`), reshard.py (`fastclip reshard`: rank files
to another world size).
Launch and rank discovery (torchrun / SLURM / single process):
fastclip/distributed.py; optimizers and schedules: fastclip/optim; checkpoints (atomic step folders, model.pt and
rank files, resume and resharding): fastclip/checkpoint.
"""
