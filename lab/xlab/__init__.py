"""xlab: the lab that measures xpool (arms, experiments, benchmarks, memory study, correctness gate, plots, report,
the notebooks' helpers). It imports xpool and tapegpt; neither imports it. Paths come from `xlab.paths`.
"""
