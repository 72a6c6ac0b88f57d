"""Reading and writing the model's files and their static structure: config.json, safetensors,
checkpoint directories, the Engram table layout and token map. Depends on kernels only."""
