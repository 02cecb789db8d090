"""Measuring a cache plan: deterministic token samples from text sources (`samples`), teacher-forced accuracy
of a plan — Δppl, KL, top-1 (`eval`) and the sweep's report files (`report`). In the data flow it sits between
the model and calibration: `mlaquant.calib`'s plan search and sweep score every candidate with it.
"""
