"""The gate's model: budgets and budgets files, checks built from them, the runner that runs a
check's scenario and judges it into an outcome, baselines, reports, plots, cache policies and
the engine faults a run can be put under. Nothing here imports pytest."""
