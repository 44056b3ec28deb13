"""Training experiments: one GPU (`single_gpu.run`) and data-parallel scaling (`ddp.run`), each returning a
tidy DataFrame with provenance and writing it to data/*.csv. CLI: `python -m xlab.experiments --help`."""
