"""The differential matrix: each row is one fsdp-train configuration, run beside PyTorch's FSDP2
by tests/interop/test_differential.py. Pure data (no torch), so CMake can list the rows quickly:

    python3 tests/interop/rows.py          # one row name per line

Fields:
    world      ranks (fsdprun --nproc-per-node, torch.multiprocessing.spawn)
    overrides  `--section.key=value` on top of tests/interop/base.yaml, for both programs
    tolerance  "fp32" or "bf16" (test_differential.py: TOLERANCES)
    plant      the deliberate error in the reference (fsdp2_train.py --plant) that the row must
               catch: the row fails with it, which shows the comparison can fail
    reference  what PyTorch runs, in words (docs/interop.md lists the rows)
"""

ROWS = {
    "full_shard_w2": dict(
        world=2, overrides=[], tolerance="fp32", plant="divide-factor",
        reference="fully_shard per block and on the root, 1-D mesh of 2"),
    "prefetch_depth_3_w2": dict(
        world=2, overrides=["--fsdp_config.prefetch_depth=3"], tolerance="fp32", plant="divide-factor",
        reference="fully_shard per block and on the root with FSDP2's implicit prefetch (fsdp-train all-gathers "
                  "3 groups ahead in forward and backward: the same numbers, issued earlier)"),
    "full_shard_w3_uneven": dict(
        world=3, overrides=[], tolerance="fp32", plant="divide-factor",
        reference="fully_shard over 3 ranks: dim-0 sizes 10, 16 and 24·k leave uneven shards"),
    "shard_grad_op_w2": dict(
        world=2, overrides=["--fsdp_config.sharding_strategy=SHARD_GRAD_OP"], tolerance="fp32",
        plant="divide-factor", reference="fully_shard(reshard_after_forward=False) everywhere"),
    "reshard_after_forward_2_w4": dict(
        world=4, overrides=["--fsdp_config.reshard_after_forward=2"], tolerance="fp32", plant="divide-factor",
        reference="fully_shard(block, reshard_after_forward=2) over 4 ranks"),
    "hsdp_2x2_accumulation": dict(
        world=4, overrides=["--fsdp_config.sharding_strategy=HYBRID_SHARD", "--fsdp_config.replicate_degree=2",
                            "--training.gradient_accumulation_steps=2"],
        tolerance="fp32", plant="skip-all-reduce",
        reference="2x2 (replicate, shard) mesh; set_requires_all_reduce on the last micro-batch only"),
    "no_shard_vs_ddp_w2": dict(
        world=2, overrides=["--fsdp_config.sharding_strategy=NO_SHARD", "--training.gradient_accumulation_steps=2"],
        tolerance="fp32", plant="divide-factor",
        reference="DistributedDataParallel, no_sync() on all but the last micro-batch"),
    "bf16_fp32_reduce_w2": dict(
        world=2, overrides=["--fsdp_config.param_dtype=bfloat16", "--fsdp_config.reduce_dtype=float32"],
        tolerance="bf16", plant="divide-factor",
        reference="MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)"),
    "bf16_bf16_reduce_w2": dict(
        world=2, overrides=["--fsdp_config.param_dtype=bfloat16", "--fsdp_config.reduce_dtype=bfloat16"],
        tolerance="bf16", plant="divide-factor",
        reference="MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)"),
    "accumulation_w2": dict(
        world=2, overrides=["--training.gradient_accumulation_steps=3"], tolerance="fp32",
        plant="accumulation-undivided",
        reference="set_requires_gradient_sync(False) on all but the last of 3 micro-batches"),
    "activation_checkpointing_w2": dict(
        world=2, overrides=["--fsdp_config.activation_checkpointing=true"], tolerance="fp32",
        plant="divide-factor", reference="torch.utils.checkpoint(use_reentrant=True) around every block"),
    "frozen_embedding_clip_w2": dict(
        world=2, overrides=["--model.freeze=[tok_embeddings]", "--training.max_grad_norm=0.3"], tolerance="fp32",
        plant="train-frozen",
        reference="tok_embeddings.weight requires_grad=False; clip_grad_norm_(0.3) on the rest (clips every step)"),
    "tensor_parallel_dp2_tp2": dict(
        world=4, overrides=["--fsdp_config.model_parallel_size=2"], tolerance="fp32", plant="divide-factor",
        reference="parallelize_module (Colwise wq/wk/wv/w1, Rowwise wo/w2, vocab-parallel embedding and head "
                  "with loss_parallel) on the tp dim, then fully_shard over dp"),
    "tensor_parallel_whole_vocab_dp2_tp2": dict(
        world=4, overrides=["--fsdp_config.model_parallel_size=2", "--fsdp_config.vocab_parallel=false"],
        tolerance="fp32", plant="divide-factor",
        reference="the same plan with the embedding and the head whole on every tp rank"),
}

if __name__ == "__main__":
    print("\n".join(ROWS))
