"""The sections of the YAML job file, one module per concern: `training` (model, data, train),
`cluster` (cluster, slurm, profile), `resilience` (fault_tolerance, checkpoint, faults and the
control plane's defaults). `JobConfig`, which holds them, and the loader are config.py; code and
users import every one of them from `oobleck_hpc.config`.
"""
