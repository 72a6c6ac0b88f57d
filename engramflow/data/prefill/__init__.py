"""prefill-job: next-token log-probabilities for every prompt of a dataset (job.py), in replica
mode (replica.py) or pipeline mode (pipeline_mode.py), both driven by prompts.py."""
