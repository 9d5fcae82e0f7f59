"""Tests against a real one-node SLURM cluster (``cluster.sh``, the ``slurm_cluster`` fixture); ``-m slurm``."""
