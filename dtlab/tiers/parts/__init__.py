"""What the tiers are built from and no tier on its own: the Strategy base, checkpoints, the pieces of context
parallelism, FSDP's and DDP's quantised communication, the pipeline's stages, the replica groups of ``ft`` and
``diloco``. ``ls dtlab/tiers`` lists the course's tiers; their parts live here."""
