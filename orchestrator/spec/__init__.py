"""The job spec: the job file's dataclass tree, its sections, and the loaders that build it."""
