"""xlab: the lab that measures xpool — allocator registry, experiments, benchmarks, memory study, correctness
gate, plots, report and the notebooks' helpers. It imports xpool and the workload (tapegpt); neither imports it.

Paths to the repository's data/, figures/, notebooks/ come from `xlab.paths` (the working directory or
$XPOOL_REPO), never from where the package is installed.
"""
