"""Measuring a cache plan: deterministic token samples from text sources (`samples`), teacher-forced accuracy
of a plan — Δppl, KL, top-1 (`eval`), peer baselines for the sweep (`peers`) and the sweep's report files
(`report`). In the data flow it sits between the model and calibration: `mlaquant.calib`'s plan search and sweep
score every candidate with it.
"""
