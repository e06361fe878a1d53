"""The parallel and cluster layer: process meshes, the blocks wrappers treat one by one,
SLURM, signals and the agreed stop.

See docs/architecture.md for what each module does and may import.
"""
