"""The DeepSeek V4.1 Flash text model (the `v41` backbone), one concept per file:
config (keys and layer roles), rope, hc (hyper-connections), sparse_attention, compressor,
indexer, attention, moe, block, cache (per-session caches), weights (checkpoint reading) and
model (the stage that stacks blocks for a layer range)."""
