"""What runs the models, below the trainer and the inference session: compilation
(compile.py: by block, regional.py, or whole), the attention backend (attention.py),
FSDP2 helpers (sharding.py) and stage timing (clock.py). Imports no other diffrl package
but the config schema."""
