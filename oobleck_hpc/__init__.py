"""oobleck_hpc: resilient large-model training on Slurm with pipeline templates (Oobleck, SOSP'23)."""

__version__ = "0.1.0"
